"""hf_dsinfer: DeepSpeed-Inference-class speed for HuggingFace Transformers models, in pure Python + Triton.

``import hf_dsinfer`` registers the ``dsinfer`` quantization method with transformers and adds the
``inference_config=`` keyword to ``from_pretrained``. Importing it again is harmless.

The Hybrid Engine (``HybridEngine``, ``HybridEngineCallback``) is imported on first use: it needs peft and
transformers' Trainer machinery, which would otherwise cost every ``import hf_dsinfer`` several seconds.
"""

from typing import Any

from .integration.config import InferenceConfig, TensorParallelConfig
from .integration.engine import InferenceEngine, init_inference
from .integration.hooks import register as _register

__version__ = "0.1.0"

_register()

_LAZY = {"HybridEngine": ".hybrid", "HybridEngineCallback": ".hybrid"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "HybridEngine",
    "HybridEngineCallback",
    "InferenceConfig",
    "InferenceEngine",
    "TensorParallelConfig",
    "init_inference",
    "__version__",
]
