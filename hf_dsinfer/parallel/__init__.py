"""hf_dsinfer.parallel: tensor parallelism (process groups, AutoTP, sharding, per-rank sharded loading, RNG sync).

Entry points used by the integration layer:

* :func:`tp_group_from_config` - the :class:`TPGroup` for an ``InferenceConfig.tensor_parallel`` section;
* :func:`shard_model` - split a built model in place; :func:`load_pretrained_tp` - load each rank's slices only;
* :func:`read_description` / :func:`load_from_description` / :func:`save_mp_checkpoint` - DeepSpeed checkpoint JSON;
* :mod:`.shard` - the slicing rules (heads, grain, fused layouts), shared with the fused layers' TP plans.
"""

from __future__ import annotations

from typing import Any

from .apply import apply_plan, is_sharded, shard_model
from .autotp import TPPlan, build_plan, find_blocks
from .groups import SINGLE, TPGroup, all_reduce_, init_distributed, resolve_tp_group
from .layers import RowParallelLinear
from .loading import load_from_description, load_pretrained_tp, read_description, save_mp_checkpoint
from .rng import broadcast_rng_state, sync_rng_before_generate
from .shard import HeadPartition, Shard, concat_layout, even_shard, grouped_layout, halves_shard, select


def tp_requested(tensor_parallel: Any) -> bool:
    """True when a ``tensor_parallel`` section asks for more than one rank (``tp_size`` > 1, a group or an mpu)."""
    if tensor_parallel is None or not getattr(tensor_parallel, "enabled", True):
        return False
    return tensor_parallel.tp_size > 1 or tensor_parallel.tp_group is not None or tensor_parallel.mpu is not None


def tp_group_from_config(tensor_parallel: Any) -> TPGroup:
    """The :class:`TPGroup` for a ``tensor_parallel`` section (the trivial group when TP is off)."""
    if not tp_requested(tensor_parallel):
        return SINGLE
    return resolve_tp_group(tensor_parallel.tp_size, tensor_parallel.tp_group, tensor_parallel.mpu)


__all__ = [
    "SINGLE",
    "HeadPartition",
    "RowParallelLinear",
    "Shard",
    "TPGroup",
    "TPPlan",
    "all_reduce_",
    "apply_plan",
    "broadcast_rng_state",
    "build_plan",
    "concat_layout",
    "even_shard",
    "find_blocks",
    "grouped_layout",
    "halves_shard",
    "init_distributed",
    "is_sharded",
    "load_from_description",
    "load_pretrained_tp",
    "read_description",
    "resolve_tp_group",
    "save_mp_checkpoint",
    "select",
    "shard_model",
    "sync_rng_before_generate",
    "tp_group_from_config",
    "tp_requested",
]
