"""Rank 0's random state on every rank of a tensor-parallel group, so sampling draws the same tokens everywhere.

Each rank samples from identical (all-gathered) logits; with identical generator states they pick identical tokens
and the ranks stay in lockstep. The states are broadcast when a model is sharded and before every ``generate``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .groups import TPGroup, broadcast_

_WRAPPED = "_dsinfer_rng_synced"


def _sync(state: torch.Tensor, tp: TPGroup, device: torch.device) -> torch.Tensor:
    moved = state.to(device)
    broadcast_(moved, tp)
    return moved.cpu()


def broadcast_rng_state(tp: TPGroup) -> None:
    """Copy the CPU (and, when CUDA is in use, the current device's) RNG state of the group's rank 0 to all ranks."""
    if tp.size == 1:
        return
    # NCCL moves only CUDA tensors; gloo moves CPU tensors.
    nccl = dist.get_backend(tp.group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    torch.set_rng_state(_sync(torch.get_rng_state(), tp, device))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(_sync(torch.cuda.get_rng_state(), tp, device))


def sync_rng_before_generate(model: nn.Module, tp: TPGroup) -> None:
    """Wrap ``model.generate`` (on this instance) to broadcast rank 0's RNG state first.

    Idempotent while ``model.generate`` is our wrapper; when something installed another ``generate`` since (the fast
    generation loop is installed after sharding), that one is wrapped too.
    """
    if tp.size == 1 or not hasattr(model, "generate"):
        return
    original = model.generate
    if getattr(model, _WRAPPED, None) is original:
        return

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        broadcast_rng_state(tp)
        return original(*args, **kwargs)

    model.generate = generate
    object.__setattr__(model, _WRAPPED, generate)  # plain attribute, not a submodule
