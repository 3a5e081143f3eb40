"""Attention layouts AutoTP cannot read from shapes alone: per-architecture fused qkv orders, CodeGen's ``mp_num``
chunks, full-width q/k norms (OLMo-2/3) and alibi biases (BLOOM).

* **Fused qkv rows** (:func:`fused_qkv_layout`): ``[q | k | v]`` (phi3, gpt2), per-head ``[q k v]`` (gpt_neox,
  bloom, falcon-7b), per-kv-group ``[q.. k v]`` (falcon's new decoder architecture).
* **CodeGen** (:func:`codegen_shards`): ``qkv_proj`` holds 4 chunks (``mp_num``, hard-coded in its forward), each
  ``[q | v | k]`` over ``num_heads / 4`` heads. Its forward reshapes *any* local width into 4 chunks, so every rank
  keeps an equal share of every chunk (the chunk's heads dealt over the ranks), not a contiguous run of heads.
* **Full-width q/k norms** (:func:`norm_is_splittable`): OLMo-2 RMS-normalizes the whole q (and k) projection, not each
  head. Split by heads, each rank holds part of that width; :class:`~.layers.FullWidthRMSNorm` sums the squares over
  the ranks (one all-reduce) before scaling, so the statistics are those of the full width.
* **Alibi** (:func:`takes_alibi`): BLOOM builds one bias per head for all heads, ``[batch * heads, 1, keys]``; each
  rank's attention keeps the rows of its own heads (:func:`~.layers.slice_alibi_per_rank`).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .shard import Segment, Shard, _deal, concat_layout, grouped_layout

CODEGEN_MP_NUM = 4  # CodeGenAttention.forward splits qkv into this many chunks whatever the width


def fused_qkv_layout(model_type: str, config: Any, name: str, heads: int, kv: int, d: int) -> list[Segment]:
    """Segments of a fused qkv output dim, by architecture (its layout is not visible in the shapes)."""
    split = concat_layout([("q", heads, d), ("k", kv, d), ("v", kv, d)])
    if model_type in ("phi3", "gpt2", "gpt_bigcode"):
        return split
    if model_type in ("gpt_neox", "bloom"):
        return grouped_layout(heads, [("q", 1, d), ("k", 1, d), ("v", 1, d)])
    if model_type == "falcon":
        if getattr(config, "new_decoder_architecture", False):
            return grouped_layout(kv, [("q", heads // kv, d), ("k", 1, d), ("v", 1, d)])
        if getattr(config, "multi_query", False):
            return split
        return grouped_layout(heads, [("q", 1, d), ("k", 1, d), ("v", 1, d)])
    raise ValueError(
        f"AutoTP does not know the row layout of the fused qkv projection {name} ({model_type}); supported: phi3, "
        "gpt2, gpt_bigcode, gpt_neox, bloom, falcon, codegen. Use a model with separate q/k/v projections or a "
        "kernel-injection policy."
    )


def codegen_shards(heads: int, d: int, tp: int, rank: int, where: str) -> tuple[Shard, Shard, int]:
    """(qkv_proj rows, out_proj input columns, local heads) of rank ``rank`` for CodeGen's chunked qkv layout.

    Global head ``h`` lives in chunk ``h // (heads / 4)``; a rank keeps the same run of heads inside every chunk, so
    its local ``qkv_proj`` is again 4 chunks of ``[q | v | k]`` and its heads stay in CodeGen's (chunk-major) order.
    """
    if heads % CODEGEN_MP_NUM:
        raise ValueError(f"CodeGen needs num_attention_heads ({heads}) divisible by {CODEGEN_MP_NUM} in {where}.")
    per_chunk = heads // CODEGEN_MP_NUM
    if per_chunk < tp:
        raise ValueError(
            f"tensor_parallel.tp_size={tp} is more than CodeGen's {per_chunk} heads per qkv chunk in {where} (every "
            f"rank needs a head of each of its {CODEGEN_MP_NUM} chunks); use tp_size <= {per_chunk}."
        )
    lo, hi = _deal(per_chunk, tp, rank)
    chunk = 3 * per_chunk * d  # [q | v | k] of one chunk
    qkv, out = [], []
    for c in range(CODEGEN_MP_NUM):
        for part in range(3):  # q, v, k: the same heads of each
            start = c * chunk + part * per_chunk * d
            qkv.append((start + lo * d, start + hi * d))
        out.append(((c * per_chunk + lo) * d, (c * per_chunk + hi) * d))
    return Shard(0, tuple(qkv), 3 * heads * d), Shard(0, tuple(out), heads * d), CODEGEN_MP_NUM * (hi - lo)


def norm_is_splittable(norm: nn.Module) -> bool:
    """True for an RMSNorm :class:`~.layers.FullWidthRMSNorm` can stand in for: a weight, an epsilon and no bias."""
    return (
        type(norm).__name__.endswith("RMSNorm")
        and getattr(norm, "bias", None) is None
        and isinstance(getattr(norm, "weight", None), nn.Parameter)
        and norm_eps(norm) is not None
    )


def norm_eps(norm: nn.Module) -> float | None:
    """The epsilon of an HF norm module, whichever attribute name it uses."""
    for attr in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, attr, None)
        if isinstance(value, float):
            return value
    return None


def takes_alibi(module: nn.Module) -> bool:
    """True when ``module``'s forward receives an ``alibi`` bias (BLOOM's attention)."""
    try:
        return "alibi" in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
