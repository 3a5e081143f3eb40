"""hf_dsinfer: DeepSpeed-Inference-class speed for HuggingFace Transformers models, in pure Python + Triton.

``import hf_dsinfer`` registers the ``dsinfer`` quantization method with transformers and adds the
``inference_config=`` keyword to ``from_pretrained``. Importing it again is harmless.

The import is light (no torch, no transformers model code): the registration runs the moment transformers imports
``transformers.quantizers.auto`` / ``transformers.modeling_utils`` (right away if they are imported already), which
every way of loading a model does first. The public names below are imported on first use (PEP 562), so
``hf-dsinfer --help`` or a script that only reads ``hf_dsinfer.__version__`` pays for none of it; the Hybrid Engine's
dependencies (peft, transformers' Trainer) likewise load only with ``HybridEngine``/``HybridEngineCallback``.
"""

from typing import TYPE_CHECKING, Any

from .integration.post_import import when_imported as _when_imported

__version__ = "0.1.0"


def _register_quantization_method(_module: Any) -> None:
    from .integration.hooks import register_quantization_method

    register_quantization_method()


def _install_from_pretrained_hook(_module: Any) -> None:
    from .integration.hooks import install_from_pretrained_hook

    install_from_pretrained_hook()


_when_imported("transformers.quantizers.auto", _register_quantization_method)
_when_imported("transformers.modeling_utils", _install_from_pretrained_hook)

# public name -> the submodule that defines it (imported on first attribute access)
_LAZY = {
    "InferenceConfig": ".integration.config",
    "TensorParallelConfig": ".integration.config",
    "InferenceEngine": ".integration.engine",
    "init_inference": ".integration.engine",
    "HybridEngine": ".hybrid",
    "HybridEngineCallback": ".hybrid",
}

if TYPE_CHECKING:  # for type checkers and IDEs; at run time these come from __getattr__
    from .hybrid import HybridEngine, HybridEngineCallback
    from .integration.config import InferenceConfig, TensorParallelConfig
    from .integration.engine import InferenceEngine, init_inference


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
