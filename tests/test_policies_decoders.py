"""gpt2, gpt_neox, opt and falcon policies on the config variants the fidelity rows do not cover.

Each variant is a tiny model built in memory, injected in place and compared with an untouched copy (HF eager):
logits, a few greedy tokens, and ``hf_state_dict`` giving back HF's exact tensors (the save path). Variants the fused
layers cannot reproduce must keep HF's modules with exactly one warning.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from tiny_models import PAD, build_tiny, prompts

from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.policies import hf_state_dict, inject, is_injected


class Cfg:
    max_out_tokens, max_batch_size, injection_policy = 64, 4, None


VARIANTS = {
    "gpt2-scale-flags": ("gpt2", dict(scale_attn_weights=False, scale_attn_by_inverse_layer_idx=True)),
    "gpt2-relu-bias": ("gpt2", dict(activation_function="relu")),
    "gpt_neox-sequential": ("gpt_neox", dict(use_parallel_residual=False, rotary_pct=0.5, attention_bias=False)),
    "opt-post-norm-projections": ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=64)),
    "opt-no-bias": ("opt", dict(enable_bias=False)),
    "falcon-interleaved-sequential": ("falcon", dict(multi_query=False, parallel_attn=False, bias=True)),
    "falcon-new-shared-norm": ("falcon_new", dict(num_ln_in_parallel_attn=1, parallel_attn=True)),
}


def _pair(name: str, overrides: dict):
    reference = build_tiny(name, **overrides)
    fused = inject(copy.deepcopy(reference), Cfg())
    return reference, fused


def _greedy(model, ids, mask, n=6):
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=PAD
    )
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_variant_matches_hf(variant):
    name, overrides = VARIANTS[variant]
    reference, fused = _pair(name, overrides)
    assert is_injected(fused)
    ids = torch.tensor([prompts()[1]])
    mask = torch.ones_like(ids)
    torch.testing.assert_close(fused(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits,
                               atol=1e-4, rtol=1e-4)  # fmt: skip
    assert torch.equal(_greedy(fused, ids, mask), _greedy(reference, ids, mask))
    # The save path: packed tensors split back into exactly HF's names and values.
    ref_sd, got_sd = reference.state_dict(), hf_state_dict(fused)
    assert set(got_sd) == set(ref_sd)
    for key, value in ref_sd.items():
        assert torch.equal(got_sd[key], value), key


@pytest.mark.parametrize("name", ["gpt2", "opt"])
@torch.no_grad()
def test_learned_positions_with_inputs_embeds(name):
    """HF adds learned positions (and opt's project_in) to caller-given inputs_embeds too."""
    overrides = {"word_embed_proj_dim": 64} if name == "opt" else {}
    reference, fused = _pair(name, overrides)
    ids = torch.tensor([prompts()[0]])
    embeds = reference.get_input_embeddings()(ids)
    torch.testing.assert_close(fused(inputs_embeds=embeds).logits, reference(inputs_embeds=embeds).logits,
                               atol=1e-4, rtol=1e-4)  # fmt: skip


@torch.no_grad()
def test_opt_positions_follow_the_mask_like_hf():
    """Without position_ids, OPT derives positions from the mask: a left-padded row equals HF's on real tokens."""
    reference, fused = _pair("opt", {})
    ids = torch.tensor([[PAD, PAD, 5, 17, 42, 99]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    ref = reference(ids, attention_mask=mask).logits[:, 2:]
    torch.testing.assert_close(fused(ids, attention_mask=mask).logits[:, 2:], ref, atol=1e-4, rtol=1e-4)


FALLBACKS = {
    "gpt2": (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
    "falcon": (dict(alibi=True), "alibi=True"),
    "opt": (dict(layer_norm_elementwise_affine=False), "layer_norm_elementwise_affine"),
    "gpt_neox": (dict(hidden_act="quick_gelu"), "hidden_act='quick_gelu'"),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
@torch.no_grad()
def test_unsupported_config_keeps_hf_modules_with_one_warning(name, caplog, monkeypatch):
    monkeypatch.setattr("hf_dsinfer.log._WARNED", set())
    overrides, reason = FALLBACKS[name]
    ids = torch.tensor([prompts()[0]])
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        for _ in range(2):
            model = build_tiny(name, **overrides)
            expect = model(ids).logits
            assert inject(model, Cfg()) is model and not is_injected(model)
            torch.testing.assert_close(model(ids).logits, expect, atol=0, rtol=0)
    warnings = [r.getMessage() for r in caplog.records if "keeps HF's own modules" in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0], warnings
