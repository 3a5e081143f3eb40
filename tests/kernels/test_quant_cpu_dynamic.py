"""The activation-quantized int8 decode GEMV (kernels/quant_cpu_dynamic.py): one compiled decode row of a per-channel
int8 weight packed with ``int8_activations=True`` equals the exact dequantized weight times the activations rounded
to uint8 per row (fbgemm's dynamic quantization, recomputed here in plain torch); several rows, eager calls and packs
without the flag stay exact; ``HF_DSINFER_QUANT_INT8_ACTIVATIONS=0`` turns it off; ``prepack_cpu`` flags the LM head
only."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from hf_dsinfer.kernels import quant_cpu_dynamic
from hf_dsinfer.kernels.quant_cpu import cpu_quant_matmul, pack_for_cpu
from hf_dsinfer.kernels.quant_format import QuantSpec, quant_matmul_reference, quantize_weight
from tiny_models import save_tiny

import hf_dsinfer  # noqa: F401  (registers inference_config)
from hf_dsinfer.modules.quant_linear import QuantLinear, prepack_cpu

pytestmark = pytest.mark.skipif(not quant_cpu_dynamic.enabled(), reason="fbgemm's dynamic int8 linear is not here")

K = 96
SPEC = QuantSpec(8, K, True)  # int8, symmetric, per channel


def _packed(n=40, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, K, generator=gen) / K**0.5  # [N, K]
    q, s, z = quantize_weight(w, SPEC, scale_dtype=torch.float32)
    return q, s, z, pack_for_cpu(q, s, z, SPEC, K, kind="fp16gemm", **kw)


def _u8_per_row(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """``x [M, K]`` rounded as fbgemm's dynamic quantization does: uint8, scale and zero point from the row's range
    (widened to include 0)."""
    qmax = 2**bits - 1
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / qmax
    zero = torch.round(-lo / scale).clamp(0, qmax)
    return (torch.clamp(torch.round(x / scale) + zero, 0, qmax) - zero) * scale


def _compiled(packed):
    torch._dynamo.reset()
    return torch.compile(lambda x: cpu_quant_matmul(x, packed), fullgraph=True)


@torch.no_grad()
def test_one_compiled_row_multiplies_uint8_activations():
    q, s, z, packed = _packed(int8_activations=True)
    assert packed.dynamic is not None
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(1)) * 3  # [1, K]
    got = _compiled(packed)(x)  # [1, N]
    bits = 7 if quant_cpu_dynamic.reduce_range_needed() else 8
    want = quant_matmul_reference(_u8_per_row(x, bits), q, s, z, SPEC, K)  # the same rounded activations, exact weights
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    exact = quant_matmul_reference(x, q, s, z, SPEC, K)
    assert not torch.equal(got, exact)  # the activations really were rounded (not the exact loop)
    rel = float((got - exact).abs().max() / exact.abs().max())
    assert rel < 0.05  # 256 levels per row: about 1e-2


@torch.no_grad()
def test_several_rows_and_eager_calls_stay_exact():
    q, s, z, packed = _packed(int8_activations=True)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2))  # [3, K]: a batch shares no activation scale
    want = quant_matmul_reference(x, q, s, z, SPEC, K)
    torch.testing.assert_close(_compiled(packed)(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_quant_matmul(x[:1], packed), want[:1], rtol=1e-5, atol=1e-5)  # eager


@torch.no_grad()
def test_not_built_without_the_flag_for_groups_or_when_turned_off(monkeypatch):
    assert _packed()[-1].dynamic is None  # the default: exact
    grouped = QuantSpec(8, 32, True)
    q, s, z = quantize_weight(torch.randn(16, K), grouped, scale_dtype=torch.float32)
    assert pack_for_cpu(q, s, z, grouped, K, kind="fp16gemm", int8_activations=True).dynamic is None
    monkeypatch.setenv(quant_cpu_dynamic.ACTIVATIONS_ENV, "0")
    assert _packed(int8_activations=True)[-1].dynamic is None


def test_deep_copy_packs_the_dynamic_weight_again():
    _, _, _, packed = _packed(int8_activations=True)
    clone = copy.deepcopy(packed)
    assert clone.dynamic is not None and clone.dynamic.slot != packed.dynamic.slot
    x = torch.randn(1, K)
    torch.testing.assert_close(_compiled(clone)(x), _compiled(packed)(x))


@torch.no_grad()
def test_prepack_flags_the_quantized_head_only(tmp_path):
    path = save_tiny("llama", tmp_path, tie_word_embeddings=True)
    cfg = {"dtype": "fp32", "quant": {"enabled": True, "weight": {"num_bits": 8, "lm_head": True}}}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
    prepack_cpu(model)
    flagged = {name for name, m in model.named_modules() if isinstance(m, QuantLinear) and m.int8_activations}
    assert flagged == {"lm_head"}
    head = model.get_output_embeddings()
    assert head.cpu_packed().dynamic is not None
    body = next(m for m in model.modules() if isinstance(m, QuantLinear) and m is not head)
    assert body.cpu_packed().dynamic is None


def test_packing_leaves_the_quantized_engine_as_it_was():
    before = torch.backends.quantized.engine
    _, _, _, packed = _packed(int8_activations=True)
    assert torch.backends.quantized.engine == before
    x = torch.randn(1, K)
    assert torch.isfinite(_compiled(packed)(x)).all()
