"""Continuous batching on fused layers over a paged KV cache (docs/serving.md).

``ServingEngine`` is the engine (a background stepping thread, ``submit`` -> ``RequestHandle``); ``generate_batch`` /
``init_continuous_batching`` on an injected model run it behind transformers' own API (:mod:`.hf_api`), and
``last_batch_stats(model)`` returns the stats of the model's last ``generate_batch`` call.
"""

from .engine import ServingEngine, ServingStats
from .handle import FINISH_REASONS, RequestHandle
from .hf_api import last_batch_stats

__all__ = ["FINISH_REASONS", "RequestHandle", "ServingEngine", "ServingStats", "last_batch_stats"]
