"""``quant.weight.zero_point="float"``: asymmetric grids spanning each group's exact [min, max] (GGUF Q4_1's layout).

The stored format is the one of every quantized weight (``w = (q - z) * s``); only ``z`` may be fractional. Weights
that already lie on such a grid (a Q4_1 checkpoint) come back to fp32 rounding; the real-model check is
tests/test_quant_real.py::test_float_zero_point_reproduces_the_q4_1_weights.
"""

import pytest
import torch
from hf_dsinfer.kernels.quant_cpu import default_kind, pack_for_cpu, supported_kinds
from hf_dsinfer.kernels.quant_format import QuantSpec, dequantize_weight, quant_matmul_reference, quantize_weight
from tiny_models import load_pair, prompts

from hf_dsinfer.integration.quant_config import parse_quant

FLOAT_ZERO = {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric", "zero_point": "float"}}


def _on_grid(n: int, k: int, group: int, levels: int, seed: int = 0) -> torch.Tensor:
    """A weight ``[N, K]`` on a per-group grid ``min + code * step`` (codes 0..levels-1, both ends used), as GGUF's
    Q4_1 stores it: fp16 step and min, arbitrary (not step-aligned) minima."""
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    step = (torch.rand(n, groups, 1, generator=g) * 0.02 + 0.001).half().float()  # [N, G, 1]
    low = (torch.randn(n, groups, 1, generator=g) * 0.05 - 7 * step).half().float()
    codes = torch.randint(0, levels, (n, groups, group), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, levels - 1  # the grid's min and max occur
    return (low + codes * step).reshape(n, k)


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 64), (8, 32)])
def test_float_zero_reproduces_weights_on_a_grid(bits, group):
    w = _on_grid(24, 192, group, 16 if bits == 4 else 256)
    spec = QuantSpec(bits, group, symmetric=False, float_zero=True)
    q, s, z = quantize_weight(w, spec, torch.float32)
    back = dequantize_weight(q, s, z, spec, w.shape[1], torch.float32)
    assert (back - w).abs().max() <= 1e-6 * w.abs().max()  # fp32 rounding only
    assert not torch.equal(z, z.round())  # the minima are not multiples of the step: the zero points are fractional
    # the integer zero point cannot: it rounds min to a multiple of the step (up to half a step per weight)
    iq, is_, iz = quantize_weight(w, QuantSpec(bits, group, symmetric=False), torch.float32)
    assert (dequantize_weight(iq, is_, iz, QuantSpec(bits, group, False), w.shape[1]) - w).abs().max() > 1e-4


def test_float_zero_rounds_to_nearest_on_random_weights():
    w = torch.randn(40, 200, generator=torch.Generator().manual_seed(1))
    spec = QuantSpec(4, 64, symmetric=False, float_zero=True)
    q, s, z = quantize_weight(w, spec, torch.float32)
    back = dequantize_weight(q, s, z, spec, w.shape[1], torch.float32)
    step = s.repeat_interleave(64, dim=1)[:, :200]  # [N, K]
    assert ((back - w).abs() <= 0.5 * step * (1 + 1e-5)).all()  # never more than half a step off


def test_cpu_kinds_with_a_float_zero():
    spec = QuantSpec(4, 32, symmetric=False, float_zero=True)
    assert "fp16gemm_exact" not in supported_kinds(spec, 96)  # its integers q - z do not exist
    assert default_kind(spec, 96) == "dequant" and default_kind(QuantSpec(8, 96, False, True), 96) == "dequant"
    w = torch.randn(20, 96, generator=torch.Generator().manual_seed(2))
    q, s, z = quantize_weight(w, spec, torch.float32)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(3))
    want = quant_matmul_reference(x, q, s, z, spec, 96)
    from hf_dsinfer.kernels.quant_cpu import cpu_quant_matmul

    for kind in supported_kinds(spec, 96):
        packed = pack_for_cpu(q, s, z, spec, 96, kind=kind)
        got = cpu_quant_matmul(x, packed)
        tol = 2e-3 if packed.kind == "fp16gemm" else 1e-5  # fp16gemm rounds (q - z) * s to fp16 and says so
        assert packed.kind != "fp16gemm" or not packed.exact
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_setting_parsed_saved_and_refused():
    settings = parse_quant(FLOAT_ZERO)
    assert settings.float_zero and settings.spec_for(96).float_zero
    assert settings.to_dict()["weight"]["zero_point"] == "float"
    assert parse_quant(settings.to_dict()) == settings
    assert "zero_point" not in parse_quant({"weight": {"num_bits": 4, "q_type": "asymmetric"}}).to_dict()["weight"]
    assert "float zero point" in settings.describe()
    with pytest.raises(ValueError, match=r"zero_point='float' needs quant.weight.q_type='asymmetric'"):
        parse_quant({"weight": {"num_bits": 4, "zero_point": "float"}})
    with pytest.raises(ValueError, match=r"quant.weight.zero_point must be 'integer' or 'float'"):
        parse_quant({"weight": {"num_bits": 4, "q_type": "asymmetric", "zero_point": "fractional"}})
    with pytest.raises(ValueError, match="asymmetric"):
        QuantSpec(4, 32, symmetric=True, float_zero=True)


@torch.no_grad()
def test_float_zero_model_equals_its_dequantized_weights_and_reloads(tmp_path):
    import transformers

    hf, model, path = load_pair("llama", tmp_path / "src", {"dtype": "fp32", "quant": FLOAT_ZERO,
                                                            "replace_with_kernel_inject": False})  # fmt: skip
    lin = model.model.layers[0].self_attn.q_proj
    assert lin.spec.float_zero and not torch.equal(lin.weight_zeros, lin.weight_zeros.round())
    ids = torch.tensor(prompts((7,))[0])[None]
    want = model(input_ids=ids).logits
    # the same as HF's model with every quantized weight replaced by its dequantized value
    for name, module in model.named_modules():
        if type(module).__name__ == "QuantLinear":
            deq = dequantize_weight(module.weight, module.weight_scales, module.weight_zeros, module.spec,
                                    module.in_features, torch.float32)  # fmt: skip
            hf.get_submodule(name).weight.copy_(deq)
    torch.testing.assert_close(want, hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "saved")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert again.config.quantization_config.quant_settings.float_zero
    assert torch.equal(again(input_ids=ids).logits, want)


@pytest.mark.parametrize("inject", [True, False], ids=["injected", "hf"])
@torch.no_grad()
def test_bf16_model_keeps_fp32_zero_points_through_save_and_reload(tmp_path, inject):
    import transformers
    from tiny_models import save_tiny

    path = save_tiny("llama", tmp_path / "src")
    cfg = {"dtype": "bf16", "quant": FLOAT_ZERO, "replace_with_kernel_inject": inject}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
    ids = torch.tensor(prompts((6,))[0])[None]
    want = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "saved")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for m in (model, again):
        zeros = [mod.weight_zeros for mod in m.modules() if type(mod).__name__ == "QuantLinear"]
        assert zeros and all(z.dtype == torch.float32 for z in zeros)  # bf16 would round z by up to 1/32 of a step
    got = again(input_ids=ids).logits
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
