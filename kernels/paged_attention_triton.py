"""Triton kernels of :mod:`paged_attention`: the paged KV store, split-KV paged decode, varlen paged prefill.

Every key tile is read through the block table: key ``j`` of sequence ``s`` sits in block
``block_tables[s, j // BS]`` at offset ``j % BS``, so a tile gathers one block id per column (a cached load) and
needs no relation between the tile width and the block size. None of the launchers reads a length on the host, so
they are CUDA-graph safe; the shapes alone (``T``, ``S``, the table width) size the grids.

* ``_paged_decode_kernel``: one query token per sequence (``T == S``), grid ``(S, KVH, num_splits)``; each program
  takes every query head of one KV group over one slice of the keys (like ``decode_attention``) and the splits are
  merged by ``decode_attention``'s merge kernel.
* ``_paged_prefill_kernel``: ragged query tiles, grid ``(T // BLOCK_Q + S, KVH)``. A tile's ``BLOCK_M`` rows are
  ``BLOCK_Q = BLOCK_M // G`` query tokens times the ``G`` query heads of one KV group, so each K/V tile is read once
  per group and a decode token mixed into a prefill step costs one program per KV head, not a tile per query head.
  Sequence ``s`` owns the tiles ``[cu[s] // BLOCK_Q + s, cu[s + 1] // BLOCK_Q + s + 1)``, at least
  ``cdiv(n_q, BLOCK_Q)`` of them, so a program finds its sequence by a binary search over ``cu_seqlens_q`` (the
  scheme of vLLM's unified Triton attention) and tiles past a sequence's queries do nothing.
"""

from __future__ import annotations

import importlib

import torch

from ._arch import attention_tiles, decode_tiles, target_of
from ._triton import tl, triton
from .backend import interpreter_enabled
from .paged_attention import _check_store_args, check_paged_args
from .prefill_attention import _dot, _tanh

__all__ = ["paged_attention_triton", "store_paged_kv_triton"]

# The decode_attention *module* (the package's ``decode_attention`` attribute is the function of that name). Its split
# picker and merge kernel are used through it, so the AOT check's stand-in for the target GPU's SM count applies here.
_decode = importlib.import_module(".decode_attention", __package__)


@triton.jit
def _store_paged_kv_kernel(
    k_ptr,  # [T, KVH, D]
    v_ptr,  # [T, KVH, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    slot_ptr,  # [T] int64
    num_slots,  # NB * BS: slots at or past it are dropped
    BS,
    D,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BS
    offset = slot % BS
    offs_d = tl.arange(0, BLOCK_D)
    # A negative slot (padding, a token whose KV a shared prefix already holds) is never written. The slot is
    # broadcast to a vector before comparing: the interpreter rejects a scalar i1 mask combined with a vector.
    slots = tl.zeros([BLOCK_D], tl.int64) + slot
    mask = (offs_d < D) & (slots >= 0) & (slots < num_slots)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d, mask=mask, other=0.0)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + offs_d, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d, mask=mask, other=0.0)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + offs_d, v, mask=mask)


def store_paged_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton launcher of :func:`store_paged_kv` (grid ``(T, KVH)``; no host sync, out-of-range slots dropped).

    ``k``/``v`` may be strided views (e.g. of a fused qkv output) with a unit last-dim stride.
    """
    _check_store_args(k, v, k_cache, v_cache, slot_mapping, strict_strides=True)
    T, KVH, D = k.shape
    if T == 0 or KVH == 0:
        return
    NB, BS = k_cache.shape[0], k_cache.shape[1]
    _store_paged_kv_kernel[(T, KVH)](
        k, v, k_cache, v_cache, slot_mapping, NB * BS, BS, D,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_D=triton.next_power_of_2(D), num_warps=1 if D <= 128 else 2,
    )  # fmt: skip


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [T, H, D], T == S: one query token per sequence
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    block_tables_ptr,  # [S, MB]
    cu_seqlens_q_ptr,  # [S + 1]
    seq_lens_ptr,  # [S]
    out_ptr,  # [T, H, D] contiguous (used when not SPLIT)
    part_out_ptr,  # [T, H, num_splits, D] fp32 (used when SPLIT)
    part_lse_ptr,  # [T, H, num_splits] fp32
    num_splits,
    H,
    D,
    G,  # query heads per kv head
    BS,
    scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FP32: tl.constexpr,
    UPCAST: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    row = tl.load(cu_seqlens_q_ptr + s).to(tl.int64)  # this sequence's query row in q / out
    seq_len = tl.load(seq_lens_ptr + s)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)  # the token at seq_len - 1 sees keys [seq_len - W, seq_len - 1]
    # Cut [lo, seq_len) into num_splits slices of whole BLOCK_N tiles; tail slices may be empty.
    chunk = tl.cdiv(tl.cdiv(tl.maximum(seq_len - lo, 0), num_splits), BLOCK_N) * BLOCK_N
    s_lo = lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g  # query heads of this kv group
    # Rows past G are zero queries (tl.dot needs 16 rows); they are never stored.
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    table = block_tables_ptr + s * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(s_lo, s_hi, BLOCK_N):
        cols = n0 + offs_n  # [BLOCK_N] key positions
        col_ok = cols < s_hi
        block = tl.load(table + cols // BS, mask=col_ok, other=0).to(tl.int64)
        offset = cols % BS
        kv_mask = col_ok[:, None] & d_mask[None, :]
        k_rows = block * stride_kb + offset * stride_ks + kvh * stride_kh  # [BLOCK_N] int64
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        sc = _dot(q, tl.trans(k), FP32, UPCAST) * scale  # [BLOCK_G, BLOCK_N]
        if HAS_SOFTCAP:
            sc = softcap * _tanh(sc / softcap)
        sc = tl.where(col_ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoids inf - inf before any key is seen
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = block * stride_vb + offset * stride_vs + kvh * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    flat = row * H + heads  # [BLOCK_G] flat (token, head) index, int64
    if not SPLIT:
        tl.store(out_ptr + flat[:, None] * D + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = flat * num_splits + split
        tl.store(part_out_ptr + part[:, None] * D + offs_d[None, :], o, mask=store_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log(l_safe), float("-inf"))  # empty slice: weight 0 in the merge
        tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    block_tables_ptr,  # [S, MB]
    cu_seqlens_q_ptr,  # [S + 1]
    seq_lens_ptr,  # [S]
    out_ptr,  # [T, H, D] contiguous
    S,
    H,
    D,
    BS,
    scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    G: tl.constexpr,  # query heads per kv head (a model constant: compiled in, so // G and % G are cheap)
    BLOCK_M: tl.constexpr,  # tile rows: BLOCK_Q tokens x G heads (rows past BLOCK_Q * G are padding)
    BLOCK_Q: tl.constexpr,  # query tokens per tile, BLOCK_M // G
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FP32: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    # The sequence of this tile: the last s whose first tile cu[s] // BLOCK_Q + s is <= tile (binary search).
    lo_s = 0
    hi_s = S
    while lo_s < hi_s:
        mid = (lo_s + hi_s) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        right = first_tile <= tile
        lo_s = tl.where(right, mid + 1, lo_s)
        hi_s = tl.where(right, hi_s, mid)
    s = (lo_s - 1).to(tl.int64)
    q_start = tl.load(cu_seqlens_q_ptr + s)
    n_q = tl.load(cu_seqlens_q_ptr + s + 1) - q_start
    m0 = (tile - (q_start // BLOCK_Q + s)) * BLOCK_Q  # first query token of this tile within the sequence
    base = tl.load(seq_lens_ptr + s) - n_q  # position of the sequence's first new token

    # Row r holds token m0 + r // G under query head kvh * G + r % G: the group's heads share every K/V tile.
    offs_r = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    tok = m0 + offs_r // G  # [BLOCK_M]
    heads = kvh * G + offs_r % G  # [BLOCK_M] int64
    q_valid = (offs_r < BLOCK_Q * G) & (tok < n_q)
    pos = base + tok
    rows = q_start.to(tl.int64) + tok  # [BLOCK_M] rows of q / out
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=q_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    # Keys up to the tile's last query position; a tile past the sequence's queries visits none.
    hi = base + tl.minimum(m0 + BLOCK_Q, n_q)
    hi = tl.where(m0 < n_q, hi, 0)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(base + m0 - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    table = block_tables_ptr + s * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < hi
        block = tl.load(table + cols // BS, mask=col_ok, other=0).to(tl.int64)
        offset = cols % BS
        kv_mask = col_ok[:, None] & d_mask[None, :]
        k_rows = block * stride_kb + offset * stride_ks + kvh * stride_kh
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        sc = _dot(q, tl.trans(k), FP32, UPCAST) * scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            sc = softcap * _tanh(sc / softcap)
        allowed = q_valid[:, None] & (cols[None, :] <= pos[:, None]) & col_ok[None, :]
        if HAS_WINDOW:
            allowed = allowed & (cols[None, :] > pos[:, None] - window)
        sc = tl.where(allowed, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet: no inf - inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = block * stride_vb + offset * stride_vs + kvh * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    out_offs = (rows[:, None] * H + heads[:, None]) * D + offs_d[None, :]
    tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=q_valid[:, None] & d_mask[None, :])


def paged_prefill_tiles(block_d: int, dtype: torch.dtype, target: object) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the varlen kernel: the prefill table of ``_arch.py``, except
    fp32 at 64 < D <= 128. There the per-column block-table gather (int64 row offsets per key) pushes the 32x32 FMA
    tiles past the register cap on sm_90 (ptxas: 255 registers and a 120 B stack); 32x16 with 8 warps compiles to
    74-79 registers and no stack on sm_90 and sm_80."""
    if dtype == torch.float32 and 64 < block_d <= 128:
        return 32, 16, 8, 1
    return attention_tiles(block_d, dtype, target)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`paged_attention`: the split-KV decode kernel when ``T == S`` (one new token per
    sequence), the varlen prefill kernel otherwise. No host sync (CUDA-graph safe).

    ``q`` may be a strided view with a unit last-dim stride. ``num_splits`` (decode only) sets how many key slices
    each (sequence, kv head) is cut into; ``None`` picks from the GPU size and the block-table capacity.
    """
    check_paged_args(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k, sliding_window, softcap, strict_strides=True
    )
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    T, H, D = q.shape
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    S = block_tables.shape[0]
    G = H // KVH
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0 or S == 0:
        return out
    BLOCK_D = max(16, triton.next_power_of_2(D))
    interp = interpreter_enabled() and not q.is_cuda
    common = dict(
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        FP32=q.dtype == torch.float32, UPCAST=interp,
    )  # fmt: skip
    window = int(sliding_window) if sliding_window is not None else 0
    cap = float(softcap) if softcap is not None else 0.0
    cache_strides = (
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
    )  # fmt: skip
    if T == S:  # every sequence has exactly one new token (each has at least one)
        if num_splits is None:
            num_splits = _decode.pick_num_splits(S, KVH, block_tables.shape[1] * BS, q.device)
        if interp:
            BLOCK_N, num_warps, num_stages = 16, 4, 1
        else:
            BLOCK_N, num_warps, num_stages = decode_tiles(BLOCK_D, q.dtype)
        if num_splits > 1:
            part_out = torch.empty((T, H, num_splits, D), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((T, H, num_splits), dtype=torch.float32, device=q.device)
        else:
            part_out = part_lse = out  # unused when not SPLIT
        _paged_decode_kernel[(S, KVH, num_splits)](
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k, out, part_out, part_lse, num_splits,
            H, D, G, BS, float(scale), window, cap,
            q.stride(0), q.stride(1), block_tables.stride(0), *cache_strides,
            SPLIT=num_splits > 1, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            num_warps=num_warps, num_stages=num_stages, **common,
        )  # fmt: skip
        if num_splits > 1:
            _decode._decode_merge_kernel[(T * H,)](
                part_out, part_lse, out, D, num_splits,
                BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=BLOCK_D, num_warps=4 if BLOCK_D >= 128 else 2,
            )  # fmt: skip
        return out
    if interp:
        BLOCK_M, BLOCK_N, num_warps, num_stages = 16, 16, 4, 1
    else:
        BLOCK_M, BLOCK_N, num_warps, num_stages = paged_prefill_tiles(BLOCK_D, q.dtype, target_of(q))
    BLOCK_M = max(BLOCK_M, triton.next_power_of_2(G))  # at least one token's whole group per tile
    BLOCK_Q = BLOCK_M // G
    _paged_prefill_kernel[(T // BLOCK_Q + S, KVH)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k, out,
        S, H, D, BS, float(scale), window, cap,
        q.stride(0), q.stride(1), block_tables.stride(0), *cache_strides,
        G=G, BLOCK_M=BLOCK_M, BLOCK_Q=BLOCK_Q, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        num_warps=num_warps, num_stages=num_stages, **common,
    )  # fmt: skip
    return out
