"""Several LoRA adapters in one batch: the gathered LoRA matmul (Punica's BGMV, the S-LoRA approach).

Every token ``n`` of a step carries an adapter slot ``slots[n]`` (-1: the base model, no delta), and

    ``y[n] += (x[n] @ lora_a[s].T) @ lora_b[s].T``  with ``s = slots[n]``

for stacked adapter weights ``lora_a [L, R, K]`` and ``lora_b [L, O, R]`` (the LoRA scaling folded into ``lora_b``;
an adapter of rank ``r < R`` is zero-padded, which adds exact zeros). Tokens of different adapters and of the base
share one launch, so a serving step never splits by adapter.

The Triton path is two launches, as Punica's: *shrink* ``t[n] = lora_a[s] @ x[n]`` (``[N, R]`` fp32) and *expand*
``y[n] += lora_b[s] @ t[n]``. Each program reads its token's slot and gathers that adapter's rows, so one launch
serves any mix; a base token (slot -1) returns at once. Products are elementwise multiply-and-sum in fp32 (no
``tl.dot``: a token is one row, and this avoids the interpreter's wrong bf16 dots, see pitfalls.md). The delta is
accumulated in fp32 and added to ``y`` once, rounded to ``y.dtype``; the torch reference rounds at the same point.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_tensor
from ._triton import tl, triton
from .backend import use_triton

__all__ = ["lora_add", "lora_add_torch", "lora_add_triton", "slot_groups"]


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [N, K] (row stride stride_x, unit column stride)
    a_ptr,  # [L, R, K] (strides stride_al, stride_ar, 1)
    slots_ptr,  # [N] int32/int64, -1 = no adapter
    t_ptr,  # [N, R] fp32 contiguous: the shrunk activations
    k_dim,
    rank,
    stride_x,
    stride_al,
    stride_ar,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    if slot < 0:
        return
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_mask = rows < rank
    a_base = a_ptr + slot * stride_al + rows[:, None].to(tl.int64) * stride_ar  # [BLOCK_R, 1] pointers
    x_base = x_ptr + n * stride_x
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < k_dim
        xk = tl.load(x_base + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
        a = tl.load(a_base + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(t_ptr + n * rank + rows, acc, mask=row_mask)


@triton.jit
def _lora_expand_kernel(
    t_ptr,  # [N, R] fp32 contiguous
    b_ptr,  # [L, O, R] (strides stride_bl, stride_bo, 1)
    slots_ptr,  # [N]
    y_ptr,  # [N, O] (row stride stride_y, unit column stride), updated in place
    out_dim,
    rank,
    stride_bl,
    stride_bo,
    stride_y,
    BLOCK_O: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    if slot < 0:
        return
    outs = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)  # [BLOCK_O]
    out_mask = outs < out_dim
    b_base = b_ptr + slot * stride_bl + outs[:, None].to(tl.int64) * stride_bo  # [BLOCK_O, 1] pointers
    acc = tl.zeros([BLOCK_O], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_mask = rs < rank
        t = tl.load(t_ptr + n * rank + rs, mask=r_mask, other=0.0)  # [BLOCK_R] fp32
        b = tl.load(b_base + rs[None, :], mask=out_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * t[None, :], axis=1)
    y_row = y_ptr + n * stride_y + outs
    y = tl.load(y_row, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_row, (y + acc).to(y_ptr.dtype.element_ty), mask=out_mask)


def _check(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor) -> None:
    """Shapes, dtypes and devices of :func:`lora_add`'s arguments (errors name the argument)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    dev = x.device
    check_tensor("y", y, ndim=2, dtypes=(x.dtype,), device=dev, last_dim_contiguous=True)
    check_tensor("lora_a", lora_a, ndim=3, dtypes=(x.dtype,), device=dev, last_dim_contiguous=True)
    check_tensor("lora_b", lora_b, ndim=3, dtypes=(x.dtype,), device=dev, last_dim_contiguous=True)
    check_tensor("slots", slots, ndim=1, dtypes=(torch.int32, torch.int64), device=dev)
    n, k = x.shape
    loras, rank, _ = lora_a.shape
    if y.shape[0] != n or slots.shape[0] != n:
        shapes = f"x {tuple(x.shape)}, y {tuple(y.shape)} and slots {tuple(slots.shape)}"
        raise ValueError(f"{shapes} need one row per token")
    if lora_a.shape[2] != k:
        raise ValueError(f"lora_a must be [L, R, K={k}] (K = x's last dim), got {tuple(lora_a.shape)}")
    if lora_b.shape != (loras, y.shape[1], rank):
        raise ValueError(f"lora_b must be [L={loras}, O={y.shape[1]}, R={rank}], got {tuple(lora_b.shape)}")


def lora_add_triton(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Triton launcher for :func:`lora_add` (shrink then expand). Validates its arguments; returns ``y``."""
    _check(y, x, lora_a, lora_b, slots)
    n, k = x.shape
    out_dim, rank = lora_b.shape[1], lora_b.shape[2]
    if n == 0 or rank == 0 or out_dim == 0:
        return y
    if slots.stride(0) != 1:
        slots = slots.contiguous()
    t = torch.empty(n, rank, dtype=torch.float32, device=x.device)  # [N, R]; base rows are never read
    block_r = min(64, triton.next_power_of_2(rank))
    block_k = 128 if block_r <= 32 else 64  # a [BLOCK_R, BLOCK_K] fp32 tile: 32 values per thread at 4 warps
    _lora_shrink_kernel[(n, triton.cdiv(rank, block_r))](
        x, lora_a, slots, t, k, rank, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    block_o = min(128, triton.next_power_of_2(out_dim))
    block_rr = min(32, block_r)
    _lora_expand_kernel[(n, triton.cdiv(out_dim, block_o))](
        t, lora_b, slots, y, out_dim, rank, lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_O=block_o, BLOCK_R=block_rr, num_warps=4,
    )  # fmt: skip
    return y


def slot_groups(slots: list[int], device: torch.device) -> list[tuple[int, torch.Tensor]]:
    """``[(slot, rows [n_s] int64)]`` for every adapter slot (>= 0) in the host list ``slots``: what
    :func:`lora_add_torch` computes from the tensor, built once per step and passed to every layer's call."""
    rows: dict[int, list[int]] = {}
    for i, s in enumerate(slots):
        if s >= 0:
            rows.setdefault(s, []).append(i)
    return [(s, torch.tensor(r, dtype=torch.long).to(device)) for s, r in sorted(rows.items())]


def lora_add_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    groups: list[tuple[int, torch.Tensor]] | None = None,
    parts: list[int] | None = None,
    ranks: list[int] | None = None,
) -> torch.Tensor:
    """Plain-torch reference of :func:`lora_add`: per adapter present, its tokens' delta in fp32, added once.

    Groups the tokens by slot (one host read of the distinct slots, or ``groups`` from :func:`slot_groups`), so it
    costs one pair of GEMMs per adapter. ``parts`` (output rows of each stacked projection, ``R`` split evenly among
    them, ``lora_b`` block-diagonal) and ``ranks`` (per slot, the rank used in each part's block; the rest is zero)
    skip the zero blocks: the same result for a fraction of the work (CPU serving).
    """
    _check(y, x, lora_a, lora_b, slots)
    if groups is None:
        groups = [(s, (slots == s).nonzero().squeeze(1)) for s in torch.unique(slots).tolist() if s >= 0]
    for s, rows in groups:  # rows [n_s]
        xs = x[rows].float()  # [n_s, K]
        if parts is None:
            delta = (xs @ lora_a[s].float().t()) @ lora_b[s].float().t()  # [n_s, R] -> [n_s, O]
        else:
            block = lora_a.shape[1] // len(parts)
            r = block if ranks is None else ranks[s]
            delta = torch.zeros(xs.shape[0], y.shape[1], dtype=torch.float32, device=y.device)  # [n_s, O]
            row0 = 0
            for p, n_rows in enumerate(parts):
                lo = p * block
                t = xs @ lora_a[s, lo : lo + r].float().t()  # [n_s, r]
                delta[:, row0 : row0 + n_rows] = t @ lora_b[s, row0 : row0 + n_rows, lo : lo + r].float().t()
                row0 += n_rows
        y[rows] = (y[rows].float() + delta).to(y.dtype)
    return y


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    groups: list[tuple[int, torch.Tensor]] | None = None,
    parts: list[int] | None = None,
    ranks: list[int] | None = None,
) -> torch.Tensor:
    """``y[n] += (x[n] @ lora_a[slots[n]].T) @ lora_b[slots[n]].T`` in place for every token with ``slots[n] >= 0``.

    ``x [N, K]``, ``y [N, O]`` (same dtype; unit last-dim stride, any row stride), ``lora_a [L, R, K]``,
    ``lora_b [L, O, R]`` (scaling folded in), ``slots [N]`` int32/int64 (-1: no adapter). Returns ``y``.
    ``groups``, ``parts``, ``ranks``: hints for the torch path (see :func:`lora_add_torch`); the kernel ignores them.
    Dispatches on ``HF_DSINFER_BACKEND``.
    """
    if use_triton(x):
        return lora_add_triton(y, x, lora_a, lora_b, slots)
    return lora_add_torch(y, x, lora_a, lora_b, slots, groups, parts, ranks)
