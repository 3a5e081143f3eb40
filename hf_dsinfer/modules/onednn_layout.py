"""Re-pack a oneDNN-packed fp32 weight in place: a strided copy into the packed tensor's own buffer.

Why: the Hybrid Engine re-packs every weight the optimizer changed at each switch (``cpu_packed.repack``), and
oneDNN's reorder (``torch.ops.mkldnn._reorder_linear_weight``) allocates a new packed tensor and fills it at 3-7 GB/s
on this project's 2-core machines: SmolLM2's 513 MB took 150-190 ms of a full fine-tuning switch. For the fp32
linear weights it packs, oneDNN's blocked layout is a pure permutation of the plain ``[out, in]`` weight (SmolLM2's
shapes: blocks of 64 output rows, each stored ``[in, 64]``), so the same bytes can be written by one strided
``copy_`` into the buffer the previous pack already holds: no allocation, no page faults, torch's copy kernel on
the caller's threads.

How it stays correct:

* the layout is not assumed: :func:`layout` packs an index-coded weight of the same shape once per shape (oneDNN picks
  its format from the shape, dtype and CPU, never from the values) and reads back where each element went; only a
  layout that is a strided view of the plain weight with no padding is used (anything else: oneDNN's reorder);
* the first pack oneDNN makes of each shape (:func:`learn`, called by ``cpu_packed`` right after its reorder) is
  compared bit for bit with the probed view of the weight it packed; only then are writes of that shape done in
  place. A difference (a oneDNN that packs by value, a layout the probe misread) switches them off for that shape,
  with one info line, and oneDNN's reorder is used from then on. The check costs one read of the first pack, made
  with the first packed GEMM, not at a switch;
* it needs ``torch.ops.mkldnn.data_ptr`` and ``torch.ops.mkldnn._nbytes`` (the packed tensor's buffer); without
  them nothing is written in place.

The aliasing view (:func:`alias`) does not own the buffer: whoever holds it keeps the packed tensor alive too
(``cpu_packed._Pack`` holds both).
"""

from __future__ import annotations

import ctypes

import torch

#: Largest weight (elements) whose layout is probed: the index code is exact in fp32 below 2**24.
MAX_PROBE_ELEMENTS = 1 << 24

_layouts: dict[tuple[int, int], tuple[list[int], list[int]] | None] = {}  # (rows, cols) -> (sizes, strides)
_verified: dict[tuple[int, int], bool] = {}  # (rows, cols) -> oneDNN's first pack matched the probed layout


def _ops_present() -> bool:
    return hasattr(torch.ops.mkldnn, "data_ptr") and hasattr(torch.ops.mkldnn, "_nbytes")


def alias(packed: torch.Tensor) -> torch.Tensor | None:
    """A flat fp32 tensor over ``packed``'s buffer (writable; it does not keep ``packed`` alive), or None."""
    if not _ops_present():
        return None
    try:
        nbytes = int(torch.ops.mkldnn._nbytes(packed))
        addr = int(torch.ops.mkldnn.data_ptr(packed))
    except Exception:  # noqa: BLE001 - an op that refuses this tensor: no in-place writes for it
        return None
    if nbytes <= 0 or nbytes % 4 or not addr:
        return None
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.float32)  # [nbytes / 4]


def _strided_form(index: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """``(sizes, strides)`` such that ``arange(n).as_strided(sizes, strides).flatten() == index``, or None.

    Peels the innermost run of constant step off ``index`` (``index[j] = index[0] + j * step`` for ``j < run``),
    checks that every run of that length has the same step, and goes on with the runs' first elements.
    """
    sizes: list[int] = []
    strides: list[int] = []
    cur = index
    while cur.numel() > 1:
        step = int(cur[1] - cur[0])
        ar = torch.arange(cur.numel())
        ok = (cur - cur[0]) == ar * step
        run = cur.numel() if bool(ok.all()) else int((~ok).nonzero()[0, 0])
        if run < 2 or cur.numel() % run:
            return None
        rows = cur.view(-1, run)  # [numel / run, run]
        if not bool((rows == rows[:, :1] + ar[:run] * step).all()):
            return None
        sizes.append(run)
        strides.append(step)
        cur = rows[:, 0]
    if int(cur[0]) != 0:
        return None
    sizes, strides = sizes[::-1] or [1], strides[::-1] or [1]
    full = torch.arange(index.numel()).as_strided(sizes, strides).flatten()
    return (sizes, strides) if torch.equal(full, index) else None


def layout(rows: int, cols: int) -> tuple[list[int], list[int]] | None:
    """Where oneDNN's fp32 packing of a ``[rows, cols]`` weight puts each element, as ``(sizes, strides)`` of a view
    of the row-major weight whose flattening is the packed buffer; None when it is not such a view (padding, a
    shape too large to index-code) or cannot be read. Probed once per shape (one reorder of that shape)."""
    key = (rows, cols)
    if key not in _layouts:
        found = None
        if 1 < rows * cols <= MAX_PROBE_ELEMENTS:
            code = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)  # element i holds i
            packed = torch.ops.mkldnn._reorder_linear_weight(code, None)
            buf = alias(packed)
            if buf is not None and buf.numel() == rows * cols:
                found = _strided_form(buf.to(torch.int64))
            del buf, packed
        _layouts[key] = found
    return _layouts[key]


def learn(packed: torch.Tensor, weight: torch.Tensor) -> bool:
    """After oneDNN packed the row-major fp32 ``weight [rows, cols]`` into ``packed``: probe the shape's layout (once)
    and check it against this pack bit for bit, so that later writes of this shape may go in place. Returns whether
    they may. A layout that does not match (one info line) switches in-place writes off for the shape."""
    rows, cols = weight.shape
    key = (rows, cols)
    if key in _verified:
        return _verified[key]
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        return False  # nothing learned: another weight of this shape may teach it
    form = layout(rows, cols)
    buf = alias(packed) if form is not None else None
    ok = buf is not None and buf.numel() == rows * cols and torch.equal(
        buf.view(form[0]).view(torch.int32), weight.as_strided(*form, weight.storage_offset()).view(torch.int32)
    )  # fmt: skip
    _verified[key] = ok
    if not ok and form is not None:
        from ..log import logger  # late: the logger imports transformers

        logger.info("hf_dsinfer: oneDNN's packing of [%d, %d] fp32 weights differed from the probed layout; they are "
                    "re-packed by oneDNN's reorder", rows, cols)  # fmt: skip
    return ok


def write_packed(packed: torch.Tensor, weight: torch.Tensor) -> bool:
    """Write the row-major fp32 ``weight [rows, cols]`` into ``packed`` (a oneDNN pack of a weight of that shape) in
    place, where :func:`learn` verified the shape's layout; False otherwise (the caller then reorders with oneDNN)."""
    rows, cols = weight.shape
    if not _verified.get((rows, cols)) or weight.dtype != torch.float32 or not weight.is_contiguous():
        return False
    sizes, strides = _layouts[(rows, cols)]
    buf = alias(packed)
    if buf is None or buf.numel() != rows * cols:
        return False
    buf.view(sizes).copy_(weight.as_strided(sizes, strides, weight.storage_offset()))
    return True
