"""Gated activation ``act(gate) * up`` for x ``[..., 2I]`` laid out as ``[gate | up]`` (fused gate_up projections).

The reference matches HF's MLPs bit for bit in spirit: ``ACT2FN[name](gate) * up`` evaluates the activation in
fp32, rounds it to the model dtype, then multiplies by ``up`` in that dtype. The kernel rounds at the same points,
so the remaining differences are transcendental-function ulps.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_tensor
from ._triton import tl, triton
from .backend import use_triton
from .norms import cast_rne, needs_bf16_fix

__all__ = ["ACTIVATIONS", "act_and_mul", "act_and_mul_torch", "act_and_mul_triton"]

# Name -> constexpr code for the kernel. Names follow transformers' ACT2FN keys where they differ.
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_ALIASES = {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # [N, 2I] rows of [gate | up] (row stride stride_x, unit column stride)
    out_ptr,  # [N, I] contiguous
    stride_x,
    inter,
    ACT: tl.constexpr,
    FIX_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:
        # tanh via exp (tl.math.tanh is not in every Triton release); 2*sigmoid(2z) - 1 == tanh(z), overflow-safe.
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * z) - 1.0))
    # Round the activation to the output dtype before the product, as HF's `act(gate) * up` does.
    a = cast_rne(a, out_ptr.dtype.element_ty, FIX_BF16).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, cast_rne(a * u, out_ptr.dtype.element_ty, FIX_BF16), mask=mask)


def _activation_code(activation: str) -> int:
    name = _ALIASES.get(activation, activation)
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[name]


def act_and_mul_triton(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Triton launcher for :func:`act_and_mul`. Validates its arguments first."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    code = _activation_code(activation)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must have an even last dim [..., 2I] holding [gate, up], got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    block = min(1024, triton.next_power_of_2(inter))
    grid = (x2.shape[0], triton.cdiv(inter, block))
    _act_and_mul_kernel[grid](
        x2, out, x2.stride(0), inter, ACT=code, FIX_BF16=needs_bf16_fix(x.dtype), BLOCK=block,
        num_warps=4 if block >= 512 else 2,
    )
    return out


def act_and_mul_torch(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Plain-torch reference: ``act(gate) * up`` in ``x.dtype``, the same ops as transformers' ACT2FN."""
    code = _activation_code(activation)
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter], x[..., inter:]
    if code == 0:
        a = torch.nn.functional.silu(gate)
    elif code == 1:
        a = torch.nn.functional.gelu(gate)
    else:
        a = torch.nn.functional.gelu(gate, approximate="tanh")
    return a * up


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Return ``act(x[..., :I]) * x[..., I:]`` with shape ``[..., I]`` for ``x [..., 2I]``.

    ``activation`` is ``silu``, ``gelu`` (erf) or ``gelu_tanh`` (ACT2FN's ``gelu_pytorch_tanh``; that name and
    ``swish`` are accepted too). Dispatches on ``HF_DSINFER_BACKEND``.
    """
    if use_triton(x):
        return act_and_mul_triton(x, activation)
    return act_and_mul_torch(x, activation)
