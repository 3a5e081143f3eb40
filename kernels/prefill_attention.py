"""Prefill attention over the compact KV cache (causal, GQA/MQA, optional sliding window and softcap).

``q`` is ``[B, T, Hq, D]`` left-padded like ``store_kv``; the cache already holds the new tokens. Query ``t`` of
row ``b`` (``t >= start[b]``) sits at position ``p = cache_lens[b] + t - start[b]`` and attends cache slots
``[max(0, p - W + 1), p]``. Padding query rows return zeros.
"""

from __future__ import annotations

import torch

from ._arch import attention_tiles, target_of
from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_dtype, check_shape, check_tensor
from ._triton import tl, triton
from .backend import interpreter_enabled, use_triton

__all__ = ["prefill_attention", "prefill_attention_torch", "prefill_attention_triton"]


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of left-padded queries ``q [B, T, Hq, D]`` over ``k_cache``/``v_cache [Bmax, Hk, S, D]``.

    ``cache_lens [B]`` are the lengths before these tokens, ``start [B]`` the left padding of each row.
    ``sliding_window`` W limits each query to its last W positions (itself included); ``softcap`` applies
    ``cap * tanh(s / cap)`` to the scaled scores. Returns ``[B, T, Hq, D]`` in ``q.dtype``, zeros on padding rows.
    ``alibi_slopes [Hq]`` (fp32, BLOOM's ALiBi): adds ``slope[h] * j`` to the score of cache slot ``j`` (the key's
    position among the row's real tokens); softmax is shift-invariant, so this is the usual ``slope * (j - p)`` bias.
    """
    if use_triton(q):
        return prefill_attention_triton(
            q, k_cache, v_cache, cache_lens, start, scale, sliding_window, softcap, alibi_slopes=alibi_slopes
        )
    return prefill_attention_torch(
        q, k_cache, v_cache, cache_lens, start, scale, sliding_window, softcap, alibi_slopes=alibi_slopes
    )


def check_alibi_slopes(alibi_slopes: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """ALiBi slopes must be one fp32 value per query head, on the queries' device."""
    if alibi_slopes is None:
        return
    check_tensor("alibi_slopes", alibi_slopes, ndim=1, dtypes=(torch.float32,), device=device)
    check_shape("alibi_slopes", alibi_slopes, (num_heads,))


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: tuple[tuple[str, torch.Tensor], ...],
    q_ndim: int,
    sliding_window: int | None,
    softcap: float | None,
    *,
    strict_strides: bool,
) -> None:
    """Shared launcher checks for prefill and decode attention (``q`` is 4-d for prefill, 3-d for decode)."""
    check_tensor("q", q, ndim=q_ndim, dtypes=FLOAT_DTYPES, last_dim_contiguous=strict_strides)
    device = q.device
    B, Hq, D = q.shape[0], q.shape[-2], q.shape[-1]
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=strict_strides)
    check_shape("k_cache", k_cache, (None, None, None, D))
    if k_cache.shape[0] < B:
        raise ValueError(f"k_cache has {k_cache.shape[0]} rows but q has batch {B}; the cache needs Bmax >= B")
    Hk = k_cache.shape[1]
    if Hk == 0 or Hq % Hk != 0:
        raise ValueError(f"q has {Hq} heads, not a multiple of the {Hk} kv heads of k_cache (GQA needs Hq % Hk == 0)")
    check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=strict_strides)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_same_dtype(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
    for name, t in lens:
        check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES, device=device)
        check_shape(name, t, (B,))
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"softcap must be a positive float or None, got {softcap}")


def masked_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 reference shared by prefill and decode: ``q [B, T, Hq, D]``, ``positions``/``valid [B, T]``.

    Query ``(b, t)`` attends cache slots ``j`` with ``p - W < j <= p``; invalid rows come out as zeros.
    """
    B, T, Hq, D = q.shape
    Hk = k_cache.shape[1]
    G = Hq // Hk
    # Only slots up to the largest position can be attended: slicing keeps the CPU path cheap (one host sync).
    L = min(k_cache.shape[2], max(int(positions.max()) + 1, 1)) if positions.numel() else 1
    k = k_cache[:B, :, :L].float()  # [B, Hk, L, D]
    v = v_cache[:B, :, :L].float()
    qf = q.float().permute(0, 2, 1, 3).reshape(B, Hk, G, T, D)
    scores = torch.matmul(qf, k[:, :, None].transpose(-1, -2)) * scale  # [B, Hk, G, T, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:  # slope of head h = kvh * G + g, times the key slot
        slots = torch.arange(L, device=q.device, dtype=torch.float32)
        scores = scores + alibi_slopes.float().view(Hk, G)[None, :, :, None, None] * slots
    j = torch.arange(L, device=q.device)
    p = positions.long()[:, :, None]  # [B, T, 1]
    allowed = (j[None, None, :] <= p) & valid[:, :, None]
    if sliding_window is not None:
        allowed &= j[None, None, :] > p - sliding_window
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Rows with no allowed key (padding) softmax to NaN: they must be zeros.
    probs = probs.nan_to_num(0.0)
    out = torch.matmul(probs, v[:, :, None])  # [B, Hk, G, T, D]
    return out.reshape(B, Hq, T, D).permute(0, 2, 1, 3).to(q.dtype).contiguous()


def prefill_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch reference of :func:`prefill_attention`: boolean mask from positions, matmul + softmax in fp32.

    Also the CPU production path. It syncs once (to slice the cache to the longest position), so unlike the
    Triton launcher it is not CUDA-graph safe.
    """
    check_attention_args(
        q, k_cache, v_cache, (("cache_lens", cache_lens), ("start", start)), 4, sliding_window, softcap,
        strict_strides=False,
    )  # fmt: skip
    T = q.shape[1]
    t = torch.arange(T, device=q.device)
    positions = cache_lens.long()[:, None] + t[None, :] - start.long()[:, None]  # [B, T]
    valid = t[None, :] >= start.long()[:, None]
    check_alibi_slopes(alibi_slopes, q.shape[2], q.device)
    if softcap is None and alibi_slopes is None and q.dtype == torch.float32 and k_cache.dtype == torch.float32:
        # fp32 only, as decode_attention_torch: half-precision SDPA on CPU rounds between its blocks
        return _prefill_sdpa(q, k_cache, v_cache, positions, valid, scale, sliding_window)
    return masked_attention_torch(q, k_cache, v_cache, positions, valid, scale, sliding_window, softcap, alibi_slopes)


def _prefill_sdpa(
    q: torch.Tensor,  # [B, T, Hq, D] fp32
    k_cache: torch.Tensor,  # [Bmax, Hk, S, D] fp32
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [B, T]
    valid: torch.Tensor,  # [B, T]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """:func:`masked_attention_torch`'s result through torch's fused SDPA: on CPU a blocked kernel with an online
    softmax, so no ``[B, H, T, L]`` score tensor is written (the reference writes several: 150 MB per layer at 2048
    tokens for 9 heads), which is what made long prefills slower than HF's sdpa model. A plain causal prompt (no
    cache before it, no padding, no window) takes ``is_causal``; other cases a boolean mask ``[B, 1, T, L]``."""
    B, T, Hq, _ = q.shape
    L = min(k_cache.shape[2], max(int(positions.max()) + 1, 1))  # one host sync, as the reference
    k, v = k_cache[:B, :, :L], v_cache[:B, :, :L]  # [B, Hk, L, D] views
    qt = q.transpose(1, 2)  # [B, Hq, T, D]
    gqa = k_cache.shape[1] != Hq
    padded = not bool(valid.all())
    if not padded and sliding_window is None and L == T and int(positions[:, 0].max()) == 0:
        out = torch.nn.functional.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous()  # [B, T, Hq, D]
    j = torch.arange(L, device=q.device)
    p = positions.long()[:, :, None]  # [B, T, 1]
    allowed = j[None, None, :] <= p  # [B, T, L]
    if sliding_window is not None:
        allowed &= j[None, None, :] > p - sliding_window
    if padded:  # a padding row allows no key (NaN from softmax): let it see slot 0, then zero it like the reference
        allowed |= (~valid)[:, :, None] & (j == 0)[None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        qt, k, v, attn_mask=allowed[:, None], scale=scale, enable_gqa=gqa
    ).transpose(1, 2)  # [B, T, Hq, D]
    if padded:
        out = out.masked_fill(~valid[:, :, None, None], 0.0)
    return out.contiguous()


@triton.jit
def _tanh(x):
    # tl has no portable tanh (libdevice is CUDA-only, not interpreter-friendly); exp saturates cleanly at +-1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _dot(a, b, FP32: tl.constexpr, UPCAST: tl.constexpr):
    # fp32 inputs must not silently drop to tf32; bf16 dots are wrong under the interpreter, so upcast there.
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    elif UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _prefill_kernel(
    q_ptr,  # [B, T, Hq, D]
    k_cache_ptr,  # [Bmax, Hk, S, D]
    v_cache_ptr,  # [Bmax, Hk, S, D]
    cache_lens_ptr,  # [B]
    start_ptr,  # [B]
    out_ptr,  # [B, T, Hq, D] contiguous
    T,
    Hq,
    S,
    D,
    G,  # query heads per kv head
    scale,
    window,  # sliding window W (used when HAS_WINDOW)
    softcap,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    alibi_ptr,  # [Hq] fp32 ALiBi slopes (read when HAS_ALIBI)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    FP32: tl.constexpr,
    UPCAST: tl.constexpr,
):
    bh = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    # Offsets from b and the kv head are int64: b * stride_qb and kvh * stride_kh pass 2^31 on large caches.
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    kvh = (h // G).to(tl.int64)
    first = tl.load(start_ptr + b)
    base = tl.load(cache_lens_ptr + b) - first  # position of token t is base + t

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < D
    q_valid = (offs_m >= first) & (offs_m < T)
    pos = base + offs_m  # [BLOCK_M]

    q = tl.load(
        q_ptr + b * stride_qb + offs_m[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
        mask=q_valid[:, None] & d_mask[None, :],
        other=0.0,
    )

    # Key range touched by the block's valid queries; blocks fully outside it are never visited.
    t_lo = tl.maximum(m0, first)
    t_hi = tl.minimum(m0 + BLOCK_M, T)  # exclusive
    hi = tl.minimum(base + t_hi, S)  # one past the last query position, clamped to the cache
    hi = tl.where(t_lo < t_hi, hi, 0)  # a block of only padding visits no keys
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(base + t_lo - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    k_base = k_cache_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_cache_ptr + b * stride_vb + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + h)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        kv_mask = (cols[:, None] < hi) & d_mask[None, :]
        k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), FP32, UPCAST) * scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        if HAS_ALIBI:
            s = s + slope * cols[None, :].to(tl.float32)  # bias by the key's slot (its real-token position)
        allowed = q_valid[:, None] & (cols[None, :] <= pos[:, None]) & (cols[None, :] < hi)
        if HAS_WINDOW:
            allowed = allowed & (cols[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing allowed yet keeps m = -inf; subtracting 0 instead avoids inf - inf = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows: acc is 0, so they come out as zeros
    out = acc / l_safe[:, None]
    out_offs = ((b * T + offs_m[:, None]) * Hq + h) * D + offs_d[None, :]  # int64 (b is)
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & d_mask[None, :])


def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`prefill_attention` (flash-attention: online softmax, fp32 accumulation).

    ``q`` may be a strided view (e.g. of a fused qkv output) with a unit last-dim stride. No host sync.
    """
    check_attention_args(
        q, k_cache, v_cache, (("cache_lens", cache_lens), ("start", start)), 4, sliding_window, softcap,
        strict_strides=True,
    )  # fmt: skip
    check_alibi_slopes(alibi_slopes, q.shape[2], q.device)
    B, T, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    BLOCK_D = max(16, triton.next_power_of_2(D))
    interp = interpreter_enabled() and not q.is_cuda
    if interp:
        # The interpreter's cost grows with program count and op count; small tiles keep tests quick.
        BLOCK_M, BLOCK_N, num_warps, num_stages = 16, 16, 4, 1
    else:
        # Per-GPU tables (kernels/_arch.py): no register spill on sm_90 / sm_80, and within 99 KB of shared memory
        # everywhere but Hopper.
        BLOCK_M, BLOCK_N, num_warps, num_stages = attention_tiles(BLOCK_D, q.dtype, target_of(q))
    grid = (B * Hq, triton.cdiv(T, BLOCK_M))  # B*Hq on axis 0: axes 1-2 cap at 65535
    _prefill_kernel[grid](
        q, k_cache, v_cache, cache_lens, start, out,
        T, Hq, S, D, Hq // Hk, float(scale),
        int(sliding_window) if sliding_window is not None else 0,
        float(softcap) if softcap is not None else 0.0,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        alibi_slopes if alibi_slopes is not None else out,  # any pointer when unused
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None, HAS_ALIBI=alibi_slopes is not None,
        FP32=q.dtype == torch.float32, UPCAST=interp,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
