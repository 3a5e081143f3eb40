"""The GPU a launch compiles for, and the attention tile tables chosen from it.

Triton compiles each kernel for the current device, so the launchers look at the same device to pick tile sizes:
``target_of(tensor)`` gives its compute capability and SM count (cached per device, no sync, graph-safe). Tensors
off CUDA (the meta tensors of the ahead-of-time compile tests) have no device to ask; ``assume_target`` names one
for them, so those tests capture exactly the launches a given GPU would make. With neither, launchers take the
portable tables, which compile without register spills for every target (and fit the 99 KB of shared memory per
block of sm_86/sm_89 consumer GPUs).

Tile tables (``BLOCK_M, BLOCK_N, num_warps, num_stages``) come from ptxas reports of every config for sm_90 and
sm_80 (``tests/kernels/test_aot_compile.py`` keeps them honest; figures in docs/kernels.md):

* Hopper (sm_90) has wgmma: a warpgroup's accumulator rows sit in registers spread over 128 threads, so 128-row
  query tiles with 8 warps fit and keep the tensor cores busy.
* Everything else (sm_80, sm_86, sm_89, and unknown targets) runs mma.sync. There the 255-register cap per thread
  binds first (the register file per SM is the same 64K), so tiles are sized to stay under it with no spill, and
  the shared-memory footprint stays under 99 KB so consumer GPUs can launch them.
* fp32 attention computes its dots on FMA units (``input_precision="ieee"``: never silently tf32) and holds twice
  the bytes per element, so its tiles are smaller still.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import torch

__all__ = ["Target", "assume_target", "assumed_target", "attention_tiles", "decode_tiles", "target_of"]


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target: ``capability`` as major * 10 + minor (90 for H100), ``sm_count`` its multiprocessors."""

    capability: int
    sm_count: int


_ASSUMED: list[Target] = []


@contextlib.contextmanager
def assume_target(capability: int, sm_count: int) -> Iterator[Target]:
    """Within the block, launches on tensors off CUDA pick configurations as if for this GPU (used by the AOT tests)."""
    target = Target(int(capability), int(sm_count))
    _ASSUMED.append(target)
    try:
        yield target
    finally:
        _ASSUMED.remove(target)


@functools.lru_cache(maxsize=16)
def _cuda_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    return Target(10 * props.major + props.minor, props.multi_processor_count)


def assumed_target() -> Target | None:
    """The target named by the innermost :func:`assume_target` block, if any."""
    return _ASSUMED[-1] if _ASSUMED else None


def target_of(tensor: torch.Tensor) -> Target | None:
    """The GPU ``tensor``'s kernels compile for; the assumed one off CUDA (see :func:`assume_target`), else None."""
    if tensor.is_cuda:
        index = tensor.device.index
        return _cuda_target(index if index is not None else torch.cuda.current_device())
    return assumed_target()


def _is_hopper(target: Target | None) -> bool:
    # Only sm_90 has been checked with the large tiles; later archs (tcgen05, or 99 KB consumer parts) take the
    # portable table until someone measures them.
    return target is not None and target.capability == 90


def attention_tiles(block_d: int, dtype: torch.dtype, target: Target | None) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for the flash-attention kernels (prefill and encoder).

    ``block_d`` is the head dim rounded up to a power of two (>= 16).
    """
    if dtype == torch.float32:
        # FMA dots hold whole K slices of both operands in registers: 32-row tiles, 8 warps and one stage from
        # D=128 on (two stages spill in the encoder on sm_80), 16 rows beyond (32 spill thousands of bytes on sm_90).
        if block_d <= 64:
            return 32, 32, 4, 2
        if block_d <= 128:
            return 32, 32, 8, 1
        return 16, 32, 8, 1
    if block_d > 256:
        return 32, 32, 8, 1  # D=512: a [64, 512] fp32 accumulator would not fit at any warp count without spills
    if _is_hopper(target):
        # 8 warps = two warpgroups of 64 query rows each, the wgmma M: 127-206 registers, no spill.
        if block_d <= 64:
            return 128, 64, 8, 3
        if block_d <= 128:
            return 128, 64, 8, 2
        return 64, 32, 8, 2
    # mma.sync (sm_80/86/89): 4 warps at BLOCK_M=128 hit the 255-register cap (and spill, D=64 encoder); 8 warps
    # and, at D=128, BLOCK_N=32 stay near 170-210 registers and under 99 KB of shared memory.
    if block_d <= 64:
        return 128, 64, 8, 3
    if block_d <= 128:
        return 128, 32, 8, 2
    return 64, 32, 8, 2


def decode_tiles(block_d: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` for split-KV decode, whose query tile is one KV group (16 rows).

    The tile is small and the kernel bound by reading the cache, so one table serves every GPU.
    """
    if dtype == torch.float32:
        return (16, 4, 2) if block_d <= 256 else (16, 8, 1)  # FMA dots: BLOCK_N=32 spills at D=128 on sm_90
    if block_d <= 256:
        return (64, 4, 2) if block_d <= 128 else (32, 4, 2)
    return 32, 8, 2  # D=512: 4 warps spill a few bytes on sm_90
