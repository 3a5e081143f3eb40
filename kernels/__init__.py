"""Triton kernels with plain-torch references, installed as ``hf_dsinfer.kernels``. Imports only torch and triton.

See docs/kernels.md for the contract every kernel follows.
"""

from .backend import describe, get_backend, interpreter_enabled, triton_available, use_triton

__all__ = ["describe", "get_backend", "interpreter_enabled", "triton_available", "use_triton"]

# attention kernels (kv cache, prefill, decode, encoder)
from .decode_attention import decode_attention, decode_attention_torch, decode_attention_triton  # noqa: E402
from .encoder_attention import encoder_attention, encoder_attention_torch, encoder_attention_triton  # noqa: E402
from .kv_cache import store_kv, store_kv_torch, store_kv_triton  # noqa: E402
from .prefill_attention import prefill_attention, prefill_attention_torch, prefill_attention_triton  # noqa: E402

__all__ += [
    "decode_attention", "decode_attention_torch", "decode_attention_triton",
    "encoder_attention", "encoder_attention_torch", "encoder_attention_triton",
    "prefill_attention", "prefill_attention_torch", "prefill_attention_triton",
    "store_kv", "store_kv_torch", "store_kv_triton",
]  # fmt: skip

# norms, rotary, activations, sampling
from .activations import act_and_mul, act_and_mul_torch, act_and_mul_triton  # noqa: E402
from .norms import (  # noqa: E402
    layer_norm,
    layer_norm_torch,
    layer_norm_triton,
    rms_norm,
    rms_norm_torch,
    rms_norm_triton,
)
from .rotary import apply_rotary_, apply_rotary_torch, apply_rotary_triton  # noqa: E402
from .sampling import filter_logits, sample, sample_torch  # noqa: E402

__all__ += [
    "act_and_mul", "act_and_mul_torch", "act_and_mul_triton",
    "layer_norm", "layer_norm_torch", "layer_norm_triton",
    "rms_norm", "rms_norm_torch", "rms_norm_triton",
    "apply_rotary_", "apply_rotary_torch", "apply_rotary_triton",
    "filter_logits", "sample", "sample_torch",
]  # fmt: skip
