"""Fused self-attention over the static KV cache: one QKV GEMM, optional qk-norm, rotary, store, attend, project."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hf_dsinfer.kernels import decode_attention, encoder_attention, prefill_attention, store_kv, use_triton

from .kv_cache import StaticKVCache
from .linear import Linear
from .norms import FusedNorm, NormSpec, SplitRMSNorm, split_rms_norm_pair
from .rotary import RotaryTable


@dataclass(frozen=True)
class AttentionSpec:
    """Shape and math of one attention block.

    ``rotary``: apply the model's rotary table (False for learned/absolute positions). ``sliding_window`` W: each
    query sees its last W positions. ``softcap``: ``cap * tanh(s / cap)`` on the scores. ``qk_norm``: a norm over
    each head of q and k before rotary (qwen3). ``causal``: False for encoders: every token attends every real token
    of its row (its first ``StepContext.key_lens`` slots), with no KV cache. ``qk_norm_full_width``: the
    q (k) norm runs over all heads together, weights ``[Hq * D]`` / ``[Hk * D]`` (olmo2), not per head.
    ``alibi_slopes``: one ALiBi slope per query head (bloom; with ``rotary=False``): each score gets
    ``slope * j`` for the key at position ``j`` of the row. ``qk_norm_split`` (tensor parallelism, with
    ``qk_norm_full_width``): this rank holds some heads of a full-width q/k norm; ``((q width, q share), (k width, k
    share))`` are the widths of the whole projections and ``1 / copies`` of each element (kv heads replicated on
    several ranks count once); the statistics are summed over the ranks (:class:`~.norms.SplitRMSNorm`).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rotary: bool = True
    sliding_window: int | None = None
    softcap: float | None = None
    qk_norm: NormSpec | None = None
    causal: bool = True
    qk_norm_full_width: bool = False
    alibi_slopes: tuple[float, ...] | None = None
    qk_norm_split: tuple[tuple[int, float], tuple[int, float]] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if not self.causal and (self.sliding_window is not None or self.softcap is not None):
            raise ValueError("non-causal (encoder) attention supports neither sliding_window nor softcap")
        if self.alibi_slopes is not None and (len(self.alibi_slopes) != self.num_heads or not self.causal):
            raise ValueError(
                f"alibi_slopes needs one slope per query head ({self.num_heads}) and causal attention, got "
                f"{len(self.alibi_slopes)} slopes, causal={self.causal}"
            )
        if self.qk_norm_split is not None and not (self.qk_norm_full_width and self.qk_norm is not None):
            raise ValueError("qk_norm_split is for a full-width q/k norm: set qk_norm and qk_norm_full_width too")


def unpack_rows(packed: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """``packed [N, ...]`` tokens -> ``[B, T, ...]`` rows (``ctx.padded_shape``) at slots ``ctx.token_index``.

    Each row holds its real tokens first (the keys, ``ctx.key_lens[b]`` of them), then any padding query the caller
    kept (its first position); empty slots are zeros.
    """
    B, T = ctx.padded_shape
    rows = packed.new_zeros((B * T, *packed.shape[1:]))
    return rows.index_copy_(0, ctx.token_index, packed).view(B, T, *packed.shape[1:])


@dataclass
class StepContext:
    """What every layer of one forward step shares (built once per step by the model-level forward).

    ``start [B]`` int32: left padding of each row among this step's ``T`` tokens. ``cache_lens [B]`` int32: real
    tokens cached per row before this step. ``seq_lens [B]``: lengths after a single-token step (decode only).
    ``positions [B*T]``: rotary position of each token. ``rotary``: the model's table (None without rotary).
    ``key_lens [B]``: encoders only (non-causal attention, ``cache`` None): real tokens per row, which come first.
    ``token_index [N]`` with ``padded_shape (B, T)``: encoders run on the real tokens only (``[1, N, C]`` packed);
    attention scatters them to slots of a ``[B, T]`` grid, real tokens first in each row (see :func:`unpack_rows`).
    """

    cache: StaticKVCache | None
    start: torch.Tensor
    cache_lens: torch.Tensor
    positions: torch.Tensor
    rotary: RotaryTable | None
    seq_lens: torch.Tensor | None = None
    key_lens: torch.Tensor | None = None
    rotary_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # torch path: angles gathered once per step
    # Per-layer tables (gemma3's local/global bases): their rows, gathered once per step too, keyed by table.
    layer_rotary_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    # Compiled CPU decode (generation/decode.py): attend the first ``attend_len`` slots, a bound the host knows
    # without reading ``seq_lens``, and store/attend with no host sync so one compiled graph serves every step.
    attend_len: int | None = None
    token_index: torch.Tensor | None = None
    padded_shape: tuple[int, int] | None = None
    # Eager CPU decode (:func:`_cpu_decode_attend`): the step's store indices and key mask, built by the first layer
    # of each (sliding window, cache slots) and read by the others; False when this step cannot take that path.
    cpu_decode: dict[tuple[int | None, int], _CPUDecodeStep | bool] | None = None

    @property
    def decode(self) -> bool:
        return self.seq_lens is not None

    def rotate(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, table: RotaryTable | None = None
    ) -> None:
        """Rotate the q and k heads of ``qkv [B, T, Hq + 2Hk, D]`` in place (rows q, then k, then v).

        ``table``: a layer's own table (e.g. gemma3's sliding layers) instead of the model's ``rotary``.
        """
        rotary = self.rotary if table is None else table
        if rotary is None:
            raise RuntimeError("attention uses rotary positions but the model has no rotary table")
        B, T, _, D = qkv.shape
        # [B, T, H, D] -> [B*T, H, D] is a view for a fused QKV output (batch and token strides merge); view(), not
        # reshape(), so a layout that would need a copy fails loudly instead of rotating a temporary.
        if rotary.uses_rows(qkv):
            if table is None:
                if self.rotary_rows is None:
                    self.rotary_rows = rotary.rows(self.positions)
                rows = self.rotary_rows
            else:
                if self.layer_rotary_rows is None:
                    self.layer_rotary_rows = {}
                rows = self.layer_rotary_rows.get(id(table))
                if rows is None:
                    rows = self.layer_rotary_rows[id(table)] = rotary.rows(self.positions)
            rotary.rotate_rows_(qkv[:, :, : num_heads + num_kv_heads].view(B * T, -1, D), rows)
        else:
            q, k = qkv[:, :, :num_heads], qkv[:, :, num_heads : num_heads + num_kv_heads]
            rotary(q.view(B * T, num_heads, D), k.view(B * T, num_kv_heads, D), self.positions)


@dataclass
class PagedStepContext(StepContext):
    """A ragged step over the paged KV cache (continuous batching, ``hf_dsinfer.serving``).

    The step's ``T`` tokens of ``S`` sequences run as one row ``[1, T, C]``; sequence ``s`` owns tokens
    ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]``, the last of its ``seq_lens_k[s]`` keys. ``cache`` is a
    :class:`~.kv_cache.PagedKVCache`; ``block_tables [S, MB]`` int32 its blocks per sequence; ``slot_mapping [T]``
    int64 where each new token's key/value goes. ``positions [T]``: each token's position in its sequence.
    ``start`` and ``cache_lens`` of the static path are unused (empty).
    """

    block_tables: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    seq_lens_k: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    # The torch path's per-step metadata (groups, index tensors), built by the first layer, read by the others.
    paged_plans: dict = field(default_factory=dict)


class FusedAttention(nn.Module):
    """Self-attention with packed ``qkv [(Hq + 2 Hk) * D, C]`` (rows q, then k, then v) and output ``o [C, Hq * D]``.

    Prefill (``T > 1``) writes the new keys/values with ``store_kv`` and runs ``prefill_attention``; a single-token
    step runs ``decode_attention`` (split-KV). The cache tensors are the layer's slice of the static cache.
    Non-causal (encoder) attention uses no cache: ``encoder_attention`` over this step's keys only. With a
    :class:`PagedStepContext` (continuous batching, ``hf_dsinfer.serving``) the step is ragged and the cache paged:
    ``store_paged_kv`` then ``paged_attention`` through the block tables.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        layer_idx: int,
        qkv: Linear,
        o: Linear,
        q_norm: FusedNorm | SplitRMSNorm | None = None,
        k_norm: FusedNorm | SplitRMSNorm | None = None,
    ):
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        want = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        if qkv.out_features != want:
            raise ValueError(
                f"packed qkv has {qkv.out_features} rows, expected (num_heads + 2 * num_kv_heads) * head_dim = {want}"
            )
        if (spec.qk_norm is None) != (q_norm is None) or (q_norm is None) != (k_norm is None):
            raise ValueError("qk_norm in the spec needs both q_norm and k_norm weights (and only then)")
        self.qkv = qkv
        self.o = o
        self.q_norm = q_norm
        self.k_norm = k_norm
        # A table of this layer's own (a policy sets it, e.g. gemma3's local rope base); None: the model's table.
        self.rotary: RotaryTable | None = None
        alibi = None
        if spec.alibi_slopes is not None:  # [Hq] fp32 on the weights' device; derived from the spec, never saved
            alibi = torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=qkv.weight.device)
        self.register_buffer("alibi_slopes", alibi, persistent=False)

    def forward(self, x: torch.Tensor, ctx: StepContext, defer_reduce: bool = False) -> torch.Tensor:
        """``x [B, T, C] -> [B, T, C]``; ``defer_reduce``: see :meth:`Linear.forward` (``o``)."""
        s = self.spec
        B, T, _ = x.shape
        Hq, Hk, D = s.num_heads, s.num_kv_heads, s.head_dim
        qkv = self.qkv(x).view(B, T, Hq + 2 * Hk, D)  # [B, T, Hq + 2Hk, D]
        if self.q_norm is not None and s.qk_norm_full_width:
            q, k = qkv[:, :, :Hq].reshape(B, T, Hq * D), qkv[:, :, Hq : Hq + Hk].reshape(B, T, Hk * D)
            if isinstance(self.q_norm, SplitRMSNorm):  # statistics over all ranks' heads: one all-reduce
                q, k = split_rms_norm_pair(self.q_norm, self.k_norm, q, k)
            else:  # statistics over all heads
                q, k = self.q_norm(q), self.k_norm(k)
            qkv = torch.cat((q.view(B, T, Hq, D), k.view(B, T, Hk, D), qkv[:, :, Hq + Hk :]), dim=2)
        elif self.q_norm is not None:
            q, k = self.q_norm(qkv[:, :, :Hq]), self.k_norm(qkv[:, :, Hq : Hq + Hk])  # new contiguous [B, T, H, D]
            qkv = torch.cat((q, k, qkv[:, :, Hq + Hk :]), dim=2)  # one buffer again, so q and k rotate together
        if s.rotary:
            if self.rotary is not None and self.rotary.cos.device != qkv.device:
                self.rotary.to(qkv.device)  # before any graph capture: the first (prefill) step moves it
            ctx.rotate(qkv, Hq, Hk, self.rotary)
        q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq : Hq + Hk], qkv[:, :, Hq + Hk :]  # views, no copy
        if isinstance(ctx, PagedStepContext):
            out = self._paged(q[0], k[0], v[0], ctx)  # [T, Hq, D]
            return self.o(out.reshape(B, T, Hq * D), defer_reduce)
        if not s.causal:
            if ctx.key_lens is None:
                raise RuntimeError("non-causal attention needs StepContext.key_lens (real tokens per row)")
            if ctx.token_index is None:
                out = encoder_attention(q, k, v, ctx.key_lens, s.scale)  # [B, T, Hq, D]
                return self.o(out.reshape(B, T, Hq * D), defer_reduce)
            # packed tokens [1, N, ...]: to rows for attention (real keys first in each row), then packed again
            q, k, v = unpack_rows(qkv[0], ctx).split((Hq, Hk, Hk), dim=2)  # [B', T', H, D] each, zero padding
            out = encoder_attention(q, k, v, ctx.key_lens, s.scale)  # [B', T', Hq, D]
            out = out.reshape(-1, Hq * D).index_select(0, ctx.token_index)  # [N, Hq * D]
            return self.o(out.view(B, T, Hq * D), defer_reduce)
        k_cache, v_cache = ctx.cache.layer(self.layer_idx)  # [Bmax, Hk, S, D]
        if ctx.attend_len is not None:  # compiled CPU step (decode, or a speculative verification)
            out = _sync_free_attend(q, k, v, k_cache, v_cache, ctx, s, self.alibi_slopes)  # [B, T, Hq, D]
            return self.o(out.reshape(B, T, Hq * D), defer_reduce)
        if ctx.decode and _cpu_decode_applies(q, k_cache, s, self.alibi_slopes):
            if ctx.cpu_decode is None:
                ctx.cpu_decode = {}
            key = (s.sliding_window, k_cache.shape[2])  # layers differ in both (gemma3's, gpt-neo's local layers)
            step = ctx.cpu_decode.get(key)
            if step is None:
                step = ctx.cpu_decode[key] = _CPUDecodeStep.build(ctx, k_cache.shape[2], s.sliding_window)
            if step:  # [B, 1, Hq, D]
                out = _cpu_decode_attend(q, k, v, k_cache, v_cache, step, s.scale)
                return self.o(out.reshape(B, T, Hq * D), defer_reduce)
        store_kv(k, v, k_cache, v_cache, ctx.cache_lens, ctx.start)
        if ctx.decode:
            out = decode_attention(
                q[:, 0], k_cache, v_cache, ctx.seq_lens, s.scale, sliding_window=s.sliding_window, softcap=s.softcap,
                alibi_slopes=self.alibi_slopes,
            )  # [B, Hq, D]
        else:
            out = prefill_attention(
                q,
                k_cache,
                v_cache,
                ctx.cache_lens,
                ctx.start,
                s.scale,
                sliding_window=s.sliding_window,
                softcap=s.softcap,
                alibi_slopes=self.alibi_slopes,
            )  # [B, T, Hq, D]
        return self.o(out.reshape(B, T, Hq * D), defer_reduce)  # [B, T, C]

    def _paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PagedStepContext) -> torch.Tensor:
        """Store this step's ``k``/``v [T, Hk, D]`` in the paged cache and attend ``q [T, Hq, D]``; ``[T, Hq, D]``."""
        from hf_dsinfer.kernels.paged_attention import paged_attention, store_paged_kv

        s = self.spec
        if not s.causal:  # the serving engine refuses such models up front
            raise RuntimeError("paged attention serves causal attention only")
        k_cache, v_cache = ctx.cache.layer(self.layer_idx)  # [NB, BS, Hk, D]
        store_paged_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        return paged_attention(
            q, k_cache, v_cache, ctx.block_tables, ctx.cu_seqlens_q, ctx.seq_lens_k, s.scale,
            softcap=s.softcap, sliding_window=s.sliding_window, plans=ctx.paged_plans, alibi_slopes=self.alibi_slopes,
        )  # fmt: skip

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"layer={self.layer_idx}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}, "
            f"window={s.sliding_window}, softcap={s.softcap}" + ("" if s.causal else ", causal=False")
        )


def _sync_free_attend(
    q: torch.Tensor,  # [B, T, Hq, D] this step's queries
    k: torch.Tensor,  # [B, T, Hk, D] this step's keys
    v: torch.Tensor,  # [B, T, Hk, D]
    k_cache: torch.Tensor,  # [Bmax, Hk, S, D]
    v_cache: torch.Tensor,  # [Bmax, Hk, S, D]
    ctx: StepContext,
    spec: AttentionSpec,
    alibi_slopes: torch.Tensor | None = None,  # [Hq] fp32 (bloom)
) -> torch.Tensor:
    """A step's KV store and causal attention in plain torch ops with no host sync (for ``torch.compile``).

    The same math as the kernels' references: row ``b``'s ``T`` new tokens go to slots ``cache_lens[b] + t`` (the
    caller checked that they fit the cache; rows hold no left padding), and token ``t`` attends slots
    ``[0, cache_lens[b] + t]`` (or the last ``sliding_window`` of them) of the first ``ctx.attend_len`` slots, scores
    in fp32 with the optional softcap, then the optional ALiBi bias ``slope[h] * j`` of slot ``j``. ``T`` is 1 for
    a decode step and ``1 + k`` for a speculative verification. Returns ``[B, T, Hq, D]``.
    """
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    G = Hq // Hk
    L = ctx.attend_len
    rows = torch.arange(B, device=q.device)[:, None]  # [B, 1]
    slot = ctx.cache_lens.long()[:, None] + torch.arange(T, device=q.device)  # [B, T]
    k_cache[rows, :, slot] = k.to(k_cache.dtype)  # [B, T, Hk, D] into k_cache[b, :, slot[b, t]]
    v_cache[rows, :, slot] = v.to(v_cache.dtype)
    keys = k_cache[:B, :, :L].float()  # [B, Hk, L, D] (a view in fp32)
    vals = v_cache[:B, :, :L].float()
    # [B, T, Hk, G, D] -> [B, Hk, T * G, D]: the query heads of each KV head, token by token
    qg = q.float().view(B, T, Hk, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hk, T * G, D)
    # Traced by inductor (the compiled CPU step), the two products are written as reductions: it emits vectorized
    # loops over the keys of each row, where matmul became a batched GEMM of B * Hk tiny products (3 x 64 @ 64 x L at
    # SmolLM2's GRPO shape), bound by MKL's per-product overhead: 30 layers, 32 rows, ~60 keys, 1 thread, load 4.3:
    # 13.9-14.1 ms against 20.7-21.3 ms. Eagerly the broadcast would materialize [B, Hk, T * G, L, D]: matmul there.
    reduce = torch.compiler.is_dynamo_compiling() and q.device.type == "cpu"
    if reduce:
        scores = (qg[:, :, :, None, :] * keys[:, :, None, :, :]).sum(-1) * spec.scale  # [B, Hk, T * G, L]
    else:
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * spec.scale  # [B, Hk, T * G, L]
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.view(B, Hk, T, G, L)
    j = torch.arange(L, device=q.device)
    if alibi_slopes is not None:  # head h = kv head * G + g, as in the kernels' reference
        scores = scores + alibi_slopes.float().view(Hk, 1, G, 1) * j.float()
    lens = slot + 1  # [B, T]: keys token t sees, itself included
    allowed = j < lens[..., None]  # [B, T, L]
    if spec.sliding_window is not None:
        allowed &= j >= lens[..., None] - spec.sliding_window
    scores = scores.masked_fill(~allowed[:, None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(B, Hk, T * G, L)
    if reduce:
        out = (probs[..., None] * vals[:, :, None, :, :]).sum(-2)  # [B, Hk, T * G, D]
    else:
        out = torch.matmul(probs, vals)  # [B, Hk, T * G, D]
    return out.view(B, Hk, T, G, D).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, D).to(q.dtype)


def _cpu_decode_applies(
    q: torch.Tensor, k_cache: torch.Tensor, spec: AttentionSpec, alibi: torch.Tensor | None
) -> bool:
    """Eager decode on CPU in fp32 without softcap or ALiBi, on the torch backend (``HF_DSINFER_BACKEND=triton`` keeps
    the Triton kernels): :func:`_cpu_decode_attend` serves it."""
    return (
        q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
        and q.shape[1] == 1 and spec.softcap is None and alibi is None and not use_triton(q)
    )  # fmt: skip


@dataclass
class _CPUDecodeStep:
    """What every layer's :func:`_cpu_decode_attend` of one eager CPU decode step shares (built once per step)."""

    rows: torch.Tensor  # [B] int64: 0..B-1
    slots: torch.Tensor  # [B] int64: where each row's new key/value goes (its length before the step)
    attend: int  # slots attended: the longest row's length after the step
    bias: torch.Tensor | None  # [B, 1, 1, L] fp32: 0 for a row's keys, -inf past its end (None: every row uses all L)

    @classmethod
    def build(cls, ctx: StepContext, slots_per_row: int, window: int | None) -> _CPUDecodeStep | bool:
        """From ``ctx`` (two host syncs per step, where ``store_kv``'s bounds check and ``decode_attention``'s length
        read took five per layer); False when a row's new token is padding (``start`` > 0: the general path skips it)
        or a slot falls outside the cache (the general path raises, naming the sizes)."""
        lens = ctx.seq_lens.long()  # [B] keys per row after this step, the new one included
        lo, hi, padded = (int(x) for x in torch.stack((lens.min(), lens.max(), ctx.start.max().long())))
        if padded > 0 or lo < 1 or hi > slots_per_row:
            return False
        j = torch.arange(hi, device=lens.device)  # [L]
        bias = None
        if lo < hi or (window is not None and window < hi):
            allowed = j[None, :] < lens[:, None]  # [B, L]
            if window is not None:
                allowed &= j[None, :] >= lens[:, None] - window
            bias = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, float("-inf"))[:, None, None]
        return cls(torch.arange(lens.shape[0], device=lens.device), lens - 1, hi, bias)


def _cpu_decode_attend(
    q: torch.Tensor,  # [B, 1, Hq, D] this step's queries (a view of the fused qkv output)
    k: torch.Tensor,  # [B, 1, Hk, D]
    v: torch.Tensor,  # [B, 1, Hk, D]
    k_cache: torch.Tensor,  # [Bmax, Hk, S, D]
    v_cache: torch.Tensor,  # [Bmax, Hk, S, D]
    step: _CPUDecodeStep,
    scale: float,
) -> torch.Tensor:
    """Store one token per row and attend it over the row's cached keys, as two batched matmuls; ``[B, 1, Hq, D]``.

    The same math as ``decode_attention``'s torch path, with its per-layer overhead taken out: at SmolLM2's GRPO shape
    (32 rows, 9 query / 3 KV heads, 41-89 keys, 1 thread) torch's SDPA with a boolean mask took 0.34-0.71 ms per layer
    against 0.26-0.42 ms for ``matmul`` / ``softmax`` / ``matmul`` over the ``G = Hq / Hk`` query heads of each KV
    head, and the store's bounds check and the attention's length read synced the host five times per layer
    (:class:`_CPUDecodeStep` does it once per step).
    """
    B, _, Hq, D = q.shape
    Hk = k.shape[2]
    L = step.attend
    k_cache[step.rows, :, step.slots] = k[:, 0]  # [B, Hk, D] into k_cache[b, :, slots[b]]
    v_cache[step.rows, :, step.slots] = v[:, 0]
    qg = (q[:, 0] * scale).view(B, Hk, Hq // Hk, D)  # [B, Hk, G, D]: the query heads of each KV head
    scores = torch.matmul(qg, k_cache[:B, :, :L].transpose(-1, -2))  # [B, Hk, G, L]
    if step.bias is not None:
        scores += step.bias
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v_cache[:B, :, :L]).view(B, 1, Hq, D)  # [B, Hk, G, D] -> [B, 1, Hq, D]
