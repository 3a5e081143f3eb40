"""hf_dsinfer.modules: nn.Modules built on the kernels (norms, rotary, attention, MLPs, decoder layer, KV cache).

Each module calls the public kernel dispatchers, so it takes the Triton path on CUDA (or when
``HF_DSINFER_BACKEND=triton``) and the torch references elsewhere. Nothing here knows HF model internals: policies
(``hf_dsinfer.policies``) map HF weights onto these modules.
"""

from .attention import AttentionSpec, FusedAttention, StepContext
from .kv_cache import StaticKVCache
from .layer import LINEAR_WEIGHTS, PARAM_NAMES, RESIDUAL_STYLES, FusedDecoderLayer, LayerSpec
from .linear import Linear, gemm_layout, linear_layout
from .mlp import FusedMLP, MLPSpec
from .norms import FusedNorm, NormSpec
from .rotary import RotaryTable

__all__ = [
    "LINEAR_WEIGHTS",
    "PARAM_NAMES",
    "RESIDUAL_STYLES",
    "AttentionSpec",
    "FusedAttention",
    "FusedDecoderLayer",
    "FusedMLP",
    "FusedNorm",
    "LayerSpec",
    "Linear",
    "MLPSpec",
    "NormSpec",
    "RotaryTable",
    "StaticKVCache",
    "StepContext",
    "gemm_layout",
    "linear_layout",
]
