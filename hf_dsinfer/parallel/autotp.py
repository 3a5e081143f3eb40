"""AutoTP: a tensor-parallel plan for any transformers model, from its structure (no per-model policy).

For every decoder block (an element of an ``nn.ModuleList``) the output projections are found by a dataflow trace
(:mod:`.trace`) or taken from DeepSpeed's ``injection_policy``
(``{LayerClass: ("self_attn.o_proj", "mlp.down_proj")}``), and each becomes the row-parallel end of a *group*: the
column-parallel linears that feed it.

* Attention groups split by KV-head groups (:class:`~.shard.HeadPartition`); fused qkv weights split per part.
* MLP groups split the intermediate dim by the grain rule (remainder to the last rank); fused ``[gate | up]``
  splits each half.
* The word embedding and the LM head split along the vocab (tied weights get the same slice, so they stay tied).
  Other ``nn.Embedding`` modules holding the same weight (an encoder-decoder's ``shared``, ``encoder.embed_tokens``
  and ``decoder.embed_tokens``: T5, Marian, BART) become vocab-parallel with the same slice.
* Everything else (norms, position embeddings, projections outside blocks) is replicated.

The plan is pure data (:class:`TPPlan`): parameter name -> :class:`~.shard.Shard`, plus module edits. It is built on
a real or a meta model alike, so the sharded loader can shrink shapes before any weight is read.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .head_layouts import codegen_shards, fused_qkv_layout, norm_is_splittable, takes_alibi
from .moe import plan_experts, replicated_linears, traceable_experts
from .shard import (
    DEFAULT_GRAIN,
    HeadPartition,
    Shard,
    concat_layout,
    even_shard,
    halves_shard,
    select,
    split_sizes,
)
from .trace import ATTN, Trace, is_linear, is_norm, linear_dims, norm_width, trace_model

# Module attributes HF attention code reads for head counts / widths, rewritten to the local values.
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_GROUP_ATTRS = ("num_key_value_groups", "num_kv_groups")
_WIDTH_ATTRS = ("all_head_size", "split_size", "q_size")
_CONFIG_KEYS = ("num_attention_heads", "num_key_value_heads", "num_kv_heads")


@dataclass
class TPPlan:
    """How one rank shards a model: ``shards`` (parameter name -> slice kept; absent = replicated) and module edits."""

    tp_size: int
    rank: int
    shards: dict[str, Shard] = field(default_factory=dict)
    row_parallel: list[str] = field(default_factory=list)  # modules wrapped by RowParallelLinear
    column_parallel: list[str] = field(default_factory=list)
    embedding: tuple[str, int, int] | None = None  # (module, vocab start, vocab stop)
    # other nn.Embedding modules tied to the split embedding / head weight (encoder-decoders), same tuple layout
    tied_embeddings: list[tuple[str, int, int]] = field(default_factory=list)
    head: tuple[str, list[int]] | None = None  # (module, every rank's vocab rows)
    attrs: dict[str, dict[str, int]] = field(default_factory=dict)  # module -> {attribute: local value}
    config_overrides: dict[str, dict[str, int]] = field(default_factory=dict)  # module -> local config values
    # attention output projection -> (local q heads, local kv heads): what fused layers need to rebuild their spec
    local_heads: dict[str, tuple[int, int]] = field(default_factory=dict)
    # full-width norms over a head-split projection (OLMo-2's q/k norm) -> (full width, 1 / copies of each element)
    norms: dict[str, tuple[int, float]] = field(default_factory=dict)
    alibi: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # attention -> (first head, stop, all heads)


def find_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module for every element of an ``nn.ModuleList`` that holds linears (the decoder/encoder layers)."""
    blocks = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            for i, child in enumerate(module):
                if any(is_linear(m) for m in child.modules()):
                    blocks[f"{name}.{i}" if name else str(i)] = child
    # Nested lists (a list inside a block): keep the outermost.
    return {n: b for n, b in blocks.items() if not any(n.startswith(o + ".") for o in blocks if o != n)}


def _policy_names(block: nn.Module, injection_policy: dict[str, list[str]] | None) -> list[str] | None:
    """The names ``injection_policy`` gives for ``block``'s class, as written (None: the class is not named)."""
    if not injection_policy:
        return None
    cls = type(block)
    for key in (f"{cls.__module__}.{cls.__qualname__}", cls.__qualname__, cls.__name__):
        if key in injection_policy:
            return injection_policy[key]
    return None


def match_policy_names(block: nn.Module, names: list[str]) -> list[str]:
    """The linears of ``block`` that ``names`` select, by DeepSpeed's rule: a name selects every linear whose path in
    the block is that name or ends with ``"." + name`` (T5's ``"SelfAttention.o"`` is ``layer.0.SelfAttention.o``;
    RoBERTa's ``"output.dense"`` is both ``output.dense`` and ``attention.output.dense``)."""
    linears = [n for n, m in block.named_modules() if n and is_linear(m)]
    return [n for n in linears if any(n == r or n.endswith("." + r) for r in names)]


def _policy_rows(block: nn.Module, injection_policy: dict[str, list[str]] | None) -> list[str] | None:
    names = _policy_names(block, injection_policy)
    return None if names is None else match_policy_names(block, names)


def _check_policy_names(blocks: dict[str, nn.Module], injection_policy: dict[str, list[str]] | None) -> None:
    """Every name of ``injection_policy`` must select a linear in some block of its class (a name may be absent
    from some blocks: T5's encoder blocks have no ``EncDecAttention``)."""
    missing: dict[tuple[str, str], bool] = {}
    for block in blocks.values():
        for r in _policy_names(block, injection_policy) or ():
            key = (type(block).__name__, r)
            missing[key] = missing.get(key, True) and not match_policy_names(block, [r])
    for (cls, r), absent in missing.items():
        if absent:
            raise ValueError(
                f"injection_policy names {r!r}, which is not a linear layer of {cls} (a name selects the linears whose "
                "path in the layer is the name or ends with it); name the layer's output projections."
            )


def _head_counts(config: Any) -> tuple[int, int, int]:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None)
    if kv is None and getattr(config, "new_decoder_architecture", False):
        kv = config.num_kv_heads
    if kv is None:
        kv = 1 if getattr(config, "multi_query", False) else heads
    # T5 spells the head width d_kv, which need not be d_model // num_heads (mT5-small: 512 / 6 heads of 64)
    head_dim = getattr(config, "head_dim", None) or getattr(config, "d_kv", None) or config.hidden_size // heads
    return heads, kv, head_dim


def _groups_by_name(block_name: str, block: nn.Module, rows: list[str]) -> dict[str, tuple[frozenset, bool]]:
    """Without a trace: each output projection is fed by the other linears of its parent module."""
    linears = {n: m for n, m in block.named_modules() if is_linear(m)}
    out = {}
    for r in rows:
        parent = r.rpartition(".")[0]
        feeders = frozenset(f"{block_name}.{n}" for n in linears if n not in rows and n.rpartition(".")[0] == parent)
        attention = any(s in parent.lower() for s in ("attn", "attention"))
        out[f"{block_name}.{r}"] = (feeders, attention)
    return out


def _block_groups(
    block_name: str, block: nn.Module, trace: Trace | None, rows: list[str] | None
) -> dict[str, tuple[frozenset[str], bool]]:
    """row-parallel linear -> (the column-parallel linears feeding it, whether attention sits between)."""
    linears = {f"{block_name}.{n}" for n, m in block.named_modules() if is_linear(m)}
    if rows is not None:
        for r in rows:
            try:
                m = block.get_submodule(r)
            except AttributeError:
                m = None
            if m is None or not is_linear(m):
                raise ValueError(
                    f"injection_policy names {r!r}, which is not a linear layer of {type(block).__name__}."
                )
        if trace is None:
            return _groups_by_name(block_name, block, rows)
        row_set = {f"{block_name}.{r}" for r in rows}
    else:
        row_set = {n for n in linears if trace.linear_inputs.get(n, frozenset()) & linears}
    groups = {}
    for r in sorted(row_set):
        taint = trace.linear_inputs.get(r, frozenset())
        feeders = taint & linears
        if feeders & row_set:
            raise ValueError(
                f"AutoTP: {r} reads the output of {sorted(feeders & row_set)[0]}, another output projection; this "
                "block's pattern cannot be split. Pass injection_policy naming its output projections."
            )
        groups[r] = (frozenset(feeders), ATTN in taint)
    fed = {c for feeders, _ in groups.values() for c in feeders}
    called = set(trace.linear_inputs)
    for c in sorted((linears & called) - row_set - fed - replicated_linears(block_name, block)):
        raise ValueError(
            f"AutoTP: the output of {c} never reaches an output projection (it is consumed elsewhere, e.g. a router); "
            "it cannot be column-split. This architecture is not supported by AutoTP."
        )
    return groups


def _full_width_norms(block_name: str, block: nn.Module, trace: Trace | None, fed: set[str]) -> dict[str, str]:
    """column-parallel linear -> the norm over its whole output (OLMo-2's q/k norm); raises for one it cannot split."""
    out: dict[str, str] = {}
    for norm, taint in trace.norm_inputs.items() if trace is not None else ():
        if not norm.startswith(block_name + "."):
            continue
        module = dict_get(block, norm, block_name)
        for c in sorted(taint & fed):
            if norm_width(module) != linear_dims(dict_get(block, c, block_name))[1]:
                continue  # per-head norm (qk-norm of one head's width): replicated, works on any head split
            per_head = getattr(module, "weight", None) is not None and module.weight.dim() == 2  # cohere: [H, D]
            if not (per_head or norm_is_splittable(module)) or c in out:
                raise ValueError(
                    f"AutoTP: {norm} ({type(module).__name__}) normalizes the full output of {c}; only RMSNorms over "
                    "one head-split projection can be split (their statistics are all-reduced). This architecture is "
                    "not supported by AutoTP."
                )
            out[c] = norm
    return out


def dict_get(block: nn.Module, name: str, block_name: str) -> nn.Module:
    """The submodule ``name`` (a model-level name under ``block_name``) of ``block``."""
    return block.get_submodule(name[len(block_name) + 1 :])


def _out_dim(module: nn.Module) -> int:
    return 1 if type(module).__name__ == "Conv1D" else 0


def _set_linear(plan: TPPlan, name: str, module: nn.Module, shard_out: Shard | None, shard_in: Shard | None) -> None:
    out_dim = _out_dim(module)
    if shard_out is not None:
        plan.shards[f"{name}.weight"] = Shard(out_dim, shard_out.ranges, shard_out.full)
        if getattr(module, "bias", None) is not None:
            plan.shards[f"{name}.bias"] = Shard(0, shard_out.ranges, shard_out.full)
        plan.column_parallel.append(name)
    if shard_in is not None:
        plan.shards[f"{name}.weight"] = Shard(1 - out_dim, shard_in.ranges, shard_in.full)
        plan.row_parallel.append(name)


def _attention_edits(
    plan: TPPlan, model: nn.Module, names: list[str], local_heads: int, local_kv: int, heads: int, kv: int, d: int
) -> None:
    """Rewrite head counts on every module from the group's common ancestor down to its linears."""
    common = names[0].split(".")
    for n in names[1:]:
        parts = n.split(".")
        i = 0
        while i < min(len(common), len(parts)) and common[i] == parts[i]:
            i += 1
        common = common[:i]
    base = ".".join(common)
    paths = {base}
    for n in names:
        pieces = n.split(".")
        for i in range(len(common), len(pieces)):
            paths.add(".".join(pieces[:i]))
    local = {"heads": local_heads, "kv": local_kv}
    for path in sorted(paths):
        module = model.get_submodule(path)
        edits = {}
        for attr in _HEAD_ATTRS:
            if getattr(module, attr, None) == heads:
                edits[attr] = local["heads"]
        for attr in _KV_ATTRS:
            if getattr(module, attr, None) == kv:
                edits[attr] = local["kv"]
        for attr in _GROUP_ATTRS:
            if isinstance(getattr(module, attr, None), int):
                edits[attr] = local["heads"] // local["kv"]
        for attr in _WIDTH_ATTRS:
            if getattr(module, attr, None) == heads * d:
                edits[attr] = local["heads"] * d
        if edits:
            plan.attrs[path] = edits
        if getattr(module, "config", None) is not None and _forward_reads_config_heads(module):
            plan.config_overrides[path] = _head_overrides(local["heads"], local["kv"])


def _head_overrides(heads: int, kv: int) -> dict[str, int]:
    return {"num_attention_heads": heads, "num_key_value_heads": kv, "num_kv_heads": kv}


def _forward_reads_config_heads(module: nn.Module) -> bool:
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return True  # unknown: give it a local config to be safe
    return any(f"config.{key}" in src for key in _CONFIG_KEYS)


def build_plan(
    model: nn.Module,
    tp_size: int,
    rank: int,
    grain: int = DEFAULT_GRAIN,
    injection_policy: dict[str, list[str]] | None = None,
    ep_size: int = 1,
) -> TPPlan:
    """The :class:`TPPlan` of rank ``rank`` out of ``tp_size`` for ``model`` (real or on meta); raises ``ValueError``
    naming the module or the numbers when the model cannot be split that way. ``ep_size`` (MoE models): 1 splits
    every expert's features over the ranks, a divisor of ``tp_size`` makes that many expert groups (each rank: its
    group's experts, split by features inside the group; ``tp_size``: whole experts per rank; ``parallel/moe.py``)."""
    plan = TPPlan(tp_size, rank)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "")
    if getattr(config, "kv_lora_rank", None):
        raise ValueError(
            f"{model_type} uses multi-head latent attention (kv_lora_rank={config.kv_lora_rank}): its compressed kv "
            "projection is shared by all heads, and AutoTP does not split it. Run with tensor_parallel.tp_size=1."
        )
    if getattr(config, "alibi", False):
        raise ValueError(f"{model_type} with alibi positions is not supported by AutoTP (alibi slopes are per head).")
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"AutoTP found no layer stack (nn.ModuleList of layers) in {type(model).__name__}.")
    _check_policy_names(blocks, injection_policy)
    rows_by_block = {n: _policy_rows(b, injection_policy) for n, b in blocks.items()}
    if injection_policy and not any(r is not None for r in rows_by_block.values()):
        raise ValueError(
            f"injection_policy keys {sorted(injection_policy)} match no layer class of {type(model).__name__} "
            f"(its layers are {sorted({type(b).__name__ for b in blocks.values()})})."
        )
    try:
        with traceable_experts(model):  # MoE experts: grouped_mm cannot run on meta in fp32/fp16
            trace = trace_model(model)
    except ValueError:
        if not injection_policy:
            raise
        trace = None  # the policy names the output projections; group by parent module instead
    heads = kv = d = None
    if config is not None and hasattr(config, "num_attention_heads"):
        heads, kv, d = _head_counts(config)
    for block_name, block in blocks.items():
        groups = _block_groups(block_name, block, trace, rows_by_block[block_name])
        norms = _full_width_norms(block_name, block, trace, {c for feeders, _ in groups.values() for c in feeders})
        for row, (feeders, attention) in groups.items():
            row_mod = model.get_submodule(row)
            row_in = linear_dims(row_mod)[0]
            feeders = sorted(feeders)
            if attention:
                if heads is None:
                    raise ValueError(f"AutoTP: {row} follows attention but the config has no num_attention_heads.")
                _plan_attention(plan, model, model_type, config, row, feeders, heads, kv, d, tp_size, rank, norms)
            else:
                if any(c in norms for c in feeders):
                    raise ValueError(
                        f"AutoTP: {norms[next(c for c in feeders if c in norms)]} normalizes the full "
                        f"output of an MLP projection of {row}; this pattern cannot be split."
                    )
                _plan_mlp(plan, model, row, row_in, feeders, tp_size, rank, grain)
    plan_experts(plan, model, tp_size, rank, ep_size)  # MoE experts (parallel/moe.py)
    _plan_vocab(plan, model, tp_size, rank, grain)
    return plan


def _plan_attention(plan, model, model_type, config, row, feeders, heads, kv, d, tp, rank, norms) -> None:
    row_in = linear_dims(model.get_submodule(row))[0]
    if row_in != heads * d:
        raise ValueError(f"AutoTP: {row} reads {row_in} features, expected num_heads*head_dim = {heads}*{d}.")
    if model_type == "codegen":
        _plan_codegen_attention(plan, model, row, feeders, heads, d, tp, rank)
        return
    for c in feeders:
        out = linear_dims(model.get_submodule(c))[1]
        if out not in (heads * d, kv * d) and out % d == 0 and (out // d - heads) % 2 == 0:
            kv = (out // d - heads) // 2  # a fused qkv shows the true kv head count (Falcon's config spells it 3 ways)
    part = HeadPartition.for_rank(heads, kv, tp, rank, where=row.rpartition(".")[0])
    keep = part.keeps()
    for c in feeders:
        module = model.get_submodule(c)
        out = linear_dims(module)[1]
        if out == heads * d:
            layout = concat_layout([("q", heads, d)])
        elif out == kv * d:
            layout = concat_layout([("k", kv, d)])
        elif out == (heads + 2 * kv) * d:
            layout = fused_qkv_layout(model_type, config, c, heads, kv, d)
        else:
            raise ValueError(
                f"AutoTP: {c} has {out} outputs, which is none of q ({heads}*{d}), k/v ({kv}*{d}) or fused qkv."
            )
        _set_linear(plan, c, module, select(layout, keep), None)
        if c in norms:
            weight = model.get_submodule(norms[c]).weight
            if weight.dim() == 2:  # per-head statistics with per-head weights [H, D]: keep this rank's heads' rows
                plan.shards[f"{norms[c]}.weight"] = Shard(0, (keep[layout[0][0]],), weight.shape[0])
                continue
            # a norm over the whole projection: its weight follows the columns, its statistics are all-reduced
            plan.shards[f"{norms[c]}.weight"] = select(layout, keep)
            copies = tp // kv if layout[0][0] == "k" and kv < tp else 1  # replicated kv heads count once
            plan.norms[norms[c]] = (out, 1.0 / copies)
    _set_linear(plan, row, model.get_submodule(row), None, select(concat_layout([("q", heads, d)]), keep, dim=0))
    plan.local_heads[row] = (part.num_heads, part.num_kv_heads)
    _attention_edits(plan, model, feeders + [row], part.num_heads, part.num_kv_heads, heads, kv, d)
    attention = row.rpartition(".")[0]
    if takes_alibi(model.get_submodule(attention)):
        plan.alibi[attention] = (part.q_start, part.q_stop, heads)
    _plan_head_bias_tables(plan, model, attention, part, heads)


def _plan_head_bias_tables(plan: TPPlan, model: nn.Module, attention: str, part: HeadPartition, heads: int) -> None:
    """Per-head bias tables of an attention module (T5's ``relative_attention_bias``, ``nn.Embedding(buckets,
    heads)``, whose output becomes the ``[1, heads, q, k]`` position bias every later layer reuses): keep the
    columns of this rank's q heads, so the bias matches its local scores."""
    for child_name, child in model.get_submodule(attention).named_children():
        if isinstance(child, nn.Embedding) and child.embedding_dim == heads:
            name = f"{attention}.{child_name}"
            plan.shards[f"{name}.weight"] = Shard(1, ((part.q_start, part.q_stop),), heads)
            plan.attrs.setdefault(name, {})["embedding_dim"] = part.num_heads


def _plan_codegen_attention(plan, model, row, feeders, heads, d, tp, rank) -> None:
    if len(feeders) != 1 or linear_dims(model.get_submodule(feeders[0]))[1] != 3 * heads * d:
        raise ValueError(f"AutoTP: CodeGen attention {row} should be fed by one qkv_proj of {3 * heads * d} outputs.")
    qkv, out, local = codegen_shards(heads, d, tp, rank, where=row.rpartition(".")[0])
    _set_linear(plan, feeders[0], model.get_submodule(feeders[0]), qkv, None)
    _set_linear(plan, row, model.get_submodule(row), None, out)
    plan.local_heads[row] = (local, local)
    _attention_edits(plan, model, feeders + [row], local, local, heads, heads, d)
    attention = row.rpartition(".")[0]
    if getattr(model.get_submodule(attention), "embed_dim", None) == heads * d:
        # transformers >= 5.24 cuts qkv_proj's output into chunks of embed_dim // mp_num: the local width here
        plan.attrs.setdefault(attention, {})["embed_dim"] = local * d


def _plan_mlp(plan, model, row, row_in, feeders, tp, rank, grain) -> None:
    for c in feeders:
        module = model.get_submodule(c)
        out = linear_dims(module)[1]
        if out == row_in:
            shard = even_shard(out, tp, rank, grain=grain, what=f"{c} output features")
        elif out == 2 * row_in and "gate_up" in c.rpartition(".")[2]:
            shard = halves_shard(out, tp, rank, grain=grain, what=f"{c} output features")
        else:
            raise ValueError(
                f"AutoTP: {c} has {out} outputs but {row} reads {row_in}; this MLP pattern is not supported."
            )
        _set_linear(plan, c, module, shard, None)
    shard_in = even_shard(row_in, tp, rank, grain=grain, what=f"{row} input features")
    _set_linear(plan, row, model.get_submodule(row), None, shard_in)


def _module_name(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    for name, module in model.named_modules():
        if module is target:
            return name
    return None


def _plan_vocab(plan: TPPlan, model: nn.Module, tp: int, rank: int, grain: int) -> None:
    # The vocab follows the grain rule too (the last rank takes the rows left over): any vocab size works.
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = _module_name(model, get_in() if get_in else None)
    split: dict[str, tuple[int, int]] = {}  # split module -> this rank's vocab range [start, stop)
    if emb is not None and isinstance(model.get_submodule(emb), nn.Embedding):
        vocab = model.get_submodule(emb).weight.shape[0]
        shard = even_shard(vocab, tp, rank, grain=grain, what="vocab_size")
        plan.shards[f"{emb}.weight"] = shard
        plan.embedding = (emb, *shard.ranges[0])
        split[emb] = shard.ranges[0]
    head = _module_name(model, get_out() if get_out else None)
    if head is not None and isinstance(model.get_submodule(head), nn.Linear):
        module = model.get_submodule(head)
        vocab = module.weight.shape[0]
        shard = even_shard(vocab, tp, rank, grain=grain, what="vocab_size")
        plan.shards[f"{head}.weight"] = shard
        if module.bias is not None:
            plan.shards[f"{head}.bias"] = shard
        plan.head = (head, split_sizes(vocab, tp, grain, "vocab_size"))
        split[head] = shard.ranges[0]
    plan.tied_embeddings = _tied_vocab_users(model, split)


def _tied_vocab_users(model: nn.Module, split: dict[str, tuple[int, int]]) -> list[tuple[str, int, int]]:
    """The other modules holding a weight of the vocab-parallel embedding / LM head ``split`` (name -> range).

    Encoder-decoders (T5, Marian, BART) tie separate ``nn.Embedding`` modules (``shared``, the encoder's and the
    decoder's ``embed_tokens``) to the input embedding or the LM head. After the split such a module holds only this
    rank's rows, so it becomes vocab-parallel too, with the same range: returned as ``(module, start, stop)``. Any
    other module holding a split weight would look up every id in its own slice only: refused by name.
    """
    owners = {id(model.get_submodule(n)) for n in split}
    ranges = {id(p): split[n] for n in split for p in model.get_submodule(n).parameters(recurse=False)}
    # A parent of the LM head holding its bias (RoBERTa's lm_head.bias is lm_head.decoder.bias) only reaches the
    # vocab through that child, which is vocab-parallel: not another user.
    parents = {".".join(n.split(".")[:i]) for n in split for i in range(1, n.count(".") + 1)}
    tied, others = [], []
    for name, module in model.named_modules():
        if id(module) in owners or name in parents:
            continue
        held = [(pname, ranges[id(p)]) for pname, p in module.named_parameters(recurse=False) if id(p) in ranges]
        if not held:
            continue
        if isinstance(module, nn.Embedding) and [pname for pname, _ in held] == ["weight"]:
            tied.append((name, *held[0][1]))
        else:
            others += [f"{name}.{pname}" for pname, _ in held]
    if others:
        raise ValueError(
            f"AutoTP: {', '.join(others)} share the vocab-split weight of {' / '.join(split)} but are not "
            "vocab-parallel (only nn.Embedding modules are made so), so each rank would see its own slice only. "
            f"Tensor parallelism cannot split this {type(model).__name__} exactly; run it with "
            "tensor_parallel.tp_size=1."
        )
    return tied


def local_config(config: Any, overrides: dict[str, int]) -> Any:
    """A shallow copy of ``config`` with local head counts (only keys the config already has)."""
    out = copy.copy(config)
    for key, value in overrides.items():
        if key in ("num_attention_heads", "num_key_value_heads") or hasattr(config, key):
            try:
                setattr(out, key, value)
            except AttributeError:
                pass
    return out


def local_head_config(config: Any, heads: int, kv: int) -> Any:
    """A shallow copy of ``config`` with ``heads`` query and ``kv`` key/value heads, spelled every way configs do."""
    return local_config(config, _head_overrides(heads, kv))


__all__ = ["TPPlan", "build_plan", "find_blocks", "is_linear", "is_norm", "local_config", "local_head_config"]
