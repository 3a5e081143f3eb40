"""Writing new keys/values into the compact KV cache.

``k``/``v`` hold this step's tokens left-padded ``[B, T, Hk, D]``; the cache is ``[Bmax, Hk, S, D]`` and every
sequence starts at slot 0 whatever its padding. Token ``t`` of row ``b`` (``t >= start[b]``) lands in slot
``cache_lens[b] + t - start[b]``; padding tokens are skipped. ``cache_lens`` is not updated here.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_dtype, check_shape, check_tensor
from ._triton import tl, triton
from .backend import use_triton

__all__ = ["store_kv", "store_kv_torch", "store_kv_triton"]


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    start: torch.Tensor,
) -> None:
    """Write the non-padding tokens of ``k``/``v`` ``[B, T, Hk, D]`` into ``k_cache``/``v_cache`` ``[Bmax, Hk, S, D]``.

    Token ``t >= start[b]`` of row ``b`` goes to slot ``cache_lens[b] + t - start[b]``. Dispatches on the backend
    (see ``backend.use_triton``). The torch path raises when a write would pass ``S``; the Triton path does not
    synchronize, so there the caller guarantees the bounds (out-of-range writes are dropped, never performed).
    """
    if use_triton(k):
        store_kv_triton(k, v, k_cache, v_cache, cache_lens, start)
    else:
        store_kv_torch(k, v, k_cache, v_cache, cache_lens, start)


def _check_args(k, v, k_cache, v_cache, cache_lens, start, *, strict_strides: bool) -> None:
    check_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=strict_strides)
    device = k.device
    B, T, Hk, D = k.shape
    check_tensor("v", v, ndim=4, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=strict_strides)
    check_shape("v", v, (B, T, Hk, D))
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=strict_strides)
    check_shape("k_cache", k_cache, (None, Hk, None, D))
    if k_cache.shape[0] < B:
        raise ValueError(f"k_cache has {k_cache.shape[0]} rows but k has batch {B}; the cache needs Bmax >= B")
    check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=strict_strides)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_same_dtype(("k", "v", "k_cache", "v_cache"), (k, v, k_cache, v_cache))
    check_tensor("cache_lens", cache_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("cache_lens", cache_lens, (B,))
    check_tensor("start", start, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("start", start, (B,))


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    start: torch.Tensor,
) -> None:
    """Plain-torch reference of :func:`store_kv` (vectorized ``index_put``; host syncs for the bounds check).

    Also the CPU production path, where a host sync is free: a decode step (``T == 1``, no padding) is a single
    ``index_put`` per tensor.
    """
    _check_args(k, v, k_cache, v_cache, cache_lens, start, strict_strides=False)
    B, T = k.shape[:2]
    S = k_cache.shape[2]
    if T == 1 and not bool(start.any()):
        slot = cache_lens.long()  # [B]: the one new token of each row
        _check_slots(slot, S)
        rows = torch.arange(B, device=k.device)
        k_cache[rows, :, slot] = k[:, 0].to(k_cache.dtype)  # [B, Hk, D] into k_cache[b, :, slot[b]]
        v_cache[rows, :, slot] = v[:, 0].to(v_cache.dtype)
        return
    t = torch.arange(T, device=k.device)
    slots = cache_lens.long()[:, None] + t[None, :] - start.long()[:, None]  # [B, T]
    keep = t[None, :] >= start.long()[:, None]  # [B, T]; False for left padding
    # nonzero() syncs once; that also pays for the bounds check below.
    b_idx, t_idx = keep.nonzero(as_tuple=True)
    s_idx = slots[b_idx, t_idx]
    _check_slots(s_idx, S)
    # Advanced indices split by a slice put the index dim first: k_cache[b, :, s] is [n, Hk, D].
    k_cache[b_idx, :, s_idx] = k[b_idx, t_idx].to(k_cache.dtype)
    v_cache[b_idx, :, s_idx] = v[b_idx, t_idx].to(v_cache.dtype)


def _check_slots(slots: torch.Tensor, S: int) -> None:
    """Raise when a cache slot index in ``slots`` falls outside ``[0, S)`` (one host sync)."""
    if slots.numel():
        lo, hi = (int(x) for x in torch.aminmax(slots))
        if hi >= S or lo < 0:
            raise ValueError(
                f"store_kv would write cache slot {hi} (or below 0) but the cache holds S={S} slots; "
                "check cache_lens/start or allocate a longer cache"
            )


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [B, T, Hk, D]
    v_ptr,  # [B, T, Hk, D]
    k_cache_ptr,  # [Bmax, Hk, S, D]
    v_cache_ptr,  # [Bmax, Hk, S, D]
    cache_lens_ptr,  # [B]
    start_ptr,  # [B]
    T,
    Hk,
    D,
    S,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_vcb,
    stride_vch,
    stride_vcs,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # int64 from the start: b * stride_cb is past 2^31 for a cache of over 2G elements per layer (a 4 GiB bf16 one),
    # and b * stride_kb + t * stride_kt can be for long prompts.
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    h0 = tl.program_id(2) * BLOCK_H
    first = tl.load(start_ptr + b).to(tl.int64)
    slot = tl.load(cache_lens_ptr + b).to(tl.int64) + t - first
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # Padding tokens and writes past the cache end are masked out: no sync happens to check them here.
    ok = (t >= first) & (slot >= 0) & (slot < S)
    # Fold the scalar test into a bound: the 3.9 interpreter turns `scalar_bool & block_bool` into ints.
    h_end = tl.where(ok, Hk, 0)
    mask = (offs_h[:, None] < h_end) & (offs_d[None, :] < D)
    src_k = k_ptr + b * stride_kb + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + b * stride_vb + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = k_cache_ptr + b * stride_cb + slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    dst_v = v_cache_ptr + b * stride_vcb + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(dst_k, tl.load(src_k, mask=mask, other=0.0), mask=mask)
    tl.store(dst_v, tl.load(src_v, mask=mask, other=0.0), mask=mask)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    start: torch.Tensor,
) -> None:
    """Triton launcher of :func:`store_kv`. Never syncs: the caller guarantees ``cache_lens + T - start <= S``.

    ``k``/``v`` may be strided views (e.g. slices of a fused qkv output) with a unit stride in the last dim.
    """
    _check_args(k, v, k_cache, v_cache, cache_lens, start, strict_strides=True)
    B, T, Hk, D = k.shape
    if B == 0 or T == 0:
        return
    BLOCK_D = triton.next_power_of_2(D)
    # Copy several heads per program: one token row is Hk*D contiguous-ish elements.
    BLOCK_H = min(triton.next_power_of_2(Hk), max(1, 4096 // BLOCK_D))
    grid = (T, B, triton.cdiv(Hk, BLOCK_H))
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, cache_lens, start,
        T, Hk, D, k_cache.shape[2],
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
    )  # fmt: skip
