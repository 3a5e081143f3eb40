"""hf_dsinfer.generation: the fast generate loop, decode-step CUDA graphs, and generate timing.

``install_generate(model, cfg, injection)`` gives a model (one instance) hf_dsinfer's ``generate``;
``last_generate_stats(model)`` returns the timing of its last call. See docs/generation.md.
"""

from .api import install_generate
from .graph_runner import GraphRunner, StaticInput, batch_buckets, default_batch_buckets
from .stats import GenerateStats, last_generate_stats, step_timing

__all__ = [
    "GenerateStats",
    "GraphRunner",
    "StaticInput",
    "batch_buckets",
    "default_batch_buckets",
    "install_generate",
    "last_generate_stats",
    "step_timing",
]
