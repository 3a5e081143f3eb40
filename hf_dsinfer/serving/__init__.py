"""Continuous batching on fused layers over a paged KV cache (docs/serving.md).

``ServingEngine`` is the engine (a background stepping thread, ``submit`` -> ``RequestHandle``); ``generate_batch`` /
``init_continuous_batching`` on an injected model run it behind transformers' own API (:mod:`.hf_api`).
"""

from .engine import FINISH_REASONS, RequestHandle, ServingEngine, ServingStats

__all__ = ["FINISH_REASONS", "RequestHandle", "ServingEngine", "ServingStats"]
