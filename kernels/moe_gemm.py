"""Grouped GEMM for mixture-of-experts layers: one launch multiplies every expert's tokens by that expert's weight.

The token-expert pairs of a batch are sorted by expert (``moe_sort``), so expert ``e`` owns the contiguous sorted
rows ``[row_end[e] - counts[e], row_end[e])``. The kernel walks those rows in blocks of ``BLOCK_M``: a block never
straddles two experts, and a per-block table (``moe_block_map``) says which expert and which first row each block
has. Everything the launch needs is computed on the device with fixed-size tensor ops (no ``.item()``, no
``.tolist()``): the grid is an upper bound on the block count and blocks past the end return at once, so a decode
step can be captured in a CUDA graph whatever the routing.

``moe_gemm_torch`` is the reference (one ``F.linear`` per expert over its rows; it reads the counts on the host).
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_tensor
from ._triton import tl, triton
from .backend import interpreter_enabled, use_triton
from .norms import cast_rne, needs_bf16_fix
from .prefill_attention import _dot

__all__ = ["moe_block_map", "moe_gemm", "moe_gemm_torch", "moe_gemm_triton", "moe_num_blocks", "moe_sort"]


def moe_sort(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort token-expert pairs by expert, on the device and without host syncs.

    ``expert_ids [N, k]`` (or ``[S]``): the experts each token was routed to. Returns ``order [S]`` (pair indices,
    flattened row-major, sorted by expert; stable, so a token's pairs keep the token order within an expert) and
    ``counts [E]`` (int32, pairs per expert). Sorted row ``s`` is pair ``order[s]``, i.e. token ``order[s] // k``.
    """
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # a bincount with a fixed output size
    return order, counts


def moe_num_blocks(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the row blocks of ``num_rows`` sorted rows over ``num_experts`` experts (host arithmetic only):
    each expert's last block may be partial, and a non-empty block holds at least one row."""
    return max(1, min(num_rows, num_rows // block_m + num_experts))


def moe_block_map(counts: torch.Tensor, num_blocks: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block expert and first sorted row, from ``counts [E]`` (fixed-size device ops only).

    Returns ``block_expert [num_blocks]`` (int32; ``E`` for blocks past the last one: no work) and
    ``block_row [num_blocks]`` (int32, the block's first sorted row).
    """
    counts = counts.to(torch.int64)
    num_experts = counts.shape[0]
    blocks = (counts + block_m - 1) // block_m  # [E]
    block_end = torch.cumsum(blocks, 0)  # [E] one past each expert's last block
    row_begin = torch.cumsum(counts, 0) - counts  # [E]
    b = torch.arange(num_blocks, device=counts.device)
    expert = torch.searchsorted(block_end, b, right=True)  # [num_blocks], E past the end
    e = expert.clamp(max=num_experts - 1)
    block_row = row_begin[e] + (b - (block_end[e] - blocks[e])) * block_m
    return expert.to(torch.int32), block_row.to(torch.int32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [M_a, K] input rows (row stride stride_am, unit column stride)
    w_ptr,  # [E, N, K] expert weights, any strides (row-major [N, K] or K-major per expert)
    out_ptr,  # [S, N] output rows in expert-sorted order (contiguous)
    a_rows_ptr,  # [S] int: the row of `a` feeding sorted row s (read when GATHER)
    block_expert_ptr,  # [num_blocks] int32: the block's expert, E when the block is past the end
    block_row_ptr,  # [num_blocks] int32: the block's first sorted row
    counts_ptr,  # [E] int32: sorted rows per expert
    row_end_ptr,  # [E] int64: one past each expert's last sorted row
    N,
    K,
    num_experts,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    GATHER: tl.constexpr,
    FP32: tl.constexpr,
    UPCAST: tl.constexpr,
    FIX_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return  # past the last block: the grid is only an upper bound
    if tl.load(counts_ptr + expert) == 0:
        return
    row0 = tl.load(block_row_ptr + pid_m).to(tl.int64)
    row_end = tl.load(row_end_ptr + expert)
    rows = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] sorted rows
    row_mask = rows < row_end
    if GATHER:
        a_rows = tl.load(a_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        a_rows = rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    col_mask = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None].to(tl.int64) * stride_wk,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc += _dot(a, w, FP32, UPCAST)
    out = cast_rne(acc, out_ptr.dtype.element_ty, FIX_BF16)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out, mask=row_mask[:, None] & col_mask[None, :])


def _tile_config(rows_per_expert: float, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): decode (a few rows per expert) streams the weights with the smallest
    M tile tl.dot allows; prefill uses square-ish tiles."""
    if interpreter_enabled():
        return 16, 32, 32, 1  # small tiles: the interpreter's cost grows with the tile, not the launch
    if rows_per_expert <= 16:
        return 16, min(64, triton.next_power_of_2(n)), min(128, triton.next_power_of_2(k)), 4
    if rows_per_expert <= 64:
        return 32, min(128, triton.next_power_of_2(n)), 64, 4
    return 64, min(128, triton.next_power_of_2(n)), 64, 8


def _check(a: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, a_rows: torch.Tensor | None) -> int:
    check_tensor("a", a, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("weight", weight, ndim=3, dtypes=(a.dtype,), device=a.device)
    check_tensor("counts", counts, ndim=1, dtypes=INDEX_DTYPES, device=a.device)
    if weight.shape[2] != a.shape[1]:
        raise ValueError(f"weight must be [E, N, K={a.shape[1]}] (the width of a), got {tuple(weight.shape)}")
    if counts.shape[0] != weight.shape[0]:
        raise ValueError(f"counts must have one entry per expert ({weight.shape[0]}), got {counts.shape[0]}")
    if a_rows is not None:
        check_tensor("a_rows", a_rows, ndim=1, dtypes=INDEX_DTYPES, device=a.device)
        return a_rows.shape[0]
    return a.shape[0]


def moe_gemm_triton(
    a: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, a_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton launcher for :func:`moe_gemm`. Validates its arguments first; never reads device values on the host."""
    num_rows = _check(a, weight, counts, a_rows)
    num_experts, n, k = weight.shape
    out = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    if num_rows == 0 or n == 0:
        return out
    block_m, block_n, block_k, warps = _tile_config(num_rows / num_experts, n, k)
    num_blocks = moe_num_blocks(num_rows, num_experts, block_m)
    block_expert, block_row = moe_block_map(counts, num_blocks, block_m)
    row_end = torch.cumsum(counts.to(torch.int64), 0)
    grid = (num_blocks, triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, weight, out, a_rows if a_rows is not None else counts, block_expert, block_row, counts.to(torch.int32),
        row_end, n, k, num_experts, a.stride(0), weight.stride(0), weight.stride(1), weight.stride(2),
        GATHER=a_rows is not None, FP32=a.dtype == torch.float32,
        UPCAST=interpreter_enabled() and a.dtype != torch.float32, FIX_BF16=needs_bf16_fix(a.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return out


def moe_gemm_torch(
    a: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, a_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-torch reference: ``out[s] = a[a_rows[s]] @ weight[e(s)].T`` with one ``F.linear`` per non-empty expert.

    Reads ``counts`` on the host (free on CPU; a sync on a GPU, where the Triton path is used instead).
    """
    _check(a, weight, counts, a_rows)
    if torch.compiler.is_compiling():
        return torch.ops.hf_dsinfer.moe_gemm_host_counts(a, weight, counts, a_rows)
    return _moe_gemm_loop(a, weight, counts, a_rows)  # eager: skip the custom op's dispatch cost


def _moe_gemm_loop(
    a: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, a_rows: torch.Tensor | None
) -> torch.Tensor:
    rows = a[a_rows] if a_rows is not None else a  # [S, K] in sorted order
    out = torch.empty(rows.shape[0], weight.shape[1], dtype=a.dtype, device=a.device)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            torch.mm(rows[start : start + c], weight[e].t(), out=out[start : start + c])
            start += c
    return out


# The loop reads the counts on the host, which torch.compile cannot trace (a data-dependent shape per expert); as an
# op it stays one opaque call in a compiled graph (the CPU decode step), run eagerly inside. Defined with
# torch.library directly (like hf_dsinfer::moe_experts_per_pair in modules/moe.py): ~15 us of dispatch per call where
# a torch.library.custom_op costs ~80 us.
_LIB = torch.library.Library("hf_dsinfer", "FRAGMENT")
try:
    _LIB.define("moe_gemm_host_counts(Tensor a, Tensor weight, Tensor counts, Tensor? a_rows) -> Tensor")
except RuntimeError:  # pragma: no cover - defined already (the module imported twice under two names)
    pass
else:
    _LIB.impl("moe_gemm_host_counts", _moe_gemm_loop, "CompositeExplicitAutograd")

    def _moe_gemm_host_counts_fake(
        a: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, a_rows: torch.Tensor | None
    ) -> torch.Tensor:
        num_rows = a_rows.shape[0] if a_rows is not None else a.shape[0]
        return a.new_empty(num_rows, weight.shape[1])

    torch.library.register_fake("hf_dsinfer::moe_gemm_host_counts", _moe_gemm_host_counts_fake, lib=_LIB)


def moe_gemm(
    a: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, a_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Grouped GEMM over expert-sorted rows: ``out [S, N]``, ``out[s] = a[a_rows[s]] @ weight[e].T`` for the expert
    ``e`` owning sorted row ``s``.

    ``a [M, K]``; ``weight [E, N, K]`` (any strides); ``counts [E]`` (rows per expert, in sorted order: expert 0's
    rows first); ``a_rows [S]`` (optional) gathers input rows, e.g. ``order // k`` from :func:`moe_sort`, so the
    tokens need not be copied into sorted order first. Accumulates in fp32, rounds once to ``a``'s dtype.
    Dispatches on ``HF_DSINFER_BACKEND``.
    """
    if use_triton(a):
        return moe_gemm_triton(a, weight, counts, a_rows)
    return moe_gemm_torch(a, weight, counts, a_rows)
