"""Rotary position embedding applied in place to q and k, with per-token positions.

``cos``/``sin`` are ``[P, R/2]`` tables built by the caller (every rope scaling variant is just another table), so
the kernel only gathers one table row per token and rotates pairs of dims:

* rotate-half (``interleaved=False``; llama, neox): pair ``(i, i + R/2)``;
* interleaved (``interleaved=True``; gptj): pair ``(2i, 2i + 1)``.

For a pair ``(a, b)`` with angle row ``(c, s)``: ``a' = a c - b s``, ``b' = b c + a s``. Dims ``>= R`` are left
untouched (partial rotary). Math in fp32, results stored in q's / k's dtype.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_dtype, check_shape, check_tensor
from ._triton import tl, triton
from .backend import use_triton
from .norms import cast_rne, needs_bf16_fix

__all__ = ["apply_rotary_", "apply_rotary__torch", "apply_rotary__triton", "apply_rotary_torch", "apply_rotary_triton"]


@triton.jit
def _rotate_heads(
    base_ptr,  # [H, D] the heads of one token (head stride stride_h, unit dim stride)
    stride_h,
    n_heads,
    head0,
    c,  # [BLOCK_R] fp32 cos row for this token
    s,  # [BLOCK_R] fp32 sin row for this token
    half,
    INTERLEAVED: tl.constexpr,
    FIX_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    heads = head0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_R)
    mask = (heads < n_heads)[:, None] & (i < half)[None, :]
    if INTERLEAVED:
        off_a = 2 * i
        off_b = 2 * i + 1
    else:
        off_a = i
        off_b = i + half
    row = base_ptr + heads[:, None].to(tl.int64) * stride_h
    a = tl.load(row + off_a[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(row + off_b[None, :], mask=mask, other=0.0).to(tl.float32)
    c2 = c[None, :]
    s2 = s[None, :]
    tl.store(row + off_a[None, :], cast_rne(a * c2 - b * s2, base_ptr.dtype.element_ty, FIX_BF16), mask=mask)
    tl.store(row + off_b[None, :], cast_rne(b * c2 + a * s2, base_ptr.dtype.element_ty, FIX_BF16), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [N, Hq, D] strides (stride_qn, stride_qh, 1)
    k_ptr,  # [N, Hk, D] strides (stride_kn, stride_kh, 1)
    cos_ptr,  # [P, R/2] fp32 (row stride stride_cp, unit last stride)
    sin_ptr,  # [P, R/2] fp32 (row stride stride_sp, unit last stride)
    pos_ptr,  # [N] int32/int64 position of each token
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_cp,
    stride_sp,
    n_q_heads,
    n_k_heads,
    half,
    n_q_blocks,
    INTERLEAVED: tl.constexpr,
    FIX_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # Grid: (token, head block); the first n_q_blocks head blocks cover q, the rest cover k, so one launch does both.
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, BLOCK_R)
    imask = i < half
    c = tl.load(cos_ptr + pos * stride_cp + i, mask=imask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sp + i, mask=imask, other=0.0).to(tl.float32)
    if hb < n_q_blocks:
        _rotate_heads(q_ptr + tok * stride_qn, stride_qh, n_q_heads, hb * BLOCK_H, c, s, half,
                      INTERLEAVED, FIX_BF16, BLOCK_H, BLOCK_R)  # fmt: skip
    else:
        _rotate_heads(k_ptr + tok * stride_kn, stride_kh, n_k_heads, (hb - n_q_blocks) * BLOCK_H, c, s, half,
                      INTERLEAVED, FIX_BF16, BLOCK_H, BLOCK_R)  # fmt: skip


def _check_rotary_args(q, k, cos, sin, positions) -> int:
    """Validate the arguments; return the rotary dim R."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES, device=q.device, last_dim_contiguous=True)
    check_same_dtype(["q", "k"], [q, k])
    N, _, D = q.shape
    check_shape("k", k, [N, None, D])
    check_tensor("cos", cos, ndim=2, dtypes=FLOAT_DTYPES, device=q.device, last_dim_contiguous=True)
    check_tensor("sin", sin, ndim=2, dtypes=FLOAT_DTYPES, device=q.device, last_dim_contiguous=True)
    check_shape("sin", sin, list(cos.shape))
    R = 2 * cos.shape[1]
    if R > D or R == 0:
        raise ValueError(f"cos has {cos.shape[1]} columns, so the rotary dim R = {R}, but it must be in [2, D={D}]")
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=q.device)
    check_shape("positions", positions, [N])
    return R


def apply_rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher for :func:`apply_rotary_` (in place). Positions must lie in ``[0, P)``; not checked (no sync)."""
    R = _check_rotary_args(q, k, cos, sin, positions)
    N, Hq, _ = q.shape
    Hk = k.shape[1]
    if N == 0:
        return q, k
    half = R // 2
    block_r = triton.next_power_of_2(half)
    # Aim for ~2K elements per program at prefill; at decode (few tokens) use small head blocks for more programs.
    block_h = max(1, min(triton.next_power_of_2(max(Hq, Hk)), 4096 // (2 * block_r) if N > 64 else 4))
    n_q_blocks = triton.cdiv(Hq, block_h)
    grid = (N, n_q_blocks + triton.cdiv(Hk, block_h))
    _rotary_kernel[grid](
        q, k, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        Hq, Hk, half, n_q_blocks,
        INTERLEAVED=bool(interleaved), FIX_BF16=needs_bf16_fix(q.dtype),
        BLOCK_H=block_h, BLOCK_R=block_r, num_warps=4 if block_h * block_r >= 1024 else 2,
    )  # fmt: skip
    return q, k


def apply_rotary_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference for :func:`apply_rotary_` (in place, fp32 math)."""
    half = cos.shape[-1]
    R = 2 * half
    c = cos[positions].float().unsqueeze(1)  # [N, 1, R/2]
    s = sin[positions].float().unsqueeze(1)
    for t in (q, k):
        if interleaved:
            ia, ib = slice(0, R, 2), slice(1, R, 2)
        else:
            ia, ib = slice(0, half), slice(half, R)
        a = t[..., ia].float()
        b = t[..., ib].float()
        # Both results are new tensors before either write, so fp32 inputs (where .float() is a view) are safe.
        new_a = a * c - b * s
        new_b = b * c + a * s
        t[..., ia] = new_a.to(t.dtype)
        t[..., ib] = new_b.to(t.dtype)
    return q, k


def apply_rotary_(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [N, Hq, D]`` and ``k [N, Hk, D]`` in place by the angles of ``positions [N]``; returns ``(q, k)``.

    ``cos``/``sin [P, R/2]`` (fp32) hold the table; ``R <= D`` is the rotary dim and dims past it are left alone.
    ``interleaved=False`` rotates halves (llama/neox), ``True`` rotates adjacent pairs (gptj). q and k may have any
    strides on their first two dims (e.g. views into a fused QKV output) but need a unit stride on the last.
    Dispatches on ``HF_DSINFER_BACKEND``.
    """
    if use_triton(q):
        return apply_rotary_triton(q, k, cos, sin, positions, interleaved)
    return apply_rotary_torch(q, k, cos, sin, positions, interleaved)


# Aliases following the ``foo`` / ``foo_triton`` / ``foo_torch`` naming literally for the in-place name.
apply_rotary__triton = apply_rotary_triton
apply_rotary__torch = apply_rotary_torch
