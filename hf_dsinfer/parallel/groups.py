"""Process groups for tensor parallelism, from torch.distributed (torchrun / accelerate launch set the environment).

A :class:`TPGroup` is the group of ranks that share one model replica's weights. It comes from, in order: a user
``tp_group`` (a ``ProcessGroup``), a DeepSpeed/Megatron-style ``mpu`` object, or the default world split into
consecutive blocks of ``tp_size`` ranks (``tp_size`` must divide the world size). The default process group is
initialized here when it is not yet and ``WORLD_SIZE`` is set (NCCL with CUDA, gloo without).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
import torch.distributed as dist


class TPGroup:
    """The tensor-parallel group this process belongs to: ``size`` ranks, this one being ``rank`` (group-local).

    ``group`` is None only for the trivial group of one process (no communication at all). The process group is held
    weakly: torch.distributed owns it until ``destroy_process_group()``, and a model that outlives that call must not
    keep it alive. A gloo group that lives on into interpreter shutdown can abort the process: its worker thread
    releases the last collective's tensors after Python has started finalizing (the GIL is gone, so the thread
    terminates). Dropping the last reference inside ``destroy_process_group()`` joins those threads while Python is
    still whole.
    """

    __slots__ = ("_ref", "size", "rank")

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self._ref = None if group is None else _weak(group)
        self.size = int(size)
        self.rank = int(rank)

    @property
    def group(self) -> Any:
        """The ``ProcessGroup`` (None for the trivial group); raises once it has been destroyed."""
        if self._ref is None:
            return None
        group = self._ref()
        if group is None:
            raise RuntimeError(
                "the process group of this tensor-parallel model was destroyed (torch.distributed."
                "destroy_process_group()); run the model before destroying the group, or load it again after "
                "init_process_group()."
            )
        return group

    @property
    def alive(self) -> bool:
        """False once the process group this refers to has been destroyed."""
        return self._ref is None or self._ref() is not None

    def __repr__(self) -> str:
        return f"TPGroup(size={self.size}, rank={self.rank}, alive={self.alive})"

    @property
    def first_global_rank(self) -> int:
        """The global rank of the group's rank 0 (the source of broadcasts)."""
        if self.group is None:
            return 0
        return dist.get_global_rank(self.group, 0)


def _weak(group: Any) -> Any:
    try:
        return weakref.ref(group)
    except TypeError:  # an object that takes no weak reference (a stand-in from an mpu): held, called like a ref
        return lambda: group


SINGLE = TPGroup(None, 1, 0)

# tp_size -> this process's group, so repeated calls (several models in one process) reuse the groups they made.
_DEFAULT_GROUPS: dict[int, TPGroup] = {}


def init_distributed(timeout: Any = None) -> bool:
    """Initialize the default process group when a launcher set ``WORLD_SIZE`` and nobody has yet.

    Returns True when torch.distributed is initialized afterwards. With CUDA the backend is NCCL and this rank's
    device is ``LOCAL_RANK``; without CUDA it is gloo. ``timeout`` (a ``datetime.timedelta``): how long a collective
    may wait (torch's default when None; a server's idle workers wait longer, see ``serving.tp_launch``).
    """
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return True
    if "WORLD_SIZE" not in os.environ:
        return False
    # torch.distributed.nn binds `group.WORLD` into its functions' default arguments when first imported. Imported
    # after init_process_group (transformers' model loading imports it), it would keep the default group alive past
    # destroy_process_group(), into interpreter shutdown (see TPGroup); imported now it binds None.
    import torch.distributed.nn  # noqa: F401
    extra = {} if timeout is None else {"timeout": timeout}
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", **extra)
    else:
        dist.init_process_group("gloo", **extra)
    return True


def _from_mpu(mpu: Any) -> TPGroup:
    getter = getattr(mpu, "get_tensor_model_parallel_group", None) or getattr(mpu, "get_model_parallel_group", None)
    if getter is None:
        raise ValueError(
            "tensor_parallel.mpu must provide get_tensor_model_parallel_group() (or get_model_parallel_group()), "
            f"got {type(mpu).__name__}."
        )
    group = getter()
    size_fn = getattr(mpu, "get_tensor_model_parallel_world_size", None) or getattr(
        mpu, "get_model_parallel_world_size", None
    )
    rank_fn = getattr(mpu, "get_tensor_model_parallel_rank", None) or getattr(mpu, "get_model_parallel_rank", None)
    size = size_fn() if size_fn is not None else dist.get_world_size(group)
    rank = rank_fn() if rank_fn is not None else dist.get_rank(group)
    return TPGroup(group if size > 1 else None, int(size), int(rank))


def resolve_tp_group(tp_size: int, tp_group: Any = None, mpu: Any = None) -> TPGroup:
    """The :class:`TPGroup` for a ``tensor_parallel`` config (``tp_size``, optional ``tp_group`` / ``mpu``).

    ``tp_size`` 1 with neither a group nor an mpu is the trivial group. A given group or mpu wins over the default
    split; when ``tp_size`` > 1 is also given it must equal the group's size.
    """
    if tp_group is not None or mpu is not None:
        if tp_group is not None and mpu is not None:
            raise ValueError("tensor_parallel got both tp_group and mpu; pass only one.")
        if tp_group is not None:
            size = dist.get_world_size(tp_group)
            found = TPGroup(tp_group if size > 1 else None, size, dist.get_rank(tp_group))
        else:
            found = _from_mpu(mpu)
        if tp_size > 1 and tp_size != found.size:
            raise ValueError(
                f"tensor_parallel.tp_size={tp_size} but the given {'tp_group' if tp_group is not None else 'mpu'} "
                f"has {found.size} ranks; drop tp_size or make them agree."
            )
        return found
    if tp_size == 1:
        return SINGLE
    if not init_distributed():
        raise ValueError(
            f"tensor_parallel.tp_size={tp_size} needs torch.distributed: start one process per rank, e.g. "
            f"`torchrun --nproc_per_node {tp_size} your_script.py` (or accelerate launch)."
        )
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(
            f"tensor_parallel.tp_size={tp_size} does not divide the world size {world}; use a tp_size that divides "
            f"{world} (the number of launched processes)."
        )
    cached = _DEFAULT_GROUPS.get(tp_size)
    if cached is not None and cached.alive:  # not after destroy_process_group() + init_process_group()
        return cached
    rank = dist.get_rank()
    if world == tp_size:
        found = TPGroup(dist.group.WORLD, tp_size, rank)
    else:
        # Every rank must create every group, in the same order (new_group is collective).
        found = SINGLE
        for start in range(0, world, tp_size):
            ranks = list(range(start, start + tp_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                found = TPGroup(group, tp_size, rank - start)
    _DEFAULT_GROUPS[tp_size] = found
    return found


# -- collectives (no-ops on the trivial group) -------------------------------------------------------------------------


def all_reduce_(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum ``tensor`` over the group, in place; returns it."""
    if tp.size > 1:
        dist.all_reduce(tensor, group=tp.group)
    return tensor


def all_gather_last(tensor: torch.Tensor, tp: TPGroup, sizes: list[int]) -> torch.Tensor:
    """Concatenate each rank's ``tensor [..., sizes[r]]`` along the last dim, in rank order: ``[..., sum(sizes)]``.

    Uneven pieces are padded to the largest size for the exchange (collectives need equal shapes) and trimmed after.
    """
    if tp.size == 1:
        return tensor
    width = max(sizes)
    local = tensor
    if local.shape[-1] != width:
        local = torch.nn.functional.pad(local, (0, width - local.shape[-1]))
    pieces = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(pieces, local.contiguous(), group=tp.group)
    return torch.cat([p[..., :n] for p, n in zip(pieces, sizes)], dim=-1)


def broadcast_(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with the group's rank 0 copy, in place; returns it."""
    if tp.size > 1:
        dist.broadcast(tensor, src=tp.first_global_rank, group=tp.group)
    return tensor


def barrier(tp: TPGroup) -> None:
    """Wait until every rank of the group gets here."""
    if tp.size > 1:
        dist.barrier(group=tp.group)
