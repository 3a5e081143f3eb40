"""Ragged (varlen) causal attention over a paged KV cache, and the store that fills it.

The cache is a pool of fixed-size blocks, ``k_cache``/``v_cache [NB, BS, KVH, D]``; sequence ``s`` owns the blocks
listed in ``block_tables[s]`` (its key ``j`` lives in block ``block_tables[s, j // BS]`` at offset ``j % BS``).
One call serves a ragged batch: the new tokens of every sequence are packed along the first axis of
``q [T, H, D]``, sequence ``s`` owning rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]``. They are the *last* ``n_q``
of its ``seq_lens_k[s]`` keys (already stored), so a prefill chunk and a decode token are the same thing with a
different ``n_q``. Query ``i`` of sequence ``s`` sits at position ``p = seq_lens_k[s] - n_q + i`` and attends keys
``[max(0, p - W + 1), p]`` (W = ``sliding_window``, or all).

``store_paged_kv`` writes token ``t`` to slot ``slot_mapping[t] = block * BS + offset``; negative slots (padding,
tokens whose KV is already shared) are skipped.

On CUDA ``paged_attention`` runs a split-KV decode kernel when every sequence has exactly one new token
(``T == S``) and a varlen flash-attention kernel otherwise; neither syncs with the host. Elsewhere the torch path
batches the one-token sequences into a few SDPA calls (groups of similar length) and runs each longer chunk on
its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_dtype, check_shape, check_tensor
from .prefill_attention import masked_attention_torch

__all__ = [
    "paged_attention",
    "paged_attention_torch",
    "paged_attention_reference",
    "store_paged_kv",
    "store_paged_kv_torch",
]


# ----------------------------------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------------------------------


def check_paged_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    sliding_window: int | None,
    softcap: float | None,
    *,
    strict_strides: bool,
) -> None:
    """Shape/dtype/device checks shared by the torch and Triton paths (no host sync: values are not read)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=strict_strides)
    device = q.device
    H, D = q.shape[1], q.shape[2]
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=strict_strides)
    check_shape("k_cache", k_cache, (None, None, None, D))
    KVH = k_cache.shape[2]
    if KVH == 0 or H % KVH != 0:
        raise ValueError(f"q has {H} heads, not a multiple of the {KVH} kv heads of k_cache (GQA needs H % KVH == 0)")
    check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=strict_strides)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_same_dtype(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    S = block_tables.shape[0]
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("cu_seqlens_q", cu_seqlens_q, (S + 1,))
    check_tensor("seq_lens_k", seq_lens_k, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("seq_lens_k", seq_lens_k, (S,))
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"softcap must be a positive float or None, got {softcap}")


def _check_lengths(
    q: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, block_size: int
) -> tuple[list[int], list[int]]:
    """Host-side value checks of the torch path (one sync): returns ``(n_q per sequence, keys per sequence)``."""
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    if cu and (cu[0] != 0 or cu[-1] != q.shape[0]):
        raise ValueError(f"cu_seqlens_q must start at 0 and end at q.shape[0]={q.shape[0]}, got {cu[0]} ... {cu[-1]}")
    n_q = [b - a for a, b in zip(cu[:-1], cu[1:])]
    capacity = block_tables.shape[1] * block_size
    for s, (n, L) in enumerate(zip(n_q, lens)):
        if n < 1:
            # The Triton launcher takes T == S to mean one token each, which holds only if none has zero.
            raise ValueError(
                f"sequence {s} has {n} new tokens in cu_seqlens_q: each sequence needs at least one (leave a "
                "sequence with nothing to compute out of the batch)"
            )
        if n > L:
            raise ValueError(
                f"sequence {s} has {n} new tokens but seq_lens_k[{s}]={L}: seq_lens_k counts the keys *including* "
                "the new tokens (store them with store_paged_kv first)"
            )
        if L > capacity:
            raise ValueError(
                f"seq_lens_k[{s}]={L} needs more than the {block_tables.shape[1]} blocks of {block_size} slots "
                "block_tables has room for; widen block_tables"
            )
    return n_q, lens


# ----------------------------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    plans: dict | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged causal attention of ``q [T, H, D]`` over the paged ``k_cache``/``v_cache [NB, BS, KVH, D]``.

    ``block_tables [S, MB]`` (int32) lists each sequence's blocks; ``cu_seqlens_q [S + 1]`` (int32) delimits each
    sequence's new tokens in ``q``; ``seq_lens_k [S]`` (int32) counts each sequence's keys *including* the new
    tokens, which must already be stored (:func:`store_paged_kv`). Every sequence has at least one new token.
    ``softcap`` applies ``cap * tanh(s / cap)`` to the scaled scores; ``sliding_window`` W limits each query to its
    last W positions (itself included). H must be a multiple of KVH (GQA/MQA). Returns ``[T, H, D]`` in ``q.dtype``.
    ``plans``: a dict kept for one step and passed to every layer (see :func:`paged_attention_torch`; the Triton
    path needs none). ``alibi_slopes [H]`` (fp32, bloom): each score gets ``slope[h] * j`` for the key at position
    ``j`` of its sequence; torch path only (the Triton kernels refuse it).
    """
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k, scale, softcap, sliding_window)
    if _use_triton(q):
        if alibi_slopes is not None:
            raise ValueError(
                "alibi_slopes: the Triton paged attention kernels have no ALiBi; run ALiBi models on the torch path "
                "(HF_DSINFER_BACKEND=torch) or with padded batches"
            )
        from .paged_attention_triton import paged_attention_triton

        return paged_attention_triton(*args)
    return paged_attention_torch(*args, plans=plans, alibi_slopes=alibi_slopes)


def store_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``/``v [T, KVH, D]`` into ``k_cache``/``v_cache [NB, BS, KVH, D]`` at ``slot_mapping [T]`` (int64).

    Slot ``block * BS + offset``; tokens with a negative slot are skipped. The torch path raises on a slot past the
    cache; the Triton path does not sync, so there the caller guarantees the bounds (such writes are dropped).
    """
    if _use_triton(k):
        from .paged_attention_triton import store_paged_kv_triton

        store_paged_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_paged_kv_torch(k, v, k_cache, v_cache, slot_mapping)


def _use_triton(t: torch.Tensor) -> bool:
    from .backend import use_triton

    return use_triton(t)


# ----------------------------------------------------------------------------------------------------------------------
# Torch paths (CPU production path and test oracle)
# ----------------------------------------------------------------------------------------------------------------------


def _check_store_args(k, v, k_cache, v_cache, slot_mapping, *, strict_strides: bool) -> None:
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=strict_strides)
    device = k.device
    check_tensor("v", v, ndim=3, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=strict_strides)
    check_shape("v", v, tuple(k.shape))
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=strict_strides)
    check_shape("k_cache", k_cache, (None, None, k.shape[1], k.shape[2]))
    check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=strict_strides)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_same_dtype(("k", "v", "k_cache", "v_cache"), (k, v, k_cache, v_cache))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("slot_mapping", slot_mapping, (k.shape[0],))


def store_paged_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch :func:`store_paged_kv` (syncs once to check the bounds)."""
    _check_store_args(k, v, k_cache, v_cache, slot_mapping, strict_strides=False)
    NB, BS = k_cache.shape[0], k_cache.shape[1]
    if slot_mapping.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(slot_mapping)).tolist()  # the one host sync
    if hi >= NB * BS:
        raise ValueError(f"slot_mapping holds slot {hi} but the cache has {NB} blocks of {BS} slots")
    if lo >= 0 and k_cache.is_contiguous() and v_cache.is_contiguous():
        # Every token is stored (the serving engine's steps): one index_copy_ per pool into its [NB * BS] slots
        # took 20 / 38 us for 58 / 256 tokens against 30 / 70 us for the masked advanced-indexing write below.
        slots = slot_mapping.long()
        k_cache.view(NB * BS, *k_cache.shape[2:]).index_copy_(0, slots, k)
        v_cache.view(NB * BS, *v_cache.shape[2:]).index_copy_(0, slots, v)
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()  # [T']
    if slots.numel() == 0:
        return
    block, offset = slots // BS, slots % BS
    # Advanced indexing on (block, offset) writes through any strides (a view of a larger pool is fine).
    k_cache[block, offset] = k[keep]
    v_cache[block, offset] = v[keep]


def gather_paged_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The first ``num_keys`` keys of every sequence as a compact ``[S, KVH, num_keys, D]`` copy.

    ``cache [NB, BS, KVH, D]``, ``block_tables [S, MB]``. Table entries past a sequence's last block may be
    anything (padding, -1): they are clamped into range and their keys are masked by the caller.
    """
    NB, BS, KVH, D = cache.shape
    S = block_tables.shape[0]
    n_blocks = -(-num_keys // BS)
    table = block_tables[:, :n_blocks].long().clamp(0, NB - 1)  # [S, nb]
    if cache[0].is_contiguous():
        # Whole blocks as rows: index_select copies each block in one piece; 1216 blocks of 12 KB took 3.1 ms
        # against 12.9 ms for the element-wise gather of cache[table] (one CPU thread, busy machine).
        keys = cache.view(NB, BS * KVH * D).index_select(0, table.flatten())  # [S * nb, BS * KVH * D]
    else:
        keys = cache[table]  # [S, nb, BS, KVH, D]
    return keys.reshape(S, n_blocks * BS, KVH, D)[:, :num_keys].transpose(1, 2)  # [S, KVH, L, D]


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    plans: dict | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`paged_attention`: the CPU production path.

    Syncs once on the lengths. The one-token sequences (decode) run as batched SDPAs over their gathered blocks, in
    groups of similar length (:func:`_decode_groups`); every longer chunk (prefill) runs on its own, so no padding to
    the longest chunk is computed. fp32 without a softcap uses torch's SDPA; half precision and softcap take the
    explicit fp32 scores of :func:`masked_attention_torch` (half-precision SDPA on CPU rounds between its blocks, so
    a sequence's result would depend on what it is batched with), and so does ALiBi (``alibi_slopes [H]``).

    ``plans``: a dict the caller keeps for one step and passes to every layer's call. What this path derives from
    the lengths and tables (the checks, the groups and their index tensors) is computed by the first layer and read
    by the others, keyed by the identity of ``block_tables`` / ``cu_seqlens_q`` / ``seq_lens_k`` and the cache's
    block and key sizes, so tensors the caller changes between calls must be new tensors (a step's are).
    """
    check_paged_args(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k, sliding_window, softcap, strict_strides=False
    )
    T, H, D = q.shape
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes, ndim=1, dtypes=(torch.float32,), device=q.device)
        check_shape("alibi_slopes", alibi_slopes, (H,))
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)  # every row is written: each sequence has >= 1
    if T == 0:
        return out
    key_bytes = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()  # one key of one layer
    key = (id(block_tables), id(cu_seqlens_q), id(seq_lens_k), T, k_cache.shape[1], key_bytes)
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        plan = _plan(q, block_tables, cu_seqlens_q, seq_lens_k, k_cache.shape[1], key_bytes)
        if plans is not None:
            plans[key] = plan
    for rows, tables, seq_lens, max_len in plan.decode:
        out[rows] = _attend(
            q[rows][:, None], k_cache, v_cache, tables, seq_lens, max_len, scale, softcap, sliding_window, alibi_slopes
        )[:, 0]  # fmt: skip
    for s, a, n, max_len in plan.chunks:
        out[a : a + n] = _attend(
            q[None, a : a + n], k_cache, v_cache, block_tables[s : s + 1], seq_lens_k[s : s + 1], max_len,
            scale, softcap, sliding_window, alibi_slopes,
        )[0]  # fmt: skip
    return out


@dataclass
class _TorchPlan:
    """What :func:`paged_attention_torch` derives from a step's lengths and tables (the same for every layer)."""

    decode: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]  # per group: rows, tables, seq_lens, max len
    chunks: list[tuple[int, int, int, int]]  # per longer chunk: sequence, first row, new tokens, keys


def _plan(
    q: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_size: int,
    key_bytes: int,
) -> _TorchPlan:
    n_q, lens = _check_lengths(q, block_tables, cu_seqlens_q, seq_lens_k, block_size)
    starts = cu_seqlens_q.tolist()
    decode = []
    for group in _decode_groups([s for s, n in enumerate(n_q) if n == 1], lens, block_size, key_bytes):
        idx = torch.tensor(group, device=q.device)
        rows = cu_seqlens_q[idx].long()  # [Sg] the query row of each one-token sequence
        decode.append((rows, block_tables[idx], seq_lens_k[idx], lens[group[-1]]))
    chunks = [(s, starts[s], n, lens[s]) for s, n in enumerate(n_q) if n > 1]
    return _TorchPlan(decode, chunks)


#: Bytes of gathered keys (as many of values) one batched decode attention reads at most, unless one sequence
#: alone needs more; see :func:`_decode_groups`.
DECODE_GROUP_BYTES = 2 << 20


def _decode_groups(decode: list[int], lens: list[int], block_size: int, key_bytes: int) -> list[list[int]]:
    """The one-token sequences ``decode`` in groups for one batched attention each, shortest first.

    A group gathers its sequences' keys and values padded to its longest sequence, so grouping sequences of similar
    length pads less, and a group whose gathered keys fit :data:`DECODE_GROUP_BYTES` is still in the CPU's cache
    when the attention reads it. 58 sequences of 40-384 keys (tiny preset's heads, one thread, 2026-11-25) took
    5.1-7.1 ms as one group (11 MB of gathered keys) and 1.7 ms in groups of 2 MiB (1 MiB: 1.9 ms, 4 MiB: 1.9-2.2 ms);
    before grouping, an engine step of 58 decode tokens spent most of its time here.
    """
    groups: list[list[int]] = []
    for s in sorted(decode, key=lens.__getitem__):
        padded = -(-lens[s] // block_size) * block_size * key_bytes  # this one's keys; the longest so far
        if groups and (len(groups[-1]) + 1) * padded <= DECODE_GROUP_BYTES:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def _attend(
    q: torch.Tensor,  # [B, Tq, H, D]: every sequence of the group has exactly Tq new tokens
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, MB]
    seq_lens: torch.Tensor,  # [B]
    max_len: int,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    alibi_slopes: torch.Tensor | None = None,  # [H] fp32
) -> torch.Tensor:
    """Attention of ``B`` sequences with the same number ``Tq`` of new tokens; returns ``[B, Tq, H, D]``."""
    B, Tq, H, D = q.shape
    k = gather_paged_kv(k_cache, block_tables, max_len)  # [B, KVH, L, D]
    v = gather_paged_kv(v_cache, block_tables, max_len)
    positions = seq_lens.long()[:, None] - Tq + torch.arange(Tq, device=q.device)  # [B, Tq]
    if softcap is None and alibi_slopes is None and q.dtype == torch.float32:
        j = torch.arange(max_len, device=q.device)
        allowed = j[None, None, :] <= positions[:, :, None]  # [B, Tq, L]
        if sliding_window is not None:
            allowed &= j[None, None, :] > positions[:, :, None] - sliding_window
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),  # [B, H, Tq, D]
            k,
            v,
            attn_mask=allowed[:, None],  # [B, 1, Tq, L]; every query allows at least itself
            scale=scale,
            enable_gqa=k.shape[1] != H,
        ).transpose(1, 2)  # [B, Tq, H, D]
    valid = torch.ones_like(positions, dtype=torch.bool)
    # gathered keys sit at their positions (slot j = key j of the sequence), so the ALiBi bias of slot j is right
    return masked_attention_torch(q, k, v, positions, valid, scale, sliding_window, softcap, alibi_slopes)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The test oracle: one sequence at a time, keys read slot by slot through the block table, fp32 math.

    Deliberately independent of the batched gathers of :func:`paged_attention_torch` (slow; tests only).
    """
    check_paged_args(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k, sliding_window, softcap, strict_strides=False
    )
    T, H, D = q.shape
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    out = torch.zeros((T, H, D), dtype=torch.float32, device=q.device)
    n_q, lens = _check_lengths(q, block_tables, cu_seqlens_q, seq_lens_k, BS)
    cu = cu_seqlens_q.tolist()
    for s, (n, L) in enumerate(zip(n_q, lens)):
        slots = [(int(block_tables[s, j // BS]), j % BS) for j in range(L)]
        k = torch.stack([k_cache[b, o] for b, o in slots]).float()  # [L, KVH, D]
        v = torch.stack([v_cache[b, o] for b, o in slots]).float()
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # [L, H, D]
        for i in range(n):
            p = L - n + i
            lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            scores = torch.einsum("hd,lhd->hl", q[cu[s] + i].float(), k[lo : p + 1]) * scale  # [H, keys]
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if alibi_slopes is not None:  # slope of head h times the key's position in its sequence
                scores = scores + alibi_slopes.float()[:, None] * torch.arange(lo, p + 1, device=q.device)
            out[cu[s] + i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[lo : p + 1])
    return out.to(q.dtype)
