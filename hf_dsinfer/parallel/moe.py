"""AutoTP for transformers' mixture-of-experts blocks: experts split like dense MLPs, or whole experts per rank.

transformers 5.x holds a layer's experts as two 3-d parameters of one ``*Experts`` module (``gate_up_proj
[E, 2I, C]`` with rows ``[gate; up]`` per expert, ``down_proj [E, C, I]``), computed with ``grouped_mm``; they are
not linears, so the generic AutoTP trace neither sees nor splits them. This module adds them to a
:class:`~.autotp.TPPlan`:

* tensor parallelism (``ep_size`` 1): each rank keeps ``1/tp`` of every expert's intermediate features (``[gate_r;
  up_r]`` rows of ``gate_up_proj``, the same columns of ``down_proj``), so per-rank expert memory is ``1/tp``. The
  experts' output is then a partial sum: HF's own block gets a forward hook that all-reduces it (the fused block
  reduces once, after adding the shared expert's partials);
* expert parallelism (``ep_size`` > 1, a divisor of ``tp_size``): the ranks form ``ep_size`` expert groups of
  ``t = tp_size // ep_size`` consecutive ranks; group ``g`` keeps the whole experts ``[g*E/ep, (g+1)*E/ep)`` and,
  inside the group, each of its ``t`` ranks keeps ``1/t`` of those experts' features, as above (``ep_size ==
  tp_size``: ``t`` is 1, whole experts per rank). Per-rank expert memory is ``1/tp`` either way. The fused MoE block
  computes the tokens routed to its experts and the same single all-reduce over all ranks sums the ranks' outputs:
  summing over a group's ranks completes its experts' features, summing over the groups adds every expert (and
  Qwen's shared expert, split over all ranks like a dense MLP, is completed by the same sum). Hidden states are
  replicated on every rank of a tensor-parallel model, so this all-reduce is the whole exchange (no all-to-all).
  HF's block cannot run on a subset of experts, so expert parallelism needs the fused layers (kernel injection).

The routers (``gate``, Qwen's ``shared_expert_gate``) stay replicated: every rank routes every token identically.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .shard import Shard, even_shard, halves_shard

#: attribute set on an HF ``*Experts`` module split by expert parallelism: its first expert (policies read it)
EXPERT_BEGIN_ATTR = "_dsinfer_expert_begin"
#: attribute set on an HF ``*Experts`` module whose output is a partial sum over the ranks
PARTIAL_ATTR = "_dsinfer_partial_experts"


def is_moe_block(module: nn.Module) -> bool:
    """A transformers sparse MoE block: a ``gate`` router and fused 3-d ``experts`` weights."""
    experts = getattr(module, "experts", None)
    gate_up = getattr(experts, "gate_up_proj", None)
    return getattr(module, "gate", None) is not None and isinstance(gate_up, torch.Tensor) and gate_up.ndim == 3


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module for every sparse MoE block of ``model``."""
    return {name: m for name, m in model.named_modules() if is_moe_block(m)}


def replicated_linears(block_name: str, block: nn.Module) -> set[str]:
    """Linears inside decoder block ``block_name`` that route tokens and stay whole on every rank (Qwen's
    ``shared_expert_gate``): AutoTP must neither split them nor ask that their output reach an output projection."""
    out = set()
    for name, module in block.named_modules():
        if is_moe_block(module):
            gate = getattr(module, "shared_expert_gate", None)
            if isinstance(gate, nn.Linear):
                out.add(f"{block_name}.{name}.shared_expert_gate" if name else f"{block_name}.shared_expert_gate")
    return out


@contextmanager
def traceable_experts(model: nn.Module) -> Iterator[None]:
    """While AutoTP traces ``model`` on the meta device, compute experts with ``batched_mm`` (``grouped_mm``
    refuses fp32/fp16 meta operands); the model's own implementation is restored afterwards."""
    setter = getattr(model, "set_experts_implementation", None)
    if setter is None or not moe_blocks(model):
        yield
        return
    saved = model.get_experts_implementation()
    setter("batched_mm")
    try:
        yield
    finally:
        setter(saved)


def check_ep_size(ep_size: int, tp_size: int, num_experts: int | None = None, what: str = "the model") -> None:
    """Refuse, naming both settings and the fix, an ``ep_size`` that does not divide ``tp_size`` or the experts."""
    if tp_size % ep_size:
        divisors = [d for d in range(1, tp_size + 1) if tp_size % d == 0]
        raise ValueError(
            f"moe.ep_size={ep_size} does not divide tensor_parallel.tp_size={tp_size}: the tensor-parallel ranks form "
            f"ep_size expert groups of tp_size // ep_size ranks each; set ep_size to one of {divisors}."
        )
    if num_experts is not None and num_experts % ep_size:
        raise ValueError(
            f"moe.ep_size={ep_size} does not divide the {num_experts} experts of {what}: each expert group holds "
            f"num_experts // ep_size whole experts; set ep_size to a common divisor of {num_experts} and {tp_size}."
        )


def expert_shards(
    num_experts: int, two_i: int, tp_size: int, rank: int, ep_size: int, what: str = "the MoE block"
) -> tuple[Shard | None, Shard | None]:
    """Rank ``rank``'s pieces of ``gate_up_proj [E, 2I, C]`` and ``down_proj [E, C, I]`` (see the module docstring).

    The ranks form ``ep_size`` groups of ``t = tp_size // ep_size`` consecutive ranks: group ``g`` keeps experts
    ``[g*E/ep, (g+1)*E/ep)`` and, inside the group, each rank keeps ``1/t`` of their features (``[gate_r; up_r]``
    rows, the same ``down`` columns), as ``ep_size`` 1 splits every expert over all ranks.
    """
    check_ep_size(ep_size, tp_size, num_experts, what)
    t = tp_size // ep_size
    group, member = divmod(rank, t)
    gate_up = down = None
    if t > 1:  # features split inside the group (ep_size 1: the group is every rank)
        gate_up = halves_shard(two_i, t, member, dim=1, what=f"{what} features")
        down = even_shard(two_i // 2, t, member, dim=2, what=f"{what} features")
    if ep_size == 1:
        return gate_up, down
    experts = even_shard(num_experts, ep_size, group, dim=0, what=f"{what} experts")
    return (
        Shard(0, experts.ranges, num_experts, inner=gate_up),
        Shard(0, experts.ranges, num_experts, inner=down),
    )


def plan_experts(plan, model: nn.Module, tp_size: int, rank: int, ep_size: int = 1) -> None:
    """Add every MoE block's expert weights to ``plan`` (see the module docstring); ``ep_size`` divides ``tp_size``."""
    if tp_size == 1:
        return
    check_ep_size(ep_size, tp_size)
    for name, block in moe_blocks(model).items():
        experts = block.experts
        e, two_i, _ = experts.gate_up_proj.shape
        what = f"{name}.experts"
        gate_up, down = expert_shards(e, two_i, tp_size, rank, ep_size, what)
        plan.shards[f"{what}.gate_up_proj"] = gate_up
        plan.shards[f"{what}.down_proj"] = down
        if ep_size > 1:
            plan.attrs.setdefault(what, {})[EXPERT_BEGIN_ATTR] = gate_up.ranges[0][0]
            plan.attrs[what]["num_experts"] = e // ep_size
        else:
            plan.attrs.setdefault(what, {})[PARTIAL_ATTR] = 1


def reduce_partial_experts(model: nn.Module, reduce) -> None:
    """Give HF's expert modules split by features an all-reduce of their output (their block then adds the
    replicated shared expert); split by whole experts (``ep_size`` > 1, with or without a feature split inside the
    expert groups), HF's block cannot run and refuses with a clear error."""
    for name, block in moe_blocks(model).items():
        experts = block.experts
        if getattr(experts, EXPERT_BEGIN_ATTR, None) is not None:

            def refuse(module, args, name=name):
                raise RuntimeError(
                    f"{name}.experts holds only this rank's experts (moe.ep_size > 1), which HF's MoE block cannot "
                    "compute; expert parallelism runs on hf_dsinfer's fused layers: keep replace_with_kernel_inject "
                    "on (a policy for this architecture is needed), or set moe.ep_size=1."
                )

            experts.register_forward_pre_hook(refuse)
        elif getattr(experts, PARTIAL_ATTR, 0):
            experts.register_forward_hook(lambda module, args, out: reduce(out))


# Per-expert checkpoint names transformers 5.x converts into the fused experts at load: (gate, up, down).
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def read_fused_experts(index, find, name: str, shard: Shard | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """This rank's piece of a fused ``<block>.experts.gate_up_proj [E, 2I, C]`` or ``down_proj [E, C, I]`` read from a
    checkpoint that stores one tensor per expert (what ``save_pretrained`` writes), reading only the rank's experts
    (expert parallelism: ``shard`` along dim 0) and, within them, its feature rows/columns (tensor parallelism: the
    shard itself, or the expert shard's inner cut when an expert group spans several ranks). None when ``name`` is not
    such a tensor or the checkpoint does not hold it per expert. ``find(name)`` gives the stored key or None;
    ``index.read(key, shard)`` reads a slice.
    """
    base, _, which = name.rpartition(".")
    if not base.endswith(".experts") or which not in ("gate_up_proj", "down_proj"):
        return None
    names = next((n for n in _PER_EXPERT_NAMES if find(f"{base}.0.{n[0]}.weight") is not None), None)
    if names is None:
        return None
    gate_name, up_name, down_name = names
    num_experts = shape[0]
    experts = [e for a, b in shard.ranges for e in range(a, b)] if shard is not None and shard.dim == 0 else None
    # features: the whole shard (tensor parallelism) or its inner cut (expert groups of several ranks)
    feature = shard.inner if experts is not None else shard
    parts = []
    for e in experts if experts is not None else range(num_experts):
        key = find(f"{base}.{e}.{down_name if which == 'down_proj' else gate_name}.weight")
        if key is None:
            raise ValueError(f"the checkpoint has no tensor for expert {e} of {base}")
        if which == "down_proj":  # [C, I] per expert; tensor parallelism keeps columns
            parts.append(index.read(key, Shard(1, feature.ranges, feature.full) if feature else None))
            continue
        inter = shape[1] // 2  # [gate; up] rows: split the kept ranges at the boundary
        ranges = feature.ranges if feature else ((0, 2 * inter),)
        gate = [(a, min(b, inter)) for a, b in ranges if a < inter]
        up = [(max(a, inter) - inter, b - inter) for a, b in ranges if b > inter]
        up_key = find(f"{base}.{e}.{up_name}.weight")
        rows = [index.read(key, Shard(0, tuple(gate), inter))] if gate else []
        rows += [index.read(up_key, Shard(0, tuple(up), inter))] if up else []
        parts.append(torch.cat(rows, dim=0))
    return torch.stack(parts)


def is_per_expert_key(key: str) -> bool:
    """A checkpoint key of one expert's weight (``...experts.3.w1.weight``), which :func:`read_fused_experts` reads
    per slice although transformers merges it at load."""
    head, sep, tail = key.partition(".experts.")
    return bool(sep) and tail.split(".", 1)[0].isdigit()


__all__ = [
    "EXPERT_BEGIN_ATTR",
    "PARTIAL_ATTR",
    "check_ep_size",
    "expert_shards",
    "is_moe_block",
    "is_per_expert_key",
    "moe_blocks",
    "plan_experts",
    "read_fused_experts",
    "reduce_partial_experts",
    "replicated_linears",
    "traceable_experts",
]
