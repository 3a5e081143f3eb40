"""One tolerance table for the whole suite: kernels against their references, fused models against HF eager.

Kernel rows compare one op with its torch reference (the same math, other rounding). Model rows compare whole
tiny models (several layers of accumulated rounding) with HF's eager model.
"""

import torch

KERNEL_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}

# Attention accumulates over many keys: a little looser.
ATTENTION_TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

MODEL_LOGITS_TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=2e-2),
    torch.bfloat16: dict(atol=1e-1, rtol=5e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, table: dict = KERNEL_TOL, dtype=None, msg: str = ""):
    """``torch.testing.assert_close`` with the tolerance of ``dtype`` (default: the expected tensor's)."""
    tol = table[dtype or expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), msg=lambda m: f"{msg}\n{m}" if msg else m, **tol)
