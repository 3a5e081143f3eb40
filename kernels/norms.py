"""RMSNorm and LayerNorm over the last dim, optionally fused with the residual add.

Each op comes as ``foo`` (dispatch), ``foo_triton`` (launcher) and ``foo_torch`` (reference); see docs/kernels.md.

Numerics follow HF's modules so that swapping them in changes nothing but rounding noise:

* ``weight_offset == 0`` (LlamaRMSNorm and its many copies): normalize in fp32, round to the input dtype, *then*
  multiply by ``weight`` (``weight * x.to(input_dtype)``).
* ``weight_offset != 0`` (Gemma/Gemma2/Gemma3 RMSNorm with ``1 + w``): normalize in fp32, multiply by
  ``(weight_offset + w)`` in fp32, round once at the end.
* LayerNorm: everything in fp32, one rounding at the end (what ``nn.LayerNorm`` does for half inputs).

With ``residual``, ``r = x + residual`` is rounded to the input dtype first (HF adds in the model dtype) and that
rounded sum is both returned and normalized.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_same_dtype, check_shape, check_tensor
from ._triton import tl, triton
from .backend import interpreter_enabled, use_triton

__all__ = ["layer_norm", "layer_norm_torch", "layer_norm_triton", "rms_norm", "rms_norm_torch", "rms_norm_triton"]

NormOut = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@triton.jit
def cast_rne(x, dtype: tl.constexpr, FIX_BF16: tl.constexpr):
    """Cast fp32 ``x`` to ``dtype``; with ``FIX_BF16`` round to nearest-even by hand first.

    Triton's interpreter truncates fp32 -> bf16 (GPUs round to nearest even), which biases every interpreted bf16
    result toward zero by up to one ulp. Launchers set FIX_BF16 only when interpreting bf16 outputs, so compiled
    kernels pay nothing.
    """
    if FIX_BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def needs_bf16_fix(dtype: torch.dtype) -> bool:
    """Whether a launcher must pass ``FIX_BF16=True`` to :func:`cast_rne` for outputs of ``dtype``."""
    return dtype == torch.bfloat16 and interpreter_enabled()


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels: one program per row, the whole row in registers (BLOCK = next power of two >= C, masked).
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, C] input rows (row stride stride_x, unit column stride)
    res_ptr,  # [N, C] residual rows (read only when HAS_RESIDUAL)
    w_ptr,  # [C] weight
    out_ptr,  # [N, C] normalized output, contiguous
    res_out_ptr,  # [N, C] x + residual, contiguous (written only when HAS_RESIDUAL)
    stride_x,
    stride_r,
    C,
    eps,
    weight_offset,
    HAS_RESIDUAL: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    FIX_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the model dtype before normalizing it: HF adds in that dtype.
        s = cast_rne(x + r, res_out_ptr.dtype.element_ty, FIX_BF16)
        tl.store(res_out_ptr + row * C + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / C
    y = x * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if CAST_BEFORE_WEIGHT:
        # Llama order: round the normalized row, then scale (the product of two rounded values rounds once).
        y = cast_rne(y, out_ptr.dtype.element_ty, FIX_BF16).to(tl.float32) * w
    else:
        y = y * (w + weight_offset)
    tl.store(out_ptr + row * C + cols, cast_rne(y, out_ptr.dtype.element_ty, FIX_BF16), mask=mask)


@triton.jit
def _layer_norm_kernel(
    x_ptr,  # [N, C] input rows (row stride stride_x, unit column stride)
    res_ptr,  # [N, C] residual rows (read only when HAS_RESIDUAL)
    w_ptr,  # [C] weight
    b_ptr,  # [C] bias (read only when HAS_BIAS)
    out_ptr,  # [N, C] normalized output, contiguous
    res_out_ptr,  # [N, C] x + residual, contiguous (written only when HAS_RESIDUAL)
    stride_x,
    stride_r,
    C,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FIX_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = cast_rne(x + r, res_out_ptr.dtype.element_ty, FIX_BF16)
        tl.store(res_out_ptr + row * C + cols, s, mask=mask)
        x = s.to(tl.float32)
    mean = tl.sum(x, axis=0) / C
    # Two-pass variance on the register-resident row: no cancellation from E[x^2] - E[x]^2.
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / C
    y = xc * tl.rsqrt(var + eps)
    y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * C + cols, cast_rne(y, out_ptr.dtype.element_ty, FIX_BF16), mask=mask)


# Rows wider than this do not fit in registers (a 65536-wide row spills on sm_80 and sm_90 even with 16 warps): the
# kernels below loop over chunks of _WIDE_BLOCK columns instead, reading the row once per pass.
_MAX_ROW_BLOCK = 16384
_WIDE_BLOCK = 4096


@triton.jit
def _rms_norm_wide_kernel(
    x_ptr,  # [N, C] input rows (row stride stride_x, unit column stride)
    res_ptr,  # [N, C] residual rows (read only when HAS_RESIDUAL)
    w_ptr,  # [C] weight
    out_ptr,  # [N, C] normalized output, contiguous
    res_out_ptr,  # [N, C] x + residual, contiguous (written only when HAS_RESIDUAL)
    stride_x,
    stride_r,
    C,
    eps,
    weight_offset,
    HAS_RESIDUAL: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    FIX_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Same numerics as _rms_norm_kernel; pass 1 sums squares (and writes the rounded residual sum), pass 2 re-reads.
    row = tl.program_id(0).to(tl.int64)
    sq = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, C, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < C
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            s = cast_rne(x + r, res_out_ptr.dtype.element_ty, FIX_BF16)
            tl.store(res_out_ptr + row * C + cols, s, mask=mask)
            x = s.to(tl.float32)
        sq += x * x
    inv = tl.rsqrt(tl.sum(sq, axis=0) / C + eps)
    tl.debug_barrier()  # pass 2 reads the residual sum other threads of the block wrote
    for c0 in range(0, C, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < C
        if HAS_RESIDUAL:
            x = tl.load(res_out_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if CAST_BEFORE_WEIGHT:
            y = cast_rne(x * inv, out_ptr.dtype.element_ty, FIX_BF16).to(tl.float32) * w
        else:
            y = x * inv * (w + weight_offset)
        tl.store(out_ptr + row * C + cols, cast_rne(y, out_ptr.dtype.element_ty, FIX_BF16), mask=mask)


@triton.jit
def _layer_norm_wide_kernel(
    x_ptr,  # [N, C] input rows (row stride stride_x, unit column stride)
    res_ptr,  # [N, C] residual rows (read only when HAS_RESIDUAL)
    w_ptr,  # [C] weight
    b_ptr,  # [C] bias (read only when HAS_BIAS)
    out_ptr,  # [N, C] normalized output, contiguous
    res_out_ptr,  # [N, C] x + residual, contiguous (written only when HAS_RESIDUAL)
    stride_x,
    stride_r,
    C,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FIX_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Same numerics as _layer_norm_kernel (two-pass variance), in three passes over the row.
    row = tl.program_id(0).to(tl.int64)
    if HAS_RESIDUAL:
        src_ptr = res_out_ptr
        stride_src = C
    else:
        src_ptr = x_ptr
        stride_src = stride_x
    total = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, C, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < C
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            s = cast_rne(x + r, res_out_ptr.dtype.element_ty, FIX_BF16)
            tl.store(res_out_ptr + row * C + cols, s, mask=mask)
            x = s.to(tl.float32)
        total += x
    mean = tl.sum(total, axis=0) / C
    tl.debug_barrier()  # later passes read the residual sum other threads of the block wrote
    sq = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, C, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < C
        xc = tl.where(mask, tl.load(src_ptr + row * stride_src + cols, mask=mask, other=0.0).to(tl.float32) - mean, 0.0)
        sq += xc * xc
    inv = tl.rsqrt(tl.sum(sq, axis=0) / C + eps)
    for c0 in range(0, C, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < C
        x = tl.load(src_ptr + row * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * inv * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * C + cols, cast_rne(y, out_ptr.dtype.element_ty, FIX_BF16), mask=mask)


def _launch_config(C: int) -> tuple[int, int, bool]:
    """BLOCK, num_warps and whether the row is too wide for registers (then BLOCK is a chunk of the loop kernels).

    A row in registers gets roughly 8 elements per thread (16-byte loads for half types).
    """
    block = triton.next_power_of_2(C)
    if block > _MAX_ROW_BLOCK:
        return _WIDE_BLOCK, 8, True
    num_warps = max(1, min(16, block // 256))
    return block, num_warps, False


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x [..., C]`` as ``[N, C]`` keeping its row stride; copies only when no such view exists."""
    if x.dim() == 2:
        return x
    return x.reshape(-1, x.shape[-1])


def _check_norm_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dim [..., C], got shape {tuple(x.shape)}")
    C = x.shape[-1]
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape("weight", weight, [C])
    if weight.stride(0) != 1 and C > 1:
        raise ValueError(f"weight must be contiguous (got stride {weight.stride()}); call .contiguous()")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
        check_shape("bias", bias, [C])
        if bias.stride(0) != 1 and C > 1:
            raise ValueError(f"bias must be contiguous (got stride {bias.stride()}); call .contiguous()")
    if residual is not None:
        check_tensor("residual", residual, dtypes=FLOAT_DTYPES, device=x.device, last_dim_contiguous=True)
        check_shape("residual", residual, list(x.shape))
        check_same_dtype(["x", "residual"], [x, residual])


def _launch_norm(x, weight, bias, eps, residual, weight_offset, kind: str) -> NormOut:
    C = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if x.numel() == 0:
        return (out, res_out) if residual is not None else out
    x2 = _as_rows(x)
    r2 = _as_rows(residual) if residual is not None else x2
    n_rows = x2.shape[0]
    block, num_warps, wide = _launch_config(C)
    if kind == "rms":
        kernel = _rms_norm_wide_kernel if wide else _rms_norm_kernel
        kernel[(n_rows,)](
            x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), C, float(eps), float(weight_offset),
            HAS_RESIDUAL=residual is not None, CAST_BEFORE_WEIGHT=float(weight_offset) == 0.0,
            FIX_BF16=needs_bf16_fix(x.dtype), BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    else:
        kernel = _layer_norm_wide_kernel if wide else _layer_norm_kernel
        kernel[(n_rows,)](
            x2, r2, weight, bias if bias is not None else weight, out, res_out, x2.stride(0), r2.stride(0), C,
            float(eps), HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
            FIX_BF16=needs_bf16_fix(x.dtype), BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    return (out, res_out) if residual is not None else out


# ----------------------------------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------------------------------


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
) -> NormOut:
    """Triton RMSNorm; same contract as :func:`rms_norm`. Validates its arguments first."""
    _check_norm_args(x, weight, None, residual)
    return _launch_norm(x, weight, None, eps, residual, weight_offset, "rms")


def rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
) -> NormOut:
    """Plain-torch RMSNorm reproducing HF's LlamaRMSNorm (``weight_offset=0``) or Gemma2RMSNorm (``!= 0``)."""
    dtype = x.dtype
    if residual is not None:
        x = x + residual
        new_residual = x
    if dtype == torch.float32 and weight.dtype == torch.float32 and float(weight_offset) == 0.0:
        # In fp32 HF's op sequence is exactly torch's fused rms_norm (one kernel instead of six on CPU).
        out = torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)
        return (out, new_residual) if residual is not None else out
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if float(weight_offset) == 0.0:
        out = (weight * h.to(dtype)).to(dtype)
    else:
        out = (h * (weight_offset + weight.float())).to(dtype)
    return (out, new_residual) if residual is not None else out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
) -> NormOut:
    """RMSNorm over the last dim of ``x [..., C]`` with ``weight [C]``; statistics in fp32, output in ``x.dtype``.

    With ``residual`` (same shape and dtype as ``x``) computes ``r = x + residual`` and returns ``(norm(r), r)``.
    ``weight_offset=1.0`` scales by ``1 + weight`` (Gemma). ``weight_offset == 0`` rounds the normalized row to
    ``x.dtype`` before multiplying by ``weight`` (Llama's order); any other offset multiplies in fp32 and rounds
    once (Gemma2's order). Dispatches on ``HF_DSINFER_BACKEND``.
    """
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual, weight_offset)
    return rms_norm_torch(x, weight, eps, residual, weight_offset)


# ----------------------------------------------------------------------------------------------------------------------
# LayerNorm
# ----------------------------------------------------------------------------------------------------------------------


def layer_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> NormOut:
    """Triton LayerNorm; same contract as :func:`layer_norm`. Validates its arguments first."""
    _check_norm_args(x, weight, bias, residual)
    return _launch_norm(x, weight, bias, eps, residual, 0.0, "layer")


def layer_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> NormOut:
    """Plain-torch LayerNorm: fp32 math and one rounding at the end, like ``nn.LayerNorm`` on half inputs."""
    dtype = x.dtype
    if residual is not None:
        x = x + residual
        new_residual = x
    out = torch.nn.functional.layer_norm(
        x.float(), (x.shape[-1],), weight.float(), bias.float() if bias is not None else None, eps
    ).to(dtype)
    return (out, new_residual) if residual is not None else out


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> NormOut:
    """LayerNorm over the last dim of ``x [..., C]`` with ``weight [C]`` and optional ``bias [C]`` (or None).

    With ``residual`` computes ``r = x + residual`` and returns ``(norm(r), r)``. Statistics in fp32, output in
    ``x.dtype``. Dispatches on ``HF_DSINFER_BACKEND``.
    """
    if use_triton(x):
        return layer_norm_triton(x, weight, bias, eps, residual)
    return layer_norm_torch(x, weight, bias, eps, residual)
