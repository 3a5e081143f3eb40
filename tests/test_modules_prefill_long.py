"""Prompts long enough for the CPU prefill paths (oneDNN GEMM, split gated MLP, in-place rotary rows) through the
fused layers of the families they reach, against HF's eager model: every real position's logits.

tests/test_fidelity.py runs prompts of 3-9 tokens, below ``cpu_gemm.MIN_ROWS`` / ``mlp.SPLIT_MIN_ROWS`` rows.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import left_pad, prompts, save_tiny
from tolerances import MODEL_LOGITS_TOL

import hf_dsinfer  # noqa: F401  (registers inference_config)
from hf_dsinfer.modules import cpu_gemm
from hf_dsinfer.modules.mlp import SPLIT_MIN_ROWS, FusedMLP
from hf_dsinfer.policies import is_injected

# Gated MLPs (silu; gelu_tanh with gemma), qkv bias, fused gate_up checkpoints, a sliding window shorter than the
# prompt, post-block norms; plain MLPs with bias in a parallel residual (gpt_neox) and ALiBi without rotary (bloom).
FAMILIES = ["llama", "qwen2", "phi3", "gemma", "mistral", "olmo2", "gpt_neox", "bloom"]
GATED = {"llama", "qwen2", "phi3", "gemma", "mistral", "olmo2"}
LENGTHS = (2 * SPLIT_MIN_ROWS, SPLIT_MIN_ROWS + 7)  # a left-padded batch of two, both rows above the thresholds


@pytest.mark.parametrize("name", FAMILIES)
@torch.no_grad()
def test_long_prompt_logits_match_hf(name, tmp_path, monkeypatch):
    path = save_tiny(name, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    optimized = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config={"dtype": "fp32"}).eval()
    assert is_injected(optimized)

    splits, onednn = [], []
    split, gemm = FusedMLP._split_gated, cpu_gemm.linear
    monkeypatch.setattr(FusedMLP, "_split_gated", lambda self, x: splits.append(1) or split(self, x))

    def counting_gemm(x, weight, bias=None):
        onednn.append(cpu_gemm.applies(x, weight))
        return gemm(x, weight, bias)

    monkeypatch.setattr(cpu_gemm, "linear", counting_gemm)

    tol = MODEL_LOGITS_TOL[torch.float32]
    ids, mask = left_pad(prompts(LENGTHS))  # [2, T]
    got = optimized(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [2, T, V]
    want = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], **tol)  # padding positions are unspecified in both

    one = ids[1:, -LENGTHS[1]:]  # the shorter prompt alone, unpadded: the is_causal SDPA path
    got = optimized(input_ids=one, attention_mask=torch.ones_like(one), use_cache=False).logits
    torch.testing.assert_close(got, reference(input_ids=one, use_cache=False).logits, **tol)

    assert bool(splits) == (name in GATED), "gated MLPs take the split path at these lengths (and only they)"
    assert any(onednn) == cpu_gemm.available(), "the layers' products take oneDNN where it is available"
