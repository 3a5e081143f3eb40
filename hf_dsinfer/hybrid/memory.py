"""What the Hybrid Engine holds beyond the training model, the CPU re-pack at the switch, and sleep / wake.

``memory()`` counts every byte the engine adds: the inference copy's own weights (storage shared with the training
model, see :mod:`.shared_base`, is not counted twice), the static KV cache, the oneDNN-packed CPU copies of its
linear weights (``modules/cpu_packed.py``: as large as the weights they pack, built at batch 4-32 in fp32 on CPU) and
the CUDA-graph memory pool of the decode graphs. ``sleep()`` frees the inference copy's own weights, the KV cache,
the packed copies and the graphs between generation phases (full fine-tuning: the copy is as large as the model);
``wake()`` (or the next ``eval()``) allocates them again and refreshes them from the training weights.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from ..generation.api import GEN_ATTR
from ..modules import cpu_packed
from ..policies import get_injection


def _training_storages(engine: Any) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in engine.weights.hf_model.parameters()}


def own_tensors(engine: Any) -> list[torch.Tensor]:
    """The inference copy's parameters and buffers whose storage is its own (not the training model's), once each."""
    training = _training_storages(engine)
    seen: dict[int, torch.Tensor] = {}
    for t in (*engine.module.parameters(), *engine.module.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in training and ptr not in seen:
            seen[ptr] = t
    return list(seen.values())


def graph_pool_bytes(module: nn.Module) -> int:
    """Bytes the captured decode graphs hold for their intermediates (0 without CUDA graphs)."""
    graphs = getattr(getattr(module, GEN_ATTR, None), "graphs", None)
    runner = getattr(graphs, "runner", None)
    return int(getattr(getattr(runner, "stats", None), "graph_bytes", 0) or 0)


def engine_memory(engine: Any) -> dict[str, int]:
    """``{"weights", "kv_cache", "cpu_packed", "cuda_graphs", "shared_with_training"}`` in bytes (see module doc)."""
    if engine.module is None:
        return {"weights": 0, "kv_cache": 0, "cpu_packed": 0, "cuda_graphs": 0, "shared_with_training": 0}
    own = sum(t.untyped_storage().nbytes() for t in own_tensors(engine))
    record = get_injection(engine.module)
    cache = record.runtime.cache if record is not None else None
    kv = sum(t.untyped_storage().nbytes() for t in (*cache.keys, *cache.values)) if cache is not None else 0
    shared = engine._shared.bytes_shared if engine._shared is not None else 0
    return {"weights": own, "kv_cache": kv, "cpu_packed": cpu_packed.packed_bytes(engine.module),
            "cuda_graphs": graph_pool_bytes(engine.module), "shared_with_training": shared}  # fmt: skip


def repack(module: nn.Module, unchanged: set[int], workers: int = 1) -> int:
    """After a refresh: re-pack now (so the switch pays for it, not the next generate) the CPU packed copies of the
    linears whose weight may have changed; ``unchanged`` (ids: the shared frozen base) was not, its packs stay.
    ``workers`` > 1 splits them over that many threads (:func:`switch_workers`). Returns how many."""
    todo = []
    for m in module.modules():
        weight = getattr(m, "weight", None)
        slot = m.__dict__.get(cpu_packed.SLOT_ATTR)
        if slot is not None and isinstance(weight, torch.Tensor) and id(weight) not in unchanged:
            todo.append(m)
    # Modules without a slot were never packed; the remaining (non-linear) ones hold nothing to re-pack.
    groups = _split(todo, workers)
    if len(groups) == 1:
        return _repack_group(groups[0])
    # Each group always goes to the same thread (one single-thread pool per extra worker, the first on the caller's):
    # glibc gives each thread its own malloc arena, so a pack freed and re-made on one thread reuses its pages.
    pools = _pools(len(groups) - 1, torch.get_num_threads())
    futures = [pool.submit(_repack_group, group) for pool, group in zip(pools, groups[1:])]
    count = _repack_group(groups[0])
    return count + sum(f.result() for f in futures)  # a worker's exception is raised here


def _repack_group(modules: list[nn.Module]) -> int:
    count = 0
    for m in modules:
        if cpu_packed.repack(m, only_packed=True):  # weights packed before (in use at this batch), in place
            count += 1
        else:  # packing off now: a pack left behind would be stale if it came back on (.data writes bump nothing)
            cpu_packed.invalidate(m)
    return count


def _split(modules: list[nn.Module], workers: int) -> list[list[nn.Module]]:
    """``modules`` in ``workers`` groups of about equal weight bytes (largest first onto the lightest group): the
    same modules give the same groups at every switch."""
    if workers <= 1 or len(modules) <= 1:
        return [modules]
    groups: list[list[nn.Module]] = [[] for _ in range(min(workers, len(modules)))]
    load = [0] * len(groups)
    for m in sorted(modules, key=lambda m: -m.weight.numel()):  # sorted() is stable: ties keep module order
        i = load.index(min(load))
        groups[i].append(m)
        load[i] += m.weight.numel()
    return groups


_POOLS: list[ThreadPoolExecutor] = []


def _pools(n: int, threads: int) -> list[ThreadPoolExecutor]:
    """``n`` single-thread pools (process-wide, made once); each worker runs torch at ``threads`` intra-op threads
    (the caller's count: OpenMP's thread count is per thread, a new thread would start at the machine's)."""
    while len(_POOLS) < n:
        _POOLS.append(ThreadPoolExecutor(1, "hf_dsinfer_repack", initializer=torch.set_num_threads,
                                         initargs=(threads,)))  # fmt: skip
    return _POOLS[:n]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


#: Most re-pack threads by default (``switch_threads=None``); measured at 2, on a 2-core machine.
MAX_DEFAULT_WORKERS = 4


def switch_workers(device: torch.device, threads: int | None) -> int:
    """How many threads re-pack at the switch: ``threads`` (None: the usable CPUs, at most
    :data:`MAX_DEFAULT_WORKERS`) over the caller's intra-op count, each worker at that count; 1 for a non-CPU copy
    or a caller already at ``threads`` or more.

    The switch is a phase of its own (no generate or training step runs meanwhile), and oneDNN's reorders of
    different weights are independent, so whole weights go to separate Python threads (the op releases the GIL).
    Not OpenMP threads inside each reorder: at 2 intra-op threads the re-pack took 98-104 ms wall on an idle machine
    (167-202 at 1) but 1016-1043 ms of CPU at load ~3.8 (182-220 at 1), its threads spinning at every barrier while a
    peer waited for a core; separate weights on separate threads have no barrier to wait at.
    """
    if device.type != "cpu":
        return 1
    want = threads if threads is not None else min(usable_cpus(), MAX_DEFAULT_WORKERS)
    return max(1, want // max(torch.get_num_threads(), 1))


def sleep(engine: Any) -> int:
    """Free the inference copy's own weights, KV cache, packed CPU copies and decode graphs; returns bytes freed.

    Storage shared with the training model stays (it is the training model's). Tensors keep their objects, so the
    fused layers and the compiled step need nothing rebuilt; ``wake`` gives them storage again.
    """
    before = sum(engine_memory(engine)[k] for k in ("weights", "kv_cache", "cpu_packed", "cuda_graphs"))
    engine.release_cache()
    cpu_packed.invalidate(engine.module)
    # Parameters (refilled by the refresh at wake) and LoRA side buffers (refilled with them); other buffers (rotary
    # frequencies) are small and copied once at build, so they stay.
    training = _training_storages(engine)
    lora = [b for side, _ in engine._shared.lora for b in (side.lora_a, side.lora_b)] if engine._shared else []
    tensors: dict[int, torch.Tensor] = {}
    for t in (*engine.module.parameters(), *lora):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in training:
            tensors.setdefault(ptr, t)
    engine._asleep = [(t, t.untyped_storage().nbytes()) for t in tensors.values()]
    for t, _ in engine._asleep:
        t.untyped_storage().resize_(0)
    return before - sum(engine_memory(engine)[k] for k in ("weights", "kv_cache", "cpu_packed", "cuda_graphs"))


def wake(engine: Any) -> None:
    """Give the slept tensors their storage back (values restored by the caller's refresh; buffers copied back)."""
    asleep, engine._asleep = engine._asleep, None
    for t, nbytes in asleep:
        t.untyped_storage().resize_(nbytes)
