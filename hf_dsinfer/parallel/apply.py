"""Carry out a :class:`~.autotp.TPPlan` on a model: shrink parameters, wrap output projections, fix head counts.

Parameters come either from the full ones already in the model (:func:`shard_model`, in place) or from a loader
callback (the sharded loader reads each rank's slice from the checkpoint). Parameters shared by several modules (tied
embeddings) are handled once and re-bound everywhere, so ties survive.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from .. import hf_compat
from ..modules.quant_linear import QuantLinear
from .autotp import TPPlan, build_plan, local_config
from .groups import TPGroup, all_reduce_
from .head_layouts import norm_eps
from .layers import (
    TP_ATTR,
    FullWidthRMSNorm,
    RowParallelLinear,
    make_vocab_parallel_embedding,
    make_vocab_parallel_head,
    slice_alibi_per_rank,
)
from .moe import reduce_partial_experts
from .rng import broadcast_rng_state, sync_rng_before_generate
from .shard import DEFAULT_GRAIN, Shard

PLAN_ATTR = "_dsinfer_tp_plan"
GROUP_ATTR = "_dsinfer_tp_group"

# (every name of one parameter, its shard or None, the current tensor) -> this rank's tensor
Loader = Callable[[list[str], "Shard | None", torch.Tensor], torch.Tensor]
# the (module, attribute) places of a parameter just loaded
OnLoaded = Callable[[list[tuple[nn.Module, str]]], None]


def parameter_groups(model: nn.Module) -> list[tuple[list[str], list[tuple[nn.Module, str]], nn.Parameter]]:
    """Every distinct parameter with all its names and (module, attribute) places, in registration order."""
    seen: dict[int, tuple[list[str], list[tuple[nn.Module, str]], nn.Parameter]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is None:
                continue
            entry = seen.setdefault(id(p), ([], [], p))
            full = f"{mod_name}.{pname}" if mod_name else pname
            if full not in entry[0]:
                entry[0].append(full)
                entry[1].append((module, pname))
    return list(seen.values())


def _shard_of(plan: TPPlan, names: list[str]) -> Shard | None:
    found = {plan.shards[n] for n in names if n in plan.shards}
    if len(found) > 1:
        raise ValueError(f"tied parameters {names} would be split in different ways; untie them or disable TP.")
    return found.pop() if found else None


def apply_plan(
    model: nn.Module, plan: TPPlan, tp: TPGroup, load: Loader | None = None, on_loaded: OnLoaded | None = None
) -> nn.Module:
    """Apply ``plan`` to ``model`` in place: parameters, row-parallel wrappers, vocab hooks, head counts.

    ``on_loaded(places)``: called right after each parameter is in place (the weight-only quantizer quantizes a
    linear's slice there, so no float copy of the model accumulates); it may replace the owning modules.
    """
    for names, places, param in parameter_groups(model):
        shard = _shard_of(plan, names)
        if load is not None:
            new = load(names, shard, param)
        elif shard is not None:
            new = shard.take(param.detach())
        else:
            continue
        new_param = nn.Parameter(new, requires_grad=False)
        hf_compat.mark_initialized(new_param)  # transformers' init skips it (the loader path calls initialize_weights)
        for module, pname in places:
            module._parameters[pname] = new_param
        if on_loaded is not None:
            on_loaded(places)
    for name in plan.column_parallel:
        module = model.get_submodule(name)
        if hasattr(module, "out_features"):
            module.out_features = module.weight.shape[0]
        if hasattr(module, "nf"):  # Conv1D
            module.nf = module.weight.shape[1]
        setattr(module, TP_ATTR, {"kind": "column"})
    for name in plan.row_parallel:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, child)
        if isinstance(module, QuantLinear):  # weight-only quantized: the same module, reducing over the group
            module.reduce = functools.partial(_reduce_over, tp)
            continue
        setattr(parent, child, RowParallelLinear.wrap(module, tp))
    for name, (full_width, share) in plan.norms.items():
        parent_name, _, child = name.rpartition(".")
        parent, norm = model.get_submodule(parent_name), model.get_submodule(name)
        setattr(parent, child, FullWidthRMSNorm(norm.weight, norm_eps(norm), full_width, tp, share))
    for name, (start, stop, heads) in plan.alibi.items():
        slice_alibi_per_rank(model.get_submodule(name), start, stop, heads)
    for name, edits in plan.attrs.items():
        module = model.get_submodule(name)
        for attr, value in edits.items():
            setattr(module, attr, value)
    reduce_partial_experts(model, lambda t: all_reduce_(t, tp))  # MoE experts split by features or by expert
    for name, overrides in plan.config_overrides.items():
        module = model.get_submodule(name)
        module.config = local_config(module.config, overrides)
    if plan.embedding is not None:
        name, start, stop = plan.embedding
        make_vocab_parallel_embedding(model.get_submodule(name), start, stop, tp)
    for name, start, stop in plan.tied_embeddings:  # encoder-decoders' shared / embed_tokens tied to the split vocab
        make_vocab_parallel_embedding(model.get_submodule(name), start, stop, tp)
    if plan.head is not None:
        name, sizes = plan.head
        make_vocab_parallel_head(model.get_submodule(name), sizes, tp)
    setattr(model, PLAN_ATTR, plan)
    setattr(model, GROUP_ATTR, tp)
    return model


def is_sharded(model: nn.Module) -> bool:
    """True when tensor parallelism was already applied to ``model``."""
    return getattr(model, PLAN_ATTR, None) is not None


def finish(model: nn.Module, tp: TPGroup) -> None:
    """After sharding: agree on rank 0's RNG state now and before every ``generate``; refuse ``save_pretrained``."""
    if tp.size == 1:
        return
    broadcast_rng_state(tp)
    sync_rng_before_generate(model, tp)
    if hasattr(model, "save_pretrained"):

        def save_pretrained(*args, **kwargs):
            raise RuntimeError(
                "save_pretrained on a tensor-parallel model would write only this rank's slices; save from a tp_size=1 "
                "model, or set save_mp_checkpoint_path in the inference config to write per-rank shards."
            )

        model.save_pretrained = save_pretrained


def shard_model(
    model: nn.Module,
    tp: TPGroup,
    grain: int = DEFAULT_GRAIN,
    injection_policy: dict[str, list[str]] | None = None,
    ep_size: int = 1,
) -> nn.Module:
    """Split a built model (full weights on every rank) over ``tp`` in place (no-op when ``tp.size`` is 1);
    ``ep_size``: see :func:`~.autotp.build_plan` (MoE experts)."""
    if tp.size == 1 or is_sharded(model):
        return model
    plan = build_plan(model, tp.size, tp.rank, grain=grain, injection_policy=injection_policy, ep_size=ep_size)
    apply_plan(model, plan, tp)
    finish(model, tp)
    return model


def _reduce_over(tp: TPGroup, t: torch.Tensor) -> torch.Tensor:
    """``all_reduce_(t, tp)`` with the group bound first (a weight-only quantized row-parallel linear's reduce)."""
    return all_reduce_(t, tp)
