"""Decode attention: one new query per row over the compact KV cache, split-KV (flash-decoding).

``q [B, Hq, D]``; ``seq_lens [B]`` count the cached tokens including the new one, whose position is
``seq_lens[b] - 1``. Stage 1 runs a grid ``(B, Hk, num_splits)``: each program takes every query head of one KV
group (so K/V are read once per group) over one slice of the keys and writes a normalized partial output plus
its log-sum-exp to fp32 scratch. Stage 2 merges the slices. Nothing here reads ``seq_lens`` on the host, so the
launcher is CUDA-graph safe.
"""

from __future__ import annotations

import functools

import torch

from ._arch import assumed_target, decode_tiles
from ._triton import tl, triton
from .backend import interpreter_enabled, use_triton
from .prefill_attention import _dot, _tanh, check_alibi_slopes, check_attention_args, masked_attention_torch

__all__ = ["decode_attention", "decode_attention_torch", "decode_attention_triton"]

# A split shorter than this spends more on the merge than it saves.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per row, ``q [B, Hq, D]``, over ``k_cache``/``v_cache [Bmax, Hk, S, D]``.

    ``seq_lens [B]`` include the new token (already stored). The query at position ``p = seq_lens[b] - 1``
    attends slots ``[max(0, p - W + 1), p]``. ``num_splits`` (Triton path only) sets how many KV slices each
    (row, kv head) is cut into; ``None`` picks from the GPU size and the cache length ``S``. Returns ``[B, Hq, D]``.
    ``alibi_slopes [Hq]`` (fp32): BLOOM's ALiBi bias ``slope[h] * j`` on cache slot ``j`` (see ``prefill_attention``).
    """
    args = (q, k_cache, v_cache, seq_lens, scale, sliding_window, softcap, num_splits)
    if use_triton(q):
        return decode_attention_triton(*args, alibi_slopes=alibi_slopes)
    return decode_attention_torch(*args, alibi_slopes=alibi_slopes)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch version of :func:`decode_attention` (``num_splits`` ignored).

    Also the CPU production path: it syncs once on ``seq_lens`` (free on CPU, unlike the graph-safe Triton
    launcher) to attend only the slots in use, and runs torch's fused SDPA on fp32 inputs without a softcap; other
    cases take the explicit fp32 scores of :func:`masked_attention_torch` (the test reference).
    """
    check_attention_args(
        q, k_cache, v_cache, (("seq_lens", seq_lens),), 3, sliding_window, softcap, strict_strides=False
    )
    check_alibi_slopes(alibi_slopes, q.shape[1], q.device)
    if softcap is None and alibi_slopes is None and q.dtype == torch.float32:
        # fp32 only: half-precision SDPA on CPU rounds between its blocks, so a row's result would depend on the
        # length of the longest row in the batch (padded batches must equal single runs).
        return _decode_sdpa(q, k_cache, v_cache, seq_lens, scale, sliding_window)
    positions = seq_lens.long()[:, None] - 1  # [B, 1]
    valid = positions >= 0
    out = masked_attention_torch(
        q[:, None], k_cache, v_cache, positions, valid, scale, sliding_window, softcap, alibi_slopes
    )
    return out[:, 0]


def _decode_sdpa(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [Bmax, Hk, S, D]
    v_cache: torch.Tensor,  # [Bmax, Hk, S, D]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    B, Hq, _ = q.shape
    lo, hi = (int(x) for x in torch.aminmax(seq_lens))
    L = max(1, min(k_cache.shape[2], hi))  # slots in use by the longest row
    j = torch.arange(L, device=q.device)
    lens = seq_lens.long()[:, None]  # [B, 1]
    allowed = j[None, :] < lens  # [B, L]
    if sliding_window is not None:
        allowed &= j[None, :] >= lens - sliding_window
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None],
        k_cache[:B, :, :L],  # [B, Hk, L, D] view
        v_cache[:B, :, :L],
        attn_mask=allowed[:, None, None],  # [B, 1, 1, L]
        scale=scale,
        enable_gqa=k_cache.shape[1] != Hq,
    )[:, :, 0]  # [B, Hq, D]
    if lo <= 0:  # a row with nothing cached has no allowed key (NaN from softmax): zeros, like the reference
        out = out.masked_fill((lens <= 0)[:, :, None], 0.0)
    return out


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_num_splits(batch: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Split count from the grid size and the cache length ``S`` (never from ``seq_lens``: that would sync).

    Aims at about four programs per SM, without cutting slices below ``_MIN_KEYS_PER_SPLIT`` keys of ``S``, and
    rounds down to a power of two: the count only sizes the fp32 scratch and the merge's block, so a handful of
    values (1, 2, 4, ... 64) keeps the merge kernel's compiles (and CUDA-graph buckets' first calls) few.
    """
    sms = 1
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    elif (assumed := assumed_target()) is not None:
        sms = assumed.sm_count  # meta tensors under assume_target (the AOT compile tests)
    want = triton.cdiv(4 * sms, max(1, batch * kv_heads))
    cap = triton.cdiv(max(1, max_len), _MIN_KEYS_PER_SPLIT)
    n = max(1, min(want, cap, _MAX_SPLITS))
    return 1 << (n.bit_length() - 1)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [Bmax, Hk, S, D]
    v_cache_ptr,  # [Bmax, Hk, S, D]
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, Hq, D] contiguous (used when not SPLIT)
    part_out_ptr,  # [B, Hq, num_splits, D] fp32 (used when SPLIT)
    part_lse_ptr,  # [B, Hq, num_splits] fp32
    num_splits,  # a runtime value: one binary serves every split count
    Hq,
    S,
    D,
    G,  # query heads per kv head
    scale,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    alibi_ptr,  # [Hq] fp32 ALiBi slopes (read when HAS_ALIBI)
    SPLIT: tl.constexpr,  # num_splits > 1: write partial results for the merge
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FP32: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_ALIBI: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), S)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)  # the new token at seq_len - 1 sees slots [seq_len - W, seq_len - 1]
    # Cut [lo, seq_len) into num_splits slices, each a whole number of BLOCK_N tiles; tail slices may be empty.
    chunk = tl.cdiv(tl.cdiv(tl.maximum(seq_len - lo, 0), num_splits), BLOCK_N) * BLOCK_N
    s_lo = lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g  # query heads of this kv group
    # Rows past G are zero queries: tl.dot needs at least 16 rows, and they are never stored.
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    k_base = k_cache_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_cache_ptr + b * stride_vb + kvh * stride_vh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    slopes = tl.zeros([BLOCK_G], tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=g_mask, other=0.0)  # [BLOCK_G]
    for n0 in range(s_lo, s_hi, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < s_hi
        kv_mask = col_ok[:, None] & d_mask[None, :]
        k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), FP32, UPCAST) * scale  # [BLOCK_G, BLOCK_N]
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        if HAS_ALIBI:
            s = s + slopes[:, None] * cols[None, :].to(tl.float32)
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoids inf - inf before any key is seen
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    row = b * Hq + heads  # [BLOCK_G] flat (b, head) index, int64
    if not SPLIT:
        tl.store(out_ptr + row[:, None] * D + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = row * num_splits + split
        tl.store(part_out_ptr + part[:, None] * D + offs_d[None, :], o, mask=store_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log(l_safe), float("-inf"))  # empty slice: weight 0 in the merge
        tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    part_out_ptr,  # [B, Hq, num_splits, D] fp32
    part_lse_ptr,  # [B, Hq, num_splits] fp32
    out_ptr,  # [B, Hq, D] contiguous
    D,
    num_splits,
    BLOCK_S: tl.constexpr,  # >= num_splits
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # flat (b, head)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # [BLOCK_S]; 0 for empty slices
    total = tl.sum(w, 0)
    part = tl.load(
        part_out_ptr + (row * num_splits + offs_s[:, None]) * D + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    o = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * D + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`decode_attention`: split-KV stage 1, then a merge when ``num_splits > 1``.

    ``q`` may be a strided view with a unit last-dim stride. No host sync, so it can be captured in a CUDA graph.
    """
    check_attention_args(
        q, k_cache, v_cache, (("seq_lens", seq_lens),), 3, sliding_window, softcap, strict_strides=True
    )
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    check_alibi_slopes(alibi_slopes, q.shape[1], q.device)
    B, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hk
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if num_splits is None:
        num_splits = pick_num_splits(B, Hk, S, q.device)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_G = max(16, triton.next_power_of_2(G))
    interp = interpreter_enabled() and not q.is_cuda
    if interp:
        BLOCK_N, num_warps, num_stages = 32, 4, 1
    else:
        BLOCK_N, num_warps, num_stages = decode_tiles(BLOCK_D, q.dtype)  # see _arch.py
    if num_splits > 1:
        part_out = torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    _decode_split_kernel[(B, Hk, num_splits)](
        q, k_cache, v_cache, seq_lens, out, part_out, part_lse, num_splits,
        Hq, S, D, G, float(scale),
        int(sliding_window) if sliding_window is not None else 0,
        float(softcap) if softcap is not None else 0.0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        alibi_slopes if alibi_slopes is not None else out,  # any pointer when unused
        SPLIT=num_splits > 1, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        FP32=q.dtype == torch.float32, UPCAST=interp, HAS_ALIBI=alibi_slopes is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_merge_kernel[(B * Hq,)](
            part_out, part_lse, out, D, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=BLOCK_D,
            num_warps=4 if BLOCK_D >= 128 else 2,
        )  # fmt: skip
    return out
