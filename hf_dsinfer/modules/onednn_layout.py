"""Re-pack a oneDNN-packed fp32 or bf16 weight in place: a strided copy into the packed tensor's own buffer.

Why: the Hybrid Engine re-packs every weight the optimizer changed at each switch (``cpu_packed.repack``), and
oneDNN's reorder (``torch.ops.mkldnn._reorder_linear_weight``) allocates a new packed tensor and fills it at 3-7 GB/s
on this project's 2-core machines: SmolLM2's 513 MB took 150-190 ms of a full fine-tuning switch. For the fp32
linear weights it packs, oneDNN's blocked layout is a pure permutation of the plain ``[out, in]`` weight (SmolLM2's
shapes: blocks of 64 output rows, each stored ``[in, 64]``), so the same bytes can be written by one strided
``copy_`` into the buffer the previous pack already holds: no allocation, no page faults, torch's copy kernel on
the caller's threads. bf16 packs (AMX: blocks of 32 output rows, each stored ``[in / 2, 32, 2]``, input pairs kept
together) are written the same way, each pair moved as one 32-bit word: SmolLM2's 3072x576 weight, 40 of them
(141 MB), took 19.9 ms against 46-57 ms for a 16-bit gather and 24-37 ms for oneDNN's reorder at 2 threads.

How it stays correct:

* the layout is not assumed: :func:`layout` packs an index-coded weight of the same shape and dtype once (oneDNN
  picks its format from the shape, dtype and CPU, never from the values) and reads back where each element went (in
  bf16, whose integers are exact only to 256, one pack per 8-bit digit of the index); only a layout that is a
  strided view of the plain weight with no padding is used (anything else: oneDNN's reorder);
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

#: Largest weight (elements) whose layout is probed: the index code is exact in fp32 below 2**24 (bf16: 3 digits).
MAX_PROBE_ELEMENTS = 1 << 24
#: The weight dtypes written in place, and the integer type of the same width their bits are compared in.
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}

Key = tuple[int, int, torch.dtype]  # (rows, cols, dtype)
_layouts: dict[Key, tuple[list[int], list[int]] | None] = {}  # -> (sizes, strides) in elements
_verified: dict[Key, bool] = {}  # -> oneDNN's first pack matched the probed layout


def _ops_present() -> bool:
    return hasattr(torch.ops.mkldnn, "data_ptr") and hasattr(torch.ops.mkldnn, "_nbytes")


def nbytes(packed: torch.Tensor) -> int | None:
    """Bytes of ``packed``'s buffer (oneDNN pads some shapes), or None where the op is missing or refuses it."""
    try:
        return int(torch.ops.mkldnn._nbytes(packed))
    except Exception:  # noqa: BLE001 - an op that refuses this tensor
        return None


def alias(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """A flat ``dtype`` tensor over ``packed``'s buffer (writable; it does not keep ``packed`` alive), or None."""
    size = nbytes(packed) if _ops_present() else None
    if size is None:
        return None
    try:
        addr = int(torch.ops.mkldnn.data_ptr(packed))
    except Exception:  # noqa: BLE001 - an op that refuses this tensor: no in-place writes for it
        return None
    if size <= 0 or size % dtype.itemsize or not addr:
        return None
    return torch.frombuffer((ctypes.c_char * size).from_address(addr), dtype=dtype)  # [size / itemsize]


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


def _packed_index(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Where oneDNN's pack of a ``[rows, cols]`` ``dtype`` weight puts each element: the plain weight's flat index of
    every packed element, in buffer order (int64), or None when the buffer is padded or cannot be read."""
    n = rows * cols
    index = torch.arange(n, dtype=torch.int64)
    # fp32: one pack, every index is exact below 2**24. bf16 holds the integers 0..256 exactly: one pack per digit.
    bits, count = (24, 1) if dtype == torch.float32 else (8, max(1, (max(n - 1, 1).bit_length() + 7) // 8))
    found = torch.zeros(n, dtype=torch.int64)
    for k in range(count):
        digit = (index >> (bits * k)) & ((1 << bits) - 1)  # [n]
        packed = torch.ops.mkldnn._reorder_linear_weight(digit.to(dtype).view(rows, cols), None)
        del digit
        buf = alias(packed, dtype)
        if buf is None or buf.numel() != n:
            return None
        found += buf.to(torch.int64) << (bits * k)
        del buf, packed
    return found


def layout(rows: int, cols: int, dtype: torch.dtype = torch.float32) -> tuple[list[int], list[int]] | None:
    """Where oneDNN's packing of a ``[rows, cols]`` weight of ``dtype`` (fp32 or bf16) puts each element, as
    ``(sizes, strides)`` of a view of the row-major weight whose flattening is the packed buffer; None when it is not
    such a view (padding, a shape too large to index-code, another dtype) or cannot be read. Probed once per shape
    and dtype (one reorder of that shape, three in bf16)."""
    key = (rows, cols, dtype)
    if key not in _layouts:
        found = None
        if dtype in _BITS and 1 < rows * cols <= MAX_PROBE_ELEMENTS:
            index = _packed_index(rows, cols, dtype)
            found = _strided_form(index) if index is not None else None
        _layouts[key] = found
    return _layouts[key]


def _view(weight: torch.Tensor, form: tuple[list[int], list[int]]) -> torch.Tensor:
    return weight.as_strided(*form, weight.storage_offset())


def learn(packed: torch.Tensor, weight: torch.Tensor) -> bool:
    """After oneDNN packed the row-major fp32 or bf16 ``weight [rows, cols]`` into ``packed``: probe the shape's
    layout (once) and check it against this pack bit for bit, so that later writes of this shape may go in place.
    Returns whether they may. A layout that does not match (one info line) switches in-place writes off for it."""
    rows, cols = weight.shape
    key = (rows, cols, weight.dtype)
    if key in _verified:
        return _verified[key]
    if weight.dtype not in _BITS or not weight.is_contiguous():
        return False  # nothing learned: another weight of this shape may teach it
    form = layout(rows, cols, weight.dtype)
    buf = alias(packed, weight.dtype) if form is not None else None
    bits = _BITS[weight.dtype]
    ok = buf is not None and buf.numel() == rows * cols and torch.equal(
        buf.view(form[0]).view(bits), _view(weight, form).view(bits)
    )  # fmt: skip
    _verified[key] = ok
    if not ok and form is not None:
        from ..log import logger  # late: the logger imports transformers

        logger.info("hf_dsinfer: oneDNN's packing of [%d, %d] %s weights differed from the probed layout; they are "
                    "re-packed by oneDNN's reorder", rows, cols, str(weight.dtype).removeprefix("torch."))  # fmt: skip
    return ok


def _as_words(
    buf: torch.Tensor, weight: torch.Tensor, form: tuple[list[int], list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(destination, source)`` views for the copy: bf16 element pairs that stay together (the innermost dimension
    is two neighbours, as AMX's layout keeps input pairs) move as one int32 word, which torch's strided copy moves
    2-2.5x faster than two 16-bit elements; anything else is copied element by element."""
    sizes, strides = form
    offset = weight.storage_offset()
    pairs = (
        weight.dtype == torch.bfloat16 and len(sizes) > 1 and sizes[-1] == 2 and strides[-1] == 1
        and all(s % 2 == 0 for s in strides[:-1]) and weight.shape[1] % 2 == 0 and offset % 2 == 0
        and weight.data_ptr() % 4 == 0
    )  # fmt: skip
    if not pairs:
        return buf.view(sizes), _view(weight, form)
    words = weight.view(torch.int32)  # [rows, cols / 2]: each input pair one word
    half = [s // 2 for s in strides[:-1]]
    return buf.view(torch.int32).view(sizes[:-1]), words.as_strided(sizes[:-1], half, offset // 2)


def write_packed(packed: torch.Tensor, weight: torch.Tensor) -> bool:
    """Write the row-major fp32 or bf16 ``weight [rows, cols]`` into ``packed`` (a oneDNN pack of a weight of that
    shape and dtype) in place, where :func:`learn` verified the layout; False otherwise (the caller then reorders)."""
    rows, cols = weight.shape
    key = (rows, cols, weight.dtype)
    if not _verified.get(key) or not weight.is_contiguous():
        return False
    buf = alias(packed, weight.dtype)
    if buf is None or buf.numel() != rows * cols:
        return False
    dst, src = _as_words(buf, weight, _layouts[key])
    dst.copy_(src)
    return True
