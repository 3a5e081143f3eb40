"""What the Hybrid Engine holds beyond the training model, the CPU re-pack at the switch, and sleep / wake.

``memory()`` counts every byte the engine adds: the inference copy's own weights (storage shared with the training
model, see :mod:`.shared_base`, is not counted twice), the static KV cache, the oneDNN-packed CPU copies of its
linear weights (``modules/cpu_packed.py``: as large as the weights they pack, built at batch 4-32 on CPU in fp32, and
in bf16 with AMX) and
the CUDA-graph memory pool of the decode graphs. ``sleep()`` frees the inference copy's own weights, the KV cache,
the packed copies and the graphs between generation phases (full fine-tuning: the copy is as large as the model);
``wake()`` (or the next ``eval()``) allocates them again and refreshes them from the training weights.
"""

from __future__ import annotations

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


def repack(module: nn.Module, unchanged: set[int]) -> int:
    """After a refresh: re-pack now (so the switch pays for it, not the next generate) the CPU packed copies of the
    linears whose weight may have changed; ``unchanged`` (ids: the shared frozen base) was not, its packs stay.
    Returns how many."""
    count = 0
    if not cpu_packed.any_packed():  # nothing packed in this process (CUDA, packing off): no module walk
        return count
    for m in module.modules():
        weight = getattr(m, "weight", None)
        slot = m.__dict__.get(cpu_packed.SLOT_ATTR)
        if slot is None or not isinstance(weight, torch.Tensor) or id(weight) in unchanged:
            continue
        if cpu_packed.repack(m, only_packed=True):  # weights packed before (in use at this batch), in place
            count += 1
        else:  # packing off now: a pack left behind would be stale if it came back on (.data writes bump nothing)
            cpu_packed.invalidate(m)
    # Modules without a slot were never packed; the remaining (non-linear) ones hold nothing to re-pack.
    return count


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
    if engine._shared is not None:
        engine._shared.cast_stale = True  # frozen tensors cast once lose their values too: cast again at wake
        engine._shared.forget_lora_plan()  # the side buffers too: zeroed and refilled at wake
    for t, _ in engine._asleep:
        t.untyped_storage().resize_(0)
    return before - sum(engine_memory(engine)[k] for k in ("weights", "kv_cache", "cpu_packed", "cuda_graphs"))


def wake(engine: Any) -> None:
    """Give the slept tensors their storage back (values restored by the caller's refresh; buffers copied back)."""
    asleep, engine._asleep = engine._asleep, None
    for t, nbytes in asleep:
        t.untyped_storage().resize_(nbytes)
