"""hf_dsinfer: DeepSpeed-Inference-class speed for HuggingFace Transformers models, in pure Python + Triton.

``import hf_dsinfer`` registers the ``dsinfer`` quantization method with transformers and adds the
``inference_config=`` keyword to ``from_pretrained``. Importing it again is harmless.
"""

from .hybrid import HybridEngine, HybridEngineCallback
from .integration.config import InferenceConfig, TensorParallelConfig
from .integration.engine import InferenceEngine, init_inference
from .integration.hooks import register as _register

__version__ = "0.1.0"

_register()

__all__ = [
    "HybridEngine",
    "HybridEngineCallback",
    "InferenceConfig",
    "InferenceEngine",
    "TensorParallelConfig",
    "init_inference",
    "__version__",
]
