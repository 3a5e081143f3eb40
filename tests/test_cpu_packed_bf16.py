"""bf16 weights on oneDNN's prepacked CPU linear (hf_dsinfer/modules/cpu_packed.py), taken only where the CPU has
AMX tiles and a probe product equals ``F.linear``'s bit for bit.

Where it is taken, products must equal ``F.linear`` exactly (the same oneDNN kernel, minus a per-call weight
reorder), so a bf16 model generates the same tokens and logits packed or not. Elsewhere (no AMX, a probe that
differs: one info line) bf16 keeps ``F.linear`` and fp32 packing is unaffected. The tests that need AMX skip without
it; the gate's tests run on any CPU.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from tiny_models import PAD, build_tiny, left_pad, prompts

from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.modules import Linear, cpu_packed, onednn_layout

pytestmark = pytest.mark.usefixtures("one_thread")
needs_bf16 = pytest.mark.skipif(
    not cpu_packed.bf16_available(), reason="bf16 packing needs AMX and oneDNN's packed linear (not this CPU)"
)


@pytest.fixture
def pack_all(monkeypatch):
    """Pack every weight of a tiny model (their sizes are below the production threshold)."""
    monkeypatch.setenv(cpu_packed.ENV_VAR, "1")
    monkeypatch.setattr(cpu_packed, "MIN_ELEMENTS", 0)


@pytest.fixture
def reprobe(monkeypatch):
    """Probe again under the test's patches, and once more (unpatched) afterwards for later tests."""
    monkeypatch.setattr(cpu_packed, "_bf16_available", None)
    yield
    monkeypatch.undo()
    cpu_packed._bf16_available = None
    cpu_packed.sync()


def _linear(out_f: int, in_f: int, bias: bool, k_major: bool, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) * 0.1).to(torch.bfloat16)
    if k_major:
        w = w.t().contiguous().t()  # [out, in] stored input-major, as gemm_layout may give
    b = torch.randn(out_f, generator=g).to(torch.bfloat16) if bias else None
    return Linear(torch.nn.Parameter(w, requires_grad=False), None if b is None else torch.nn.Parameter(b, False))


@needs_bf16
@pytest.mark.parametrize("out_f,in_f", [(40, 24), (136, 96), (97, 131), (211, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k_major", [False, True])
def test_bf16_packed_equals_f_linear_bitwise(out_f, in_f, bias, k_major, pack_all):
    lin = _linear(out_f, in_f, bias, k_major)
    g = torch.Generator().manual_seed(1)
    for rows in (cpu_packed.MIN_ROWS, 5, 13, cpu_packed.MAX_ROWS):
        for x in (
            torch.randn(rows, in_f, generator=g).to(torch.bfloat16),  # [B, C]: the LM head's input
            torch.randn(rows, 1, in_f, generator=g).to(torch.bfloat16),  # [B, 1, C]: a decode step's
            torch.randn(rows, 1, in_f + 7, generator=g).to(torch.bfloat16)[..., 3 : 3 + in_f],  # non-contiguous
        ):
            with torch.no_grad():
                got = lin(x)
            assert cpu_packed.applies(x, lin.weight, lin), f"{rows} rows of bf16 did not take the packed path"
            assert got.dtype == torch.bfloat16 and got.shape == (*x.shape[:-1], out_f)
            # F.linear over a strided bf16 input adds the bias after rounding the product (a second rounding); the
            # packed op, like F.linear over a contiguous input, adds it in the fp32 accumulator.
            want = F.linear(x.contiguous(), lin.weight, lin.bias)
            assert torch.equal(got, want), f"{rows} rows differ from F.linear"
    pack = cpu_packed._packs[cpu_packed.ensure_slot(lin)]
    held = sum(int(torch.ops.mkldnn._nbytes(c)) for c in pack.chunks)
    assert pack.dtype == torch.bfloat16 and cpu_packed.packed_bytes(lin) == held >= out_f * in_f * 2


@needs_bf16
def test_bf16_weight_changes_and_chunks_repack(pack_all, monkeypatch):
    """A bf16 weight above CHUNK_BYTES is packed in row chunks sized in bf16 bytes; a change through ``.data`` plus
    ``repack`` (the Hybrid Engine's switch) and a cast to fp32 both give exact products again."""
    monkeypatch.setattr(cpu_packed, "CHUNK_BYTES", 64 * 64 * 2)  # 64 bf16 rows of 64 inputs: 211 rows -> 4 chunks
    lin = _linear(211, 64, bias=True, k_major=False)
    x = torch.randn(6, 1, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        pack = cpu_packed._packs[cpu_packed.ensure_slot(lin)]
        assert pack.bounds == [(0, 64), (64, 128), (128, 192), (192, 211)]
        first = [torch.ops.mkldnn.data_ptr(c) for c in pack.chunks]
        for _ in range(2):  # the second re-pack writes where the first verified the layout
            lin.weight.data.copy_(torch.randn(211, 64).to(torch.bfloat16))  # invisible to the version counter
            assert cpu_packed.repack(lin, only_packed=True)
            assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        pack = cpu_packed._packs[cpu_packed.ensure_slot(lin)]
        assert onednn_layout.layout(64, 64, torch.bfloat16) is not None, "AMX's bf16 layout of a 64x64 block"
        for (a, b), chunk, ptr in zip(pack.bounds, pack.chunks, first):  # in place wherever the layout is a view
            if onednn_layout.layout(b - a, 64, torch.bfloat16) is not None:
                assert torch.ops.mkldnn.data_ptr(chunk) == ptr, f"rows {a}-{b} were not re-packed in place"
        lin.weight = torch.nn.Parameter(lin.weight.float(), requires_grad=False)  # same shape, another dtype
        lin.bias = torch.nn.Parameter(lin.bias.float(), requires_grad=False)
        x32 = x.float()
        torch.testing.assert_close(lin(x32), F.linear(x32, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        assert cpu_packed._packs[cpu_packed.ensure_slot(lin)].dtype == torch.float32


@needs_bf16
def test_bf16_model_generates_the_same_logits_packed_or_not(pack_all, monkeypatch):
    """An injected bf16 model decoding 4 rows: greedy tokens and every step's logits equal with packing off."""
    import hf_dsinfer

    ids, mask = left_pad(prompts((5, 9, 3, 7)))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
              output_logits=True, return_dict_in_generate=True)  # fmt: skip
    model = hf_dsinfer.init_inference(
        build_tiny("llama", seed=0).to(torch.bfloat16),
        {"dtype": "bf16", "replace_with_kernel_inject": True, "max_out_tokens": 40, "max_batch_size": 4},
    )
    packed = model.generate(**kw)
    assert cpu_packed.packed_bytes(model) > 0, "the batch-4 bf16 decode steps did not pack"
    monkeypatch.setenv(cpu_packed.ENV_VAR, "0")
    plain = model.generate(**kw)
    assert torch.equal(packed.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(packed.logits, plain.logits)), "packed bf16 logits differ"


@pytest.mark.parametrize("how", ["no_amx", "probe_differs"])
def test_bf16_stays_on_f_linear_without_amx_or_an_exact_probe(how, pack_all, reprobe, monkeypatch, caplog):
    if not cpu_packed.available():
        pytest.skip("oneDNN packed linear unavailable here")
    if how == "no_amx":
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    else:
        try:  # oneDNN's bf16 linear needs AVX-512 (or AVX-NE-CONVERT); without it the probe just finds no op
            torch.ops.mkldnn._linear_pointwise(
                torch.ones(4, 32, dtype=torch.bfloat16),
                torch.ops.mkldnn._reorder_linear_weight(torch.ones(32, 32, dtype=torch.bfloat16), None),
                None, "none", [], "",
            )  # fmt: skip
        except Exception:  # noqa: BLE001 - any failure means: no bf16 linear on this machine
            pytest.skip("oneDNN's bf16 linear does not run on this CPU")
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
        real = torch.ops.mkldnn._linear_pointwise

        def off_by_a_bit(x, w, b, *args):  # a kernel that rounds differently from F.linear
            y = real(x, w, b, *args)
            return y * 1.01 if y.dtype == torch.bfloat16 else y

        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", off_by_a_bit)
    lin = _linear(136, 96, bias=True, k_major=False)
    x = torch.randn(8, 1, 96).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME), torch.no_grad():
        for _ in range(3):
            assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert not cpu_packed.applies(x, lin.weight, lin) and not cpu_packed.bf16_available()
    lines = [r.getMessage() for r in caplog.records]
    if how == "no_amx":
        assert not lines, lines  # nothing to say: bf16 packing was never meant for this CPU
    else:
        assert len(lines) == 1 and "bf16" in lines[0] and "F.linear" in lines[0], lines
    x32, w32 = x.float(), torch.nn.Parameter(lin.weight.float(), requires_grad=False)
    lin32 = Linear(w32, torch.nn.Parameter(lin.bias.float(), requires_grad=False))
    assert cpu_packed.applies(x32, lin32.weight, lin32), "fp32 packing must not depend on the bf16 gate"
