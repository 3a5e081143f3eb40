"""The generic path: HF's modules with hf_dsinfer's static-cache attention, for architectures without a policy.

Oracle: the same weights on plain transformers (eager / SDPA, dynamic cache). Logits at real positions within the
fp32 tolerance, greedy tokens identical, each row of a left-padded batch identical to the prompt run alone.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import PAD, left_pad, prompts
from tolerances import MODEL_LOGITS_TOL

import hf_dsinfer
from hf_dsinfer.generation import install_generate
from hf_dsinfer.generation.stats import last_generate_stats
from hf_dsinfer.policies import get_injection
from hf_dsinfer.policies.generic import get_generic, install_generic

NEW = 10
_COMMON = dict(vocab_size=500, num_hidden_layers=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1,
               eos_token_id=2, hidden_size=96, intermediate_size=136, num_attention_heads=6, num_key_value_heads=2)
# smollm3: no policy, NoPE on some layers (rotary applied by HF's modules, per layer). gemma3_text: sliding and global
# layers with their own rope bases, qk-norm, final logit soft-capping (installed directly: it may have a policy).
CONFIGS = {
    "smollm3": dict(no_rope_layer_interval=2),
    "gemma3_text": dict(head_dim=16, sliding_window=4, final_logit_softcapping=30.0, layer_types=None),
    "ministral": dict(sliding_window=4, head_dim=16),
    "phi": dict(partial_rotary_factor=0.5),
    "olmo3": dict(sliding_window=4),
}


def _pair(model_type: str):
    config = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **CONFIGS[model_type]})
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict(ref.state_dict())
    return ref, model


def _greedy(model, ids, mask):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         pad_token_id=PAD)
    return out[:, ids.shape[1]:]


def _check_matches_hf(ref, model):
    ids, mask = left_pad(prompts())
    with torch.no_grad():
        want, got = ref(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], **MODEL_LOGITS_TOL[torch.float32])
    greedy = _greedy(model, ids, mask)
    assert last_generate_stats(model).path == "fast"
    assert torch.equal(greedy, _greedy(ref, ids, mask))
    for row, p in enumerate(prompts()):  # padded batch == each prompt alone
        alone = _greedy(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
        assert torch.equal(alone[0], greedy[row]), f"row {row} differs from its single run"


@torch.no_grad()
def test_model_without_policy_takes_the_generic_path(tmp_path):
    ref, model = _pair("smollm3")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, inference_config={"dtype": "fp32"})
    assert get_injection(loaded) is None and get_generic(loaded) is not None
    assert loaded.config._attn_implementation == "hf_dsinfer_static"
    _check_matches_hf(ref, loaded)


@torch.no_grad()
def test_sliding_layers_and_logit_softcap_on_the_generic_path():
    ref, model = _pair("gemma3_text")
    cfg = hf_dsinfer.InferenceConfig(dtype="fp32", max_out_tokens=64)
    assert install_generic(model, cfg) is None
    install_generate(model, cfg, get_generic(model))
    _check_matches_hf(ref, model)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["ministral", "phi", "olmo3"])
@torch.no_grad()
def test_more_families_without_policy_match_hf(model_type):
    ref, model = _pair(model_type)
    cfg = hf_dsinfer.InferenceConfig(dtype="fp32", max_out_tokens=64)
    assert install_generic(model, cfg) is None
    install_generate(model, cfg, get_generic(model))
    _check_matches_hf(ref, model)


@torch.no_grad()
def test_hf_loop_requests_run_on_the_static_cache():
    """Beam search goes through transformers' loop, which calls the generic forward with its cache handle."""
    ref, model = _pair("smollm3")
    cfg = hf_dsinfer.InferenceConfig(dtype="fp32", max_out_tokens=64)
    assert install_generic(model, cfg) is None
    install_generate(model, cfg, get_generic(model))
    ids = torch.tensor([prompts()[1]])
    kw = dict(max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=PAD)
    assert torch.equal(model.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw))


def test_ineligible_model_keeps_hf_modules_with_the_reason():
    """XGLM's attention computes its own scores (no AttentionInterface, 5.17 through 5.24): it keeps HF's path, with
    the reason. (GPT-J was the example until transformers 5.24 moved it onto the AttentionInterface.)"""
    config = transformers.AutoConfig.for_model("xglm", vocab_size=500, d_model=96, attention_heads=6, num_layers=1,
                                               ffn_dim=128)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    reason = install_generic(model, hf_dsinfer.InferenceConfig(dtype="fp32"))
    assert reason == "its attention modules do not call transformers' AttentionInterface"
    assert get_generic(model) is None and "forward" not in model.__dict__
