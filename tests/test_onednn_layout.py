"""In-place re-packing of oneDNN-packed fp32 and bf16 weights (hf_dsinfer/modules/onednn_layout.py).

The oracle is oneDNN's own reorder (``torch.ops.mkldnn._reorder_linear_weight``): an in-place write must leave the
packed buffer bit for bit equal to a fresh reorder of the same weight, reuse the buffer, and step aside (the caller
reorders) wherever the layout is not a plain permutation, the ops are missing, or the first write of a shape differs.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.modules import cpu_packed, onednn_layout

pytestmark = pytest.mark.usefixtures("one_thread")
needs_onednn = pytest.mark.skipif(
    not (cpu_packed.available() and onednn_layout._ops_present()), reason="oneDNN packed linear unavailable here"
)


@pytest.fixture(autouse=True)
def fresh_tables(monkeypatch):
    """Each test probes and verifies from scratch (the tables are process-wide caches)."""
    monkeypatch.setattr(onednn_layout, "_layouts", {})
    monkeypatch.setattr(onednn_layout, "_verified", {})


def _bf16_packs() -> bool:
    """oneDNN packs bf16 weights on CPUs with AVX-512 (or AVX-NE-CONVERT); elsewhere its bf16 reorder raises (and
    without oneDNN there is no op at all)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(32, 32, dtype=torch.bfloat16), None)
    except Exception:  # noqa: BLE001 - any failure means: no bf16 packs on this machine
        return False
    return True


# bf16 layouts differ with and without AMX; both must be written exactly where they are a view.
DTYPES = [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not _bf16_packs(), reason="no oneDNN bf16 packs here")),
]


def _bits(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return onednn_layout.alias(packed, dtype).view(onednn_layout._BITS[dtype]).clone()  # [elements of the buffer]


def test_strided_form_recovers_views_and_refuses_others():
    base = torch.arange(6 * 8 * 4)
    for sizes, strides in (([6, 8, 4], [32, 1, 8]), ([8, 24], [1, 8]), ([192], [1]), ([3, 2, 32], [64, 32, 1])):
        index = base.as_strided(sizes, strides).flatten()
        form = onednn_layout._strided_form(index)
        assert form is not None
        assert torch.equal(base.as_strided(*form).flatten(), index)
    shuffled = torch.randperm(base.numel(), generator=torch.Generator().manual_seed(0))
    assert onednn_layout._strided_form(shuffled) is None
    assert onednn_layout._strided_form(torch.tensor([1, 0, 2, 3])) is None  # a swap inside a run


@needs_onednn
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(64, 128), (192, 576), (576, 1536), (320, 96), (100, 70), (7, 33)])
def test_in_place_write_equals_a_fresh_reorder(rows, cols, dtype):
    g = torch.Generator().manual_seed(rows + cols)
    w1, w2 = (torch.randn(rows, cols, generator=g).to(dtype) for _ in range(2))
    # The second weight at an odd element offset of a larger buffer (a chunk of a head, a fused half): bf16 pairs
    # then straddle 32-bit words and must be moved element by element.
    w2 = torch.cat([torch.zeros(1, dtype=dtype), w2.flatten()])[1:].view(rows, cols)
    packed = torch.ops.mkldnn._reorder_linear_weight(w1, None)
    ptr = torch.ops.mkldnn.data_ptr(packed)
    assert not onednn_layout.write_packed(packed, w2)  # nothing learned of this shape yet
    learned = onednn_layout.learn(packed, w1)
    written = onednn_layout.write_packed(packed, w2)
    if onednn_layout.layout(rows, cols, dtype) is None:  # padded or not a view: nothing may be written
        assert not learned and not written
        assert torch.equal(_bits(packed, dtype), _bits(torch.ops.mkldnn._reorder_linear_weight(w1, None), dtype))
        return
    assert learned and written
    assert torch.ops.mkldnn.data_ptr(packed) == ptr  # the same buffer
    fresh = torch.ops.mkldnn._reorder_linear_weight(w2.contiguous().clone(), None)
    assert torch.equal(_bits(packed, dtype), _bits(fresh, dtype))
    w3 = torch.randn(rows, cols, generator=g).to(dtype)  # aligned: bf16 pairs move as 32-bit words
    assert onednn_layout.write_packed(packed, w3)
    assert torch.equal(_bits(packed, dtype), _bits(torch.ops.mkldnn._reorder_linear_weight(w3, None), dtype))
    x = torch.randn(8, cols, generator=g).to(dtype)  # [M, in]
    y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # [M, out]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), F.linear(x, w3).float(), atol=tol, rtol=tol)


@needs_onednn
def test_the_common_shapes_are_written_in_place():
    """SmolLM2's decoder and LM-head chunk shapes: a layout must be found (else the switch reorders everything); in
    bf16 where bf16 packing is used (AMX), with input pairs kept together (copied as 32-bit words)."""
    for rows, cols in ((960, 576), (576, 576), (3072, 576), (576, 1536), (7168, 576)):
        assert onednn_layout.layout(rows, cols) is not None, (rows, cols)
        if cpu_packed.bf16_available():
            sizes, strides = onednn_layout.layout(rows, cols, torch.bfloat16)
            assert sizes[-1] == 2 and strides[-1] == 1, (rows, cols, sizes, strides)


@needs_onednn
def test_non_contiguous_or_other_dtype_weights_are_left_to_onednn():
    w = torch.randn(128, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    assert not onednn_layout.learn(packed, torch.randn(64, 128).t())  # K-major: nothing learned from it
    assert (128, 64, torch.float32) not in onednn_layout._verified
    assert onednn_layout.learn(packed, w)
    before = _bits(packed)
    assert not onednn_layout.write_packed(packed, torch.randn(64, 128).t())
    assert not onednn_layout.write_packed(packed, torch.randn(128, 64, dtype=torch.float64))
    assert torch.equal(_bits(packed), before)


@needs_onednn
def test_a_misread_layout_is_caught_once_and_switched_off(caplog):
    rows, cols = 128, 64
    onednn_layout._layouts[(rows, cols, torch.float32)] = ([rows * cols], [1])  # wrong: oneDNN blocks the rows
    w = torch.randn(rows, cols)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    before = _bits(packed)
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        assert not onednn_layout.learn(packed, w)
        assert not onednn_layout.learn(packed, w)
        assert not onednn_layout.write_packed(packed, torch.randn(rows, cols))
    assert onednn_layout._verified[(rows, cols, torch.float32)] is False
    assert torch.equal(_bits(packed), before)
    assert sum("differed from the probed layout" in r.getMessage() for r in caplog.records) == 1


@needs_onednn
def test_missing_ops_mean_no_in_place_writes(monkeypatch):
    monkeypatch.setattr(onednn_layout, "_ops_present", lambda: False)
    w = torch.randn(128, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    assert onednn_layout.alias(packed) is None
    assert not onednn_layout.learn(packed, w)
    assert not onednn_layout.write_packed(packed, torch.randn(128, 64))


@needs_onednn
@pytest.mark.parametrize("in_place", [True, False])
def test_cpu_packed_repack_reuses_the_buffer(monkeypatch, in_place):
    """``cpu_packed.repack`` (the Hybrid Engine's switch) writes a changed weight into its pack in place, chunked
    weights included; with in-place writes unavailable it reorders into a new pack. Products equal ``F.linear``."""
    monkeypatch.setenv(cpu_packed.ENV_VAR, "1")
    monkeypatch.setattr(cpu_packed, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(cpu_packed, "CHUNK_BYTES", 64 * 96 * 4)  # 200 rows: chunks of 64, 64, 64 and 8 rows
    if not in_place:
        monkeypatch.setattr(onednn_layout, "_ops_present", lambda: False)
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(96, 200, bias=True)
    x = torch.randn(8, 96, generator=g)  # [M, in]
    with torch.no_grad():
        cpu_packed.module_forward(lin, x)  # packs
        slot = lin.__dict__[cpu_packed.SLOT_ATTR]
        first = list(cpu_packed._packs[slot].chunks)  # the packed tensors themselves
        ptrs = [torch.ops.mkldnn.data_ptr(c) for c in first]
        assert len(ptrs) == 4
        for _ in range(2):
            lin.weight.data.copy_(torch.randn(200, 96, generator=g))  # as the optimizer does: no version bump
            assert cpu_packed.repack(lin, only_packed=True)
            chunks = cpu_packed._packs[slot].chunks
            y = cpu_packed.module_forward(lin, x)
            torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    reused = [c is f and torch.ops.mkldnn.data_ptr(c) == p for c, f, p in zip(chunks, first, ptrs)]
    if in_place:
        for (a, b), same in zip(cpu_packed._packs[slot].bounds, reused):
            assert same == (onednn_layout.layout(b - a, 96) is not None)
        assert any(reused)
    else:
        assert not any(reused) and not any(onednn_layout._verified.values())
