"""One contiguous allocation (an arena) for a CPU model's decoder-layer weights and LM head.

Why: a CPU decode step at batch 1 streams every weight once, and one thread's read rate depends on how the weights
were allocated. SmolLM2-135M's 120 body matrices (fp32, 1 thread, compiled reduction loops, this project's 2-core
EPYC, quiet) read at 19.8-20.0 GB/s as separately allocated tensors (what injection leaves: one ``torch.cat`` per
fused weight, allocated between the loader's temporaries) and at 25.8-27.0 GB/s as views into one buffer holding the
same bytes, in either order and with or without gaps between them; one large matrix (the LM head) read at 30.3-30.7.
llama.cpp reads its weights from one mapping of the GGUF file. So after injection (and after the CPU packing of
quantized weights) :func:`pack_into_arena` moves the layer weights and the head into one buffer, in layer order, with
transparent huge pages requested for it: SmolLM2's decode step 21.6-21.9 against 24.3-26.1 ms (fp32) and 11.2-11.5
against 12.1-12.5 ms (int8), 1 thread (docs/performance.md).

The move is in place (``Tensor.set_``): the same parameter and buffer objects, now views of the arena, so every
module, hook, optimizer and cache that holds them sees the new storage. A tensor is moved only when it owns its
storage alone (contiguous, starting at the storage's start, covering all of it, and no other tensor or view sharing
it: the storage's use count); anything else keeps its memory, since a view of the old storage held elsewhere would
silently stop seeing later in-place writes. Old storages are freed as the move goes (huge pages make that possible:
with 4 KiB pages the arena got the just-freed, scattered pages back and lost most of the gain), so peak memory stays
near the model plus :data:`TRIM_EVERY`. ``save_pretrained`` clones disjoint views that share a storage (transformers
does), so checkpoints are unchanged. ``HF_DSINFER_CPU_ARENA=0`` keeps the separate allocations.

:func:`drop_file_pages` (the resident pages of memory-mapped checkpoint tensors a copy replaced) lives here too:
injection and quantization at load call it for the weights they copy, the arena for the ones it moves.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable

import torch
from torch import nn

from ..log import logger

#: ``HF_DSINFER_CPU_ARENA=0`` (or false/off/no): leave the weights where injection allocated them.
ENV_VAR = "HF_DSINFER_CPU_ARENA"
#: Byte alignment of each tensor in the arena (a cache line: the vectorized loops' loads start on one).
ALIGN = 64
_OFF = ("0", "false", "off", "no")
#: Transparent huge page size: the arena starts on such a boundary and asks the kernel for huge pages.
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's value (asm-generic/mman-common.h)


_MADV_DONTNEED = 4
_PAGE = 4096


def _madvise(addr: int, length: int, advice: int) -> bool:
    """``madvise(addr, length, advice)`` (Linux); False where it is not available or refused."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) == 0
    except (OSError, AttributeError):
        return False


def _advise_huge_pages(addr: int, length: int) -> bool:
    """``MADV_HUGEPAGE`` on ``[addr, addr + length)``. Systems whose transparent huge pages are in ``madvise`` mode (a
    common default) give huge pages only to regions that ask; ``always`` gives them anyway, ``never`` refuses (the
    arena then keeps 4 KiB pages)."""
    return _madvise(addr, length, _MADV_HUGEPAGE)


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's file-backed memory mappings (Linux), e.g. mmap-ed safetensors."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[4] != "0":  # inode 0: anonymous memory
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


def drop_file_pages(spans: list[tuple[int, int]]) -> None:
    """Tell the kernel the pages of released, file-backed tensors (``(address, bytes)`` spans) are no longer needed
    (``MADV_DONTNEED``).

    transformers maps safetensors files into memory, so HF parameters on CPU can be views of the file. Packing or
    moving them reads them, which makes those pages resident; freeing the tensors does not unmap the file (other
    weights still live in it), so without this the copy and the file pages would both count as resident memory. Only
    whole pages strictly inside a released tensor and inside a file mapping are dropped; a later read would fault them
    back in from the file, so no data can be lost.
    """
    if not spans or not sys.platform.startswith("linux"):
        return
    mappings = _file_mappings()
    if not mappings:
        return
    for ptr, nbytes in spans:
        lo, hi = -(-ptr // _PAGE) * _PAGE, (ptr + nbytes) // _PAGE * _PAGE  # inward to whole pages
        if hi > lo and any(start <= lo and hi <= end for start, end in mappings):
            _madvise(lo, hi - lo, _MADV_DONTNEED)


#: Bytes moved between two ``malloc_trim`` calls: the move's peak memory stays within about this much of the model's.
TRIM_EVERY = 16 << 20


def _malloc_trim():
    """glibc's ``malloc_trim`` (returns freed heap memory to the system), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has none)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def enabled() -> bool:
    """Whether :data:`ENV_VAR` allows the arena (the default)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF


def _use_count(t: torch.Tensor) -> int | None:
    """References to ``t``'s storage (tensors and views holding it), or None where torch does not expose it."""
    probe = getattr(torch._C, "_storage_Use_Count", None)
    if probe is None:
        return None
    return int(probe(t.untyped_storage()._cdata))


def _sole_owner_count() -> int | None:
    """The use count of a storage held by one tensor alone, as :func:`_use_count` reads it (the probe itself holds a
    reference through the Python storage object it creates)."""
    return _use_count(torch.empty(1))


def _movable(t: torch.Tensor, sole: int) -> bool:
    return (
        t.device.type == "cpu"
        and t.numel() > 0
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and _use_count(t) == sole
    )  # fmt: skip


def pack_into_arena(modules: Iterable[nn.Module]) -> int:
    """Move the CPU parameters and buffers of ``modules`` (e.g. the fused decoder layers, in order) into one new
    allocation, each at a :data:`ALIGN`-byte boundary, in the modules' order; in place. Returns the bytes moved
    (0 when switched off, on other devices, or where torch cannot tell that a tensor owns its storage alone).

    Every :data:`TRIM_EVERY` bytes and at the end, the memory the moved tensors left is given back: the pages of
    weights that were views of a memory-mapped checkpoint (:func:`drop_file_pages`; freeing the tensor does not unmap
    the file) and glibc's freed heap (without both, a 1.1B bf16 llama peaked at 1.36x the plain model's RSS)."""
    if not enabled():
        return 0
    sole = _sole_owner_count()
    if sole is None:
        logger.debug("hf_dsinfer: this torch does not expose storage use counts; the weight arena is skipped")
        return 0
    seen: set[int] = set()
    tensors: list[torch.Tensor] = []
    for module in modules:
        for sub in module.modules():
            for t in [*sub._parameters.values(), *sub._buffers.values()]:
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                if _movable(t, sole):
                    tensors.append(t)
    if len(tensors) < 2:
        return 0
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-(t.numel() * t.element_size()) // ALIGN) * ALIGN
    # One allocation, its start on a huge-page boundary; huge pages requested before any page is touched.
    span = -(-total // HUGE_PAGE) * HUGE_PAGE  # whole huge pages; the untouched tail costs no memory
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)
    base = -raw.data_ptr() % HUGE_PAGE
    huge = _advise_huge_pages(raw.data_ptr() + base, span)
    storage = raw.untyped_storage()
    trim, left, pending = _malloc_trim(), [], 0
    with torch.no_grad():
        for i, (t, offset) in enumerate(zip(tensors, offsets)):
            nbytes = t.numel() * t.element_size()
            view = raw[base + offset : base + offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            left.append((t.data_ptr(), nbytes))
            # The same tensor object now reads the arena (offset counted in its own elements); its old storage is
            # freed here, one tensor at a time.
            t.set_(storage, (base + offset) // t.element_size(), t.shape, view.stride())
            pending += nbytes
            if pending >= TRIM_EVERY or i == len(tensors) - 1:  # so the peak stays near one model plus this much
                drop_file_pages(left)
                if trim is not None:
                    trim(0)  # freed blocks below glibc's mmap threshold stay resident until trimmed
                left, pending = [], 0
    logger.debug("hf_dsinfer: %d weight tensors (%.1f MiB) moved into one contiguous allocation (huge pages %s)",
                 len(tensors), total / 2**20, "requested" if huge else "not available")  # fmt: skip
    return total
