"""hf_dsinfer.hybrid: DeepSpeed's Hybrid Engine for HF / peft training loops (``HybridEngine``) and Trainer
(``HybridEngineCallback``). See docs/hybrid.md."""

from .callback import HybridEngineCallback
from .engine import HybridEngine
from .stats import HybridStats, IterationStats
from .weights import TrainingWeights, UnsupportedAdapterError

__all__ = [
    "HybridEngine",
    "HybridEngineCallback",
    "HybridStats",
    "IterationStats",
    "TrainingWeights",
    "UnsupportedAdapterError",
]
