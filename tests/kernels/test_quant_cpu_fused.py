"""The compiled decode path of the ``dequant`` kind (kernels/quant_cpu.py, ``_fuse_dequant``): under torch.compile a
matmul of a few rows dequantizes as it reduces instead of writing an fp32 weight; it must compute the reference's
``x @ dequant(w).T`` (up to fp32 summation order) for every grid it serves, the Q4_1 grid first."""

from __future__ import annotations

import pytest
import torch
from hf_dsinfer.kernels import quant_cpu
from hf_dsinfer.kernels.quant_cpu import pack_for_cpu
from hf_dsinfer.kernels.quant_format import QuantSpec, quant_matmul_reference, quantize_weight
from quant_layer import QuantMatmulLayer

EXACT = dict(rtol=1e-5, atol=1e-5)  # fp32 summation order only

SPECS = {
    "int4-g32-float-zero": QuantSpec(4, 32, False, float_zero=True),  # GGUF Q4_1's grid
    "int4-g32-integer-zero": QuantSpec(4, 32, False),
    "int4-g64-symmetric": QuantSpec(4, 64, True),
    "int8-g32-float-zero": QuantSpec(8, 32, False, float_zero=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("rows", [1, 3, 6])  # 6 rows: beyond FUSED_DEQUANT_MAX_ROWS, the dequantize-then-linear path
def test_compiled_fused_dequant_matches_reference(name, rows, monkeypatch):
    spec, k, n = SPECS[name], 100, 48  # K not a multiple of the group: padded columns meet zero activations
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(n, k, generator=g) * 0.05 + torch.rand(n, 1, generator=g) * 0.02  # rows with an offset (zero)
    q, s, z = quantize_weight(w, spec)
    packed = pack_for_cpu(q, s, z, spec, k, kind="dequant")
    bias = torch.randn(n, generator=g)
    calls = []
    real = quant_cpu._fuse_dequant
    monkeypatch.setattr(quant_cpu, "_fuse_dequant", lambda p, r: calls.append(real(p, r)) or calls[-1])
    x = torch.randn(rows, k, generator=g)
    torch._dynamo.reset()
    got = torch.compile(QuantMatmulLayer(packed, bias), fullgraph=True)(x)
    want = quant_matmul_reference(x, q, s, z, spec, k, bias)
    torch.testing.assert_close(got, want, **EXACT)
    assert calls == [rows <= quant_cpu.FUSED_DEQUANT_MAX_ROWS]  # traced once; the fused branch only for few rows
    assert not quant_cpu._fuse_dequant(packed, 1)  # eager: never (it would materialize [M, N, K])


@pytest.mark.slow
@pytest.mark.parametrize("spec", [QuantSpec(8, 96, True), QuantSpec(8, 96, False), QuantSpec(8, 32, True)])
@pytest.mark.parametrize("rows", [1, 6])
def test_compiled_fp16gemm_int8_reads_the_integers(spec, rows, monkeypatch):
    # int8 weights packed for fbgemm: a compiled matmul of a few rows reduces over the stored int8 values (1 byte per
    # weight) instead of calling fbgemm on the fp16 pack; more rows call fbgemm. Both are the reference.
    from hf_dsinfer.kernels.quant_cpu import fbgemm_available

    if not fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    g = torch.Generator().manual_seed(rows)
    q, s, z = quantize_weight(torch.randn(40, 96, generator=g) * 0.05, spec)
    packed = pack_for_cpu(q, s, z, spec, 96, kind="fp16gemm" if spec.group_size == 96 else "fp16gemm_exact")
    assert packed.fused and packed.fused[0] is q  # the stored integers themselves, no copy
    fbgemm_calls = []
    real = quant_cpu._fp16_weight_linear
    monkeypatch.setattr(quant_cpu, "_fp16_weight_linear", lambda *a: fbgemm_calls.append(1) or real(*a))
    bias = torch.randn(40, generator=g)
    x = torch.randn(rows, 96, generator=g)
    torch._dynamo.reset()
    got = torch.compile(QuantMatmulLayer(packed, bias), fullgraph=True)(x)
    torch.testing.assert_close(got, quant_matmul_reference(x, q, s, z, spec, 96, bias), **EXACT)
    if rows <= quant_cpu.FUSED_DEQUANT_MAX_ROWS:
        assert not fbgemm_calls
    elif spec.group_size == 96:  # per channel; with groups, 6 rows x 3 groups dequantize once instead
        assert fbgemm_calls


@pytest.mark.slow
@torch.no_grad()
def test_compiled_decode_step_with_the_q4_1_grid_equals_eager(tmp_path, monkeypatch):
    """End to end: a tiny llama with int4 groups of 32 and float zeros (the fused path, behind the materialize
    barrier) generates in the compiled step exactly the tokens of the eager step, at batch 1 and 3."""
    import os
    import sys

    from transformers import AutoModelForCausalLM

    from hf_dsinfer.integration.engine import init_inference

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tiny_models import save_tiny

    folder = save_tiny("llama", tmp_path / "tiny")
    quant = {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric", "group_size": 32,
                                         "zero_point": "float"}}  # fmt: skip

    def run(compile_mode: str, ids: torch.Tensor) -> torch.Tensor:
        monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", compile_mode)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model = init_inference(model, quant=quant, dtype="fp32", replace_with_kernel_inject=True, max_batch_size=4,
                               keep_module_on_host=True, max_out_tokens=40, cpu_compile=True).module  # fmt: skip
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             min_new_tokens=12, do_sample=False, pad_token_id=0)  # fmt: skip
        if compile_mode == "sync":
            from hf_dsinfer.generation.api import GEN_ATTR

            compiled = getattr(model, GEN_ATTR).step.compiled
            assert compiled.compile_s and not compiled.failed, "the decode step did not run compiled"
        return out

    batch3 = torch.randint(3, 400, (3, 6), generator=torch.Generator().manual_seed(1))
    for ids in (torch.tensor([[5, 9, 13, 2, 7]]), batch3):
        assert torch.equal(run("sync", ids), run("0", ids))
