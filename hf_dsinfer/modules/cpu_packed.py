"""oneDNN-prepacked weights for the fp32 (and, with AMX, bf16) CPU GEMMs of batched decoding: a cache beside the
weight, not a parameter.

Why: in decode steps of a few rows, MKL's ``sgemm`` over a plain weight reads it far slower than its GEMV does at one
row: for the `small` bench preset's LM head (``[32000, 512]``, K-major, 1 thread, this project's 2-core EPYC) 10.7 ms
at ``M = 8`` against 2.5 ms at ``M = 1``, for the same bytes. oneDNN's linear over a weight reordered once into its
blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` + ``torch.ops.mkldnn._linear_pointwise``, the ops
inductor's CPU "freezing" pass uses) took 7.5 ms. Summed over the preset's linears and head, packed was 1.4-2.3x
faster at ``M = 4`` and ``8`` in every run taken (docs/performance.md), 1.0-1.2x at ``M = 2`` and at 64-512 rows,
and 1.4-2x slower at ``M = 1``, where a GEMV wins (now the row-streaming one of ``modules/linear.py``). Hence the window
:data:`MIN_ROWS`..:data:`MAX_ROWS` rows of one token each (a prefill never packs, so batch-1 use holds no copy), and
:data:`MIN_ELEMENTS`: oneDNN's call costs more than MKL's, which a 512x512 weight does not repay.

How it stays correct:

* the plain weight stays the parameter: ``state_dict``, save/reload, TP slicing and the Hybrid Engine read and write
  it as before. The packed copy lives in a process-wide table keyed by a *slot* number stored on the owning module
  (:func:`ensure_slot`) and is dropped when the module is garbage-collected;
* it is rebuilt on the next call whenever the weight's storage (``data_ptr``), shape or autograd version counter
  (``_version``, bumped by any in-place op such as ``load_state_dict``'s ``copy_``) changed. Writes through ``.data``
  bypass the version counter: whoever does that (the Hybrid Engine's refresh does) calls :func:`invalidate`;
* the GEMM runs as the custom op ``torch.ops.hf_dsinfer.cpu_packed_linear(x, weight, bias, slot)``: the compiled CPU
  decode step calls it from its graph with the *plain* weight as input, so the staleness check runs on every call,
  inside or outside ``torch.compile`` (an opaque oneDNN tensor cannot be a graph input without freezing);
* where the ops are missing (non-x86, a torch build without oneDNN, an op that raises: a debug log line) or compute
  something other than ``F.linear`` in a one-off probe (one info line naming the op and the fallback), every linear
  keeps ``F.linear``, and so does anything that needs autograd or is not fp32 (or bf16, below) on CPU.

**bf16** takes the packed GEMM too where the CPU has AMX tiles (``torch.cpu._is_amx_tile_supported()``) and a bf16
probe product equals ``F.linear``'s bit for bit (one info line otherwise). Why: ``F.linear`` in bf16 runs oneDNN's
AMX matmul over the plain weight, which it reorders into its blocked layout on every call; over the prepacked copy
the same kernel skips that. SmolLM2's 121 linears and head (269 MB bf16) took 26-35% less time packed at every row
count from 1 to 128, at 1 and 2 threads, with products equal bit for bit (an Intel Xeon with AMX, torch 2.13;
docs/performance.md, "bf16 prepacked GEMMs", ``scripts/bench_cpu_packed_gemm.py``). Measured on that CPU only, hence
the AMX condition; the row window and :data:`MIN_ELEMENTS` are fp32's.

The serving engine packs its tokens of different requests into one ``[1, T, C]`` row; its steps run inside
:func:`ragged_rows`, where those T tokens count as T rows, so 4-32 decoding requests take the packed GEMM too.

Memory: a packed copy is as large as its weight, so a model decoding at batch >= 4 on CPU (or serving 4 or more
requests at once) holds its linear and LM-head weights twice (the embedding is not packed).

Re-packing (the Hybrid Engine re-packs every changed weight at each switch) is mostly page faults when each pack gets
fresh memory: oneDNN's reorder of SmolLM2's ``[49152, 576]`` LM head took 62-64 ms, 43 ms of which an ``empty`` +
``fill`` of the same 113 MB also takes (its 27649 minor faults), against 5 ms to refill memory already mapped. So a
pack is freed *before* its successor is reordered (glibc's ``malloc`` then hands the same pages back: 0 faults,
4.2 -> 2.1 ms for a ``[3072, 576]`` weight), and a weight above :data:`CHUNK_BYTES` is packed in row chunks below
that size: glibc maps blocks above its mmap threshold (at most 32 MiB) freshly at every allocation and unmaps them
when freed, so a single 113 MB pack would fault in full at every re-pack. The chunks' products are concatenated
(the GEMM is as fast in chunks: 19.5-20.1 ms against 19.6-20.1 ms for the whole head at 32 rows).
A re-pack of a weight whose pack already exists (same shape) writes the new values into that pack's own buffer with
one strided copy where :mod:`.onednn_layout` verified the shape's layout (SmolLM2's full fine-tuning switch: 180-214
-> 151-156 ms at one thread, 120-158 -> 91-97 ms at two; bf16 packs too); elsewhere oneDNN reorders into a new pack
as above.
``HF_DSINFER_CPU_PACKED=0`` switches packing off process-wide (read before every step); :func:`packed_bytes` tells
what the cache holds.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import platform
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import onednn_layout

#: ``HF_DSINFER_CPU_PACKED=0`` (or false/off/no) keeps every CPU linear on ``F.linear`` (no second copy).
ENV_VAR = "HF_DSINFER_CPU_PACKED"
#: Fewest and most rows (``x.numel() // in_features``) that take the packed GEMM; others keep ``F.linear``.
MIN_ROWS = 4
MAX_ROWS = 32
#: Smallest weight (elements) worth packing: the `small` preset's 512x512 o projection (262,144) did not repay
#: oneDNN's costlier call; SmolLM2's 576x576 one (331,776) does, 30 distinct weights as in a step (1 thread, load 4.7):
#: 2.6 / 3.4 / 4.6 / 7.5 ms packed against 4.6 / 5.3 / 6.8 / 10.0 ms ``F.linear`` at 4 / 8 / 16 / 32 rows.
MIN_ELEMENTS = 300_000
#: The attribute holding a module's slot number (a plain int: not a parameter, buffer or ``state_dict`` entry).
SLOT_ATTR = "_hf_dsinfer_pack_slot"
#: Largest packed chunk (bytes): a weight above it is packed as row chunks of at most this size (see the module doc:
#: below glibc's 32 MiB mmap-threshold ceiling, so a re-pack reuses the pages its predecessor freed).
CHUNK_BYTES = 16 << 20
_OFF = ("0", "false", "off", "no")


@dataclass
class _Pack:
    """One packed weight and what it was packed from."""

    ptr: int  # data_ptr of the plain weight
    dtype: torch.dtype  # its dtype (fp32, or bf16 with AMX)
    version: int  # its _version (-1 for inference tensors, which have none)
    shape: tuple[int, ...]  # [out, in]
    chunks: list[torch.Tensor]  # opaque oneDNN tensors, one per row chunk of the weight (one unless > CHUNK_BYTES)
    bounds: list[tuple[int, int]]  # the rows [start, end) of each chunk
    nbytes: int  # what the chunks hold (oneDNN pads awkward shapes)


_packs: dict[int, _Pack] = {}  # slot -> pack (empty slots have no entry)
_owners: dict[int, weakref.ref] = {}  # slot -> its module
_slots = itertools.count(1)
_available: bool | None = None
_bf16_available: bool | None = None
_stats = {"packs": 0}  # how many weights were (re-)packed in this process (tests and reports read it)
_on = False  # the process-wide switch, refreshed by sync() outside compiled graphs (a traced read is guarded)
_bf16_on = False  # bf16 weights too (AMX): refreshed with _on
_ragged = threading.local()  # .on: inside ragged_rows() on this thread


def _probe() -> tuple[bool, str | None]:
    """Whether oneDNN's packed linear exists here and computes ``F.linear`` (a 24x40 product; milliseconds), and
    why not when it runs but computes wrong values (None when it is absent: not x86, no oneDNN, an op raising)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "x86", "i686"):
        return False, None  # measured on x86 only; other CPUs keep F.linear
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False, None
    product = _probe_product(torch.float32, bias=False)
    if product is None:
        return False, None
    y, want = product
    if not torch.allclose(y, want, atol=1e-4, rtol=1e-4):
        return False, f"the probe differed from F.linear by {float((y - want).abs().max()):.3g}"
    return True, None


def _probe_product(dtype: torch.dtype, bias: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A 24x40 product at 5 rows of ``dtype`` through oneDNN's packed linear, and ``F.linear``'s: ``(y, want)``, each
    ``[5, 40]``; None when an op is missing or raises (packing is only an optimization)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g).to(dtype)  # [out, in]
    b = torch.randn(40, generator=g).to(dtype) if bias else None
    x = torch.randn(5, 24, generator=g).to(dtype)  # [M, in]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")  # [M, out]
    except Exception:  # noqa: BLE001 - missing op, unsupported build or dtype
        return None
    return y, F.linear(x, w, b)


def available() -> bool:
    """Whether the packed GEMM works in this process (probed once; one info line when it computes wrong values)."""
    global _available
    if _available is None:
        _available, why = _probe()
        if not _available:
            from ..log import logger  # late: the logger imports transformers

            if why is None:
                logger.debug("hf_dsinfer: oneDNN packed linear unavailable here; CPU linears use F.linear")
            else:
                logger.info("hf_dsinfer: oneDNN packed linear (mkldnn._linear_pointwise) not used: %s; CPU linears "
                            "use F.linear", why)  # fmt: skip
    return _available


def _probe_bf16() -> tuple[bool, str | None]:
    """Whether bf16 packing pays here (AMX tiles) and the packed bf16 product equals ``F.linear``'s bit for bit (a
    24x40 product with bias at 5 rows), and why not when it differs (None when there is no AMX or the op raises)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        if amx is None or not amx():
            return False, None
    except Exception:  # noqa: BLE001 - a capability query that fails: no AMX as far as we know
        return False, None
    product = _probe_product(torch.bfloat16, bias=True)
    if product is None:
        return False, None
    y, want = product
    if not torch.equal(y, want):
        return False, f"the bf16 probe differed from F.linear by {float((y.float() - want.float()).abs().max()):.3g}"
    return True, None


def bf16_available() -> bool:
    """Whether bf16 weights take the packed GEMM in this process: fp32's ops work, the CPU has AMX and the bf16
    probe matched (probed once; one info line when it computes other values)."""
    global _bf16_available
    if _bf16_available is None:
        _bf16_available, why = _probe_bf16() if available() else (False, None)
        if why is not None:
            from ..log import logger  # late: the logger imports transformers

            logger.info("hf_dsinfer: oneDNN packed linear not used for bf16: %s; bf16 CPU linears use F.linear", why)
    return _bf16_available


def sync() -> bool:
    """Re-read :data:`ENV_VAR` into the switch compiled graphs read (call outside a graph; cheap)."""
    global _on, _bf16_on
    _on = os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF and available()
    _bf16_on = _on and bf16_available()
    return _on


def enabled() -> bool:
    """The switch: eagerly it re-reads the environment; inside a compiled graph it reads the (guarded) global."""
    if not torch.compiler.is_compiling():
        sync()
    return _on


def _release(slot: int) -> None:
    _packs.pop(slot, None)
    _owners.pop(slot, None)


def ensure_slot(module: nn.Module) -> int:
    """``module``'s slot number, given on first call (eagerly: a traced call reads the slot and cannot add one).

    A module that carries a slot it does not own (a deep copy, an unpickled module) gets a fresh one.
    """
    slot = module.__dict__.get(SLOT_ATTR)
    owner = _owners.get(slot) if slot is not None else None
    if owner is None or owner() is not module:
        slot = next(_slots)
        module.__dict__[SLOT_ATTR] = slot  # plain attribute: never a parameter, buffer or state_dict entry
        _owners[slot] = weakref.ref(module)
        weakref.finalize(module, _release, slot)  # the packed copy dies with its module
    return slot


def prepare(model: nn.Module) -> None:
    """Give every packable linear of ``model`` a slot (its fused ``Linear`` layers and plain ``nn.Linear`` modules),
    so that a graph traced next can call the packed op for them. Call eagerly, before compiling."""
    from .linear import Linear  # late: linear imports this module

    for m in model.modules():
        if isinstance(m, Linear) or type(m) is nn.Linear:
            ensure_slot(m)


def applies(x: torch.Tensor, weight: torch.Tensor, module: nn.Module) -> bool:
    """Whether ``F.linear(x, weight)`` of ``module`` runs packed: switch on, fp32 (or bf16 with AMX) on CPU, enough
    rows, no autograd."""
    if not torch.compiler.is_compiling():
        sync()
        ensure_slot(module)
    if not _on or getattr(module, SLOT_ATTR, None) is None:
        return False
    if x.device.type != "cpu" or x.dtype != weight.dtype or weight.ndim != 2:
        return False
    if x.dtype != torch.float32 and (x.dtype != torch.bfloat16 or not _bf16_on):
        return False
    if weight.device.type != "cpu" or x.shape[-1] != weight.shape[1] or weight.numel() < MIN_ELEMENTS:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False  # the oneDNN op has no backward here
    if x.ndim > 2 and x.shape[-2] != 1 and (torch.compiler.is_compiling() or not getattr(_ragged, "on", False)):
        return False  # several tokens per sequence (a prefill): MKL is as fast there, and batch-1 use packs nothing
    return MIN_ROWS <= x.numel() // max(x.shape[-1], 1) <= MAX_ROWS


@contextlib.contextmanager
def ragged_rows() -> Iterator[None]:
    """Within it (on this thread), the ``T`` tokens of a ``[1, T, C]`` activation count as ``T`` rows: the serving
    engine's ragged step packs its tokens of different requests into one row, so a step of 4-32 decoding requests
    takes the packed GEMM as a batch of one-token rows does (a 4-request SmolLM2 step spent 2.5x a 1-request step's
    time in MKL's ``sgemm`` without it)."""
    before = getattr(_ragged, "on", False)
    _ragged.on = True
    try:
        yield
    finally:
        _ragged.on = before


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, module: nn.Module) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over ``module``'s packed copy of ``weight``: ``x [..., in] -> [..., out]``."""
    # The reshapes are done here, not in the op: traced, they cost nothing at run time.
    x2, slot = x.reshape(-1, x.shape[-1]), getattr(module, SLOT_ATTR)  # [M, in]
    if torch.compiler.is_compiling():
        y = torch.ops.hf_dsinfer.cpu_packed_linear(x2, weight, bias, slot)  # the graph needs the op
    else:  # eagerly, the op's kernel itself: the dispatcher's round trip back into Python cost ~50 us a call
        y = _packed_linear(x2, weight, bias, slot)
    return y.view(*x.shape[:-1], weight.shape[0])  # [M, out] -> [..., out]


def is_plain_linear(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` without forward hooks: its forward is ``F.linear`` and may be replaced by an equal product
    (not a subclass, nor a peft / TP wrapper, nor a module whose hooks must run)."""
    return type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)


def module_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a plain ``nn.Linear`` without hooks (the LM head): packed where :func:`applies`; at 1-3 rows
    over a row-major fp32 weight (the Hybrid Engine's head, ``hybrid.build.row_major_head``), the row-streaming GEMV
    of :class:`~.linear.Linear` (``F.linear`` reads a row-major weight about half as fast there).

    Otherwise on CPU a strided input of more than two dimensions (a prefill's last-token slice ``[B, 1, C]`` of
    ``[B, T, C]``) is folded to ``[rows, C]`` first: ``F.linear`` cannot fold it into one GEMM and copies the weight
    once per row for a batched product instead (bf16 SmolLM2 head, 32 rows of 32 tokens: 2.7 s against 7 ms).
    Anything else (a subclass, a peft or TP wrapper, a module with hooks) is simply called.
    """
    if not is_plain_linear(module):
        return module(x)
    if applies(x, module.weight, module):
        return linear(x, module.weight, module.bias, module)
    from .linear import _row_gemv, _row_gemv_applies  # late: linear imports this module

    if _row_gemv_applies(x, module.weight):
        y = _row_gemv(x, module.weight)  # [..., out]
        return y if module.bias is None else y + module.bias
    if x.device.type == "cpu" and x.ndim > 2 and not x.is_contiguous():
        y = F.linear(x.reshape(-1, x.shape[-1]), module.weight, module.bias)  # [rows, out]
        return y.view(*x.shape[:-1], y.shape[-1])  # [..., out]
    return module(x)


def invalidate(module: nn.Module) -> int:
    """Drop the packed copies of every module in ``module`` (after writing weights through ``.data``).

    Returns how many were dropped; the next packed call re-packs (lazily, per weight).
    """
    dropped = 0
    for m in module.modules():
        slot = m.__dict__.get(SLOT_ATTR)
        if slot is not None and _packs.pop(slot, None) is not None:
            dropped += 1
    return dropped


def repack(module: nn.Module, only_packed: bool = False) -> bool:
    """Pack ``module.weight`` now rather than at its next packed call (the Hybrid Engine re-packs at the switch, so
    the switch cost includes it), freeing its old pack chunk by chunk as the new one is made (the memory is reused).
    ``only_packed``: only a weight that holds a pack now (one in use at this batch). False when nothing was packed:
    packing off or unavailable, no slot, or (``only_packed``) no pack."""
    slot, weight = module.__dict__.get(SLOT_ATTR), getattr(module, "weight", None)
    if slot is None or not isinstance(weight, torch.Tensor) or (only_packed and slot not in _packs) or not sync():
        return False
    _repack(slot, weight)
    return True


def any_packed() -> bool:
    """Whether any weight of this process holds a packed copy now."""
    return bool(_packs)


def packed_bytes(module: nn.Module | None = None) -> int:
    """Bytes held by packed copies (of the modules in ``module``, or all); a packed copy is about as large as its
    weight (oneDNN pads some shapes)."""
    if module is None:
        slots = set(_packs)
    else:
        slots = {m.__dict__.get(SLOT_ATTR) for m in module.modules()} & set(_packs)
    return sum(_packs[s].nbytes for s in slots)


def _nbytes(chunk: torch.Tensor, rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a packed chunk: oneDNN's own count where the op exists, else the weight's."""
    return onednn_layout.nbytes(chunk) or rows * cols * itemsize


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot change outside inference mode)
        return -1


def _chunk_bounds(rows: int, cols: int, itemsize: int = 4) -> list[tuple[int, int]]:
    """Row ranges of at most :data:`CHUNK_BYTES` each, in multiples of 64 rows (oneDNN's blocks)."""
    step = max(64, CHUNK_BYTES // (itemsize * max(cols, 1)) // 64 * 64)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)] or [(0, rows)]


def _repack(slot: int, weight: torch.Tensor) -> _Pack:
    old = _packs.pop(slot, None)
    bounds = _chunk_bounds(weight.shape[0], weight.shape[1], weight.dtype.itemsize)
    same = old is not None and old.shape == tuple(weight.shape) and old.dtype == weight.dtype and old.bounds == bounds
    chunks: list[torch.Tensor] = []
    for i, (a, b) in enumerate(bounds):
        rows = weight.detach()[a:b]  # [b - a, in]
        if same and onednn_layout.write_packed(old.chunks[i], rows):
            chunks.append(old.chunks[i])  # re-packed in place: the same buffer, nothing allocated
            continue
        if old is not None and i < len(old.chunks):
            old.chunks[i] = None  # freed before its successor is allocated: malloc hands the same pages back
        # The reorder reads row-major [rows, in]; a K-major weight's rows are copied once for it (transiently).
        rows = rows.contiguous()
        chunks.append(torch.ops.mkldnn._reorder_linear_weight(rows, None))
        onednn_layout.learn(chunks[-1], rows)  # once per shape: may later re-packs of it go in place?
    if same and all(c is o for c, o in zip(chunks, old.chunks)):
        size = old.nbytes  # every chunk rewritten in its own buffer: the same bytes as before
    else:
        size = sum(_nbytes(c, b - a, weight.shape[1], weight.dtype.itemsize) for c, (a, b) in zip(chunks, bounds))
    del old
    _stats["packs"] += 1
    pack = _Pack(weight.data_ptr(), weight.dtype, _version(weight), tuple(weight.shape), chunks, bounds, size)
    _packs[slot] = pack
    return pack


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: int) -> torch.Tensor:
    """The op's CPU kernel: re-pack when the weight changed, then oneDNN's linear; ``x [M, in] -> [M, out]``."""
    pack = _packs.get(slot)
    if (pack is None or pack.ptr != weight.data_ptr() or pack.version != _version(weight) or pack.shape != weight.shape
            or pack.dtype != weight.dtype):  # fmt: skip
        pack = _repack(slot, weight)
    if not x.is_contiguous():
        x = x.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if len(pack.chunks) == 1:
        return torch.ops.mkldnn._linear_pointwise(x, pack.chunks[0], bias, "none", [], "")
    parts = [
        torch.ops.mkldnn._linear_pointwise(x, chunk, None if bias is None else bias[a:b], "none", [], "")
        for chunk, (a, b) in zip(pack.chunks, pack.bounds)
    ]  # [M, rows of each chunk]
    return torch.cat(parts, dim=1)  # [M, out]


def _fake_packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))  # [M, out]


# FRAGMENT: other parts of the package may add ops to the same namespace.
_lib = torch.library.Library("hf_dsinfer", "FRAGMENT")
_lib.define("cpu_packed_linear(Tensor x, Tensor weight, Tensor? bias, int slot) -> Tensor")  # x: [M, in]
_lib.impl("cpu_packed_linear", _packed_linear, "CPU")
torch.library.register_fake("hf_dsinfer::cpu_packed_linear", _fake_packed_linear, lib=_lib)
