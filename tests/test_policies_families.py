"""The families added for issue 17 (gemma, olmo2, granite, starcoder2, gptj, ...) beyond the fidelity table.

The fidelity table (``tests/test_fidelity.py``) proves each row against HF eager through ``from_pretrained``. Here,
per row: the save path (``hf_state_dict`` gives back HF's exact names and values, so ``save_pretrained`` of an
injected model reloads anywhere), config variants the rows do not cover, and the variants a policy does not fuse,
which must keep HF's modules with exactly one warning naming the variant.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers
from tiny_models import PAD, build_tiny, prompts, tiny_config

from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.policies import hf_state_dict, inject, is_injected


class Cfg:
    max_out_tokens, max_batch_size, injection_policy = 64, 4, None


# The fidelity rows this file covers; each gets the save-path check.
ROWS = [
    "gemma", "olmo2", "granite", "starcoder2", "gptj", "gemma3_text", "cohere", "glm4", "gpt_neo", "roberta",
    "distilbert", "bloom",
]

# Config variants the rows do not cover: (row, overrides), compared with HF like a row.
VARIANTS: dict[str, tuple[str, dict]] = {
    "olmo2-mha-bias": ("olmo2", dict(num_key_value_heads=6, attention_bias=True)),
    "starcoder2-no-bias-full-attention": ("starcoder2", dict(use_bias=False, sliding_window=None)),
    "gptj-full-head-rotary": ("gptj", dict(rotary_dim=16, activation_function="gelu")),
    "gemma3_text-default-layer-pattern": (
        "gemma3_text",
        dict(num_hidden_layers=3, layer_types=None, sliding_window_pattern=2, attn_logit_softcapping=20.0),
    ),
    # only sliding layers: HF's rotary module then holds no full-attention frequencies
    "gemma3_text-sliding-only": ("gemma3_text", dict(layer_types=None, rope_parameters=None, sliding_window_pattern=6)),
    "glm4-full-rotary-no-bias": ("glm4", dict(partial_rotary_factor=1.0, attention_bias=False)),
    "gpt_neo-local-first": ("gpt_neo", dict(attention_types=[[["local", "global"], 1]], window_size=4)),
    "bloom-8-heads": ("bloom", dict(hidden_size=128, n_head=8, pretraining_tp=2)),
}

# Variants a policy does not fuse: (row, overrides, text the warning must contain).
FALLBACKS: dict[str, tuple[str, dict, str]] = {
    "gemma-quick-gelu": ("gemma", dict(hidden_act="quick_gelu"), "hidden_act='quick_gelu'"),
    "gemma3_text-bidirectional": (
        "gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"
    ),
    "cohere-qk-norm": ("cohere", dict(use_qk_norm=True), "use_qk_norm=True"),
    "bloom-residual-after-norm": (
        "bloom", dict(apply_residual_connection_post_layernorm=True), "apply_residual_connection_post_layernorm=True"
    ),
    "bloom-slow-but-exact": ("bloom", dict(pretraining_tp=2, slow_but_exact=True), "slow_but_exact=True"),
    "gptj-quick-gelu": ("gptj", dict(activation_function="quick_gelu"), "activation_function='quick_gelu'"),
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


@pytest.mark.parametrize("name", ROWS)
@torch.no_grad()
def test_saved_state_dict_is_plain_hf(name):
    reference, fused = _pair(name, {})
    assert is_injected(fused)
    ref_sd, got_sd = reference.state_dict(), hf_state_dict(fused)
    assert set(got_sd) == set(ref_sd)
    for key, value in ref_sd.items():
        assert torch.equal(got_sd[key], value), key


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_variant_matches_hf(variant):
    name, overrides = VARIANTS[variant]
    reference, fused = _pair(name, overrides)
    assert is_injected(fused)
    batch = prompts()
    ids = torch.tensor([batch[1]])
    mask = torch.ones_like(ids)
    torch.testing.assert_close(
        fused(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits, atol=1e-4, rtol=1e-4
    )
    assert torch.equal(_greedy(fused, ids, mask), _greedy(reference, ids, mask))


@pytest.mark.parametrize("variant", list(FALLBACKS))
@torch.no_grad()
def test_unfused_variant_keeps_hf_modules_with_one_warning(variant, caplog, monkeypatch):
    monkeypatch.setattr("hf_dsinfer.log._WARNED", set())
    name, overrides, reason = FALLBACKS[variant]
    ids = torch.tensor([prompts()[0]])
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        for _ in range(2):
            model = build_tiny(name, **overrides)
            expect = model(ids).logits
            assert inject(model, Cfg()) is model and not is_injected(model)
            torch.testing.assert_close(model(ids).logits, expect, atol=0, rtol=0)
    warnings = [r.getMessage() for r in caplog.records if "keeps HF's own modules" in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0], warnings


@pytest.mark.parametrize(
    "head", ["RobertaForSequenceClassification", "RobertaForMaskedLM", "DistilBertForMaskedLM",
             "DistilBertForTokenClassification"],
)
@torch.no_grad()
def test_encoder_heads_run_on_fused_layers(head):
    """Every encoder head calls the base model, so it runs on fused layers; a right-padded batch matches HF."""
    row = "roberta" if head.startswith("Roberta") else "distilbert"
    torch.manual_seed(0)
    reference = getattr(transformers, head)(tiny_config(row)).eval()
    fused = inject(copy.deepcopy(reference), Cfg())
    assert is_injected(fused)
    batch = prompts()
    width = max(len(p) for p in batch)
    ids = torch.tensor([p + [PAD] * (width - len(p)) for p in batch])
    mask = (torch.arange(width)[None] < torch.tensor([len(p) for p in batch])[:, None]).long()
    got, want = fused(input_ids=ids, attention_mask=mask).logits, reference(input_ids=ids, attention_mask=mask).logits
    for i, p in enumerate(batch):  # per-token heads: the real tokens; sequence heads: the whole row
        g, w = (got[i, : len(p)], want[i, : len(p)]) if got.ndim == 3 else (got[i], want[i])
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="output_attentions"):
        fused(input_ids=ids, attention_mask=mask, output_attentions=True)


def test_alibi_layers_keep_hf_modules_under_tensor_parallelism():
    """ALiBi slopes depend on the global head index: without AutoTP's record of which heads a rank holds (an
    attention it did not split), the fused layer cannot offset them and HF's modules stay."""
    from hf_dsinfer.policies import POLICIES, TPLayout
    from hf_dsinfer.policies.base import as_source

    model = build_tiny("bloom")
    policy, prefix = POLICIES["bloom"], "transformer.h.0"
    layer = model.transformer.h[0]
    spec = policy.layer_spec(model, 0, layer)
    wmap = {k: as_source(v) for k, v in policy.weight_map(model, 0, layer).items() if v is not None}
    layout = TPLayout(
        heads={f"{prefix}.self_attention.dense": (6, 6)},
        row_parallel=frozenset({f"{prefix}.self_attention.dense", f"{prefix}.mlp.dense_4h_to_h"}),
        column_parallel=frozenset({f"{prefix}.self_attention.query_key_value", f"{prefix}.mlp.dense_h_to_4h"}),
        reduce=lambda t: t,
    )
    reason = layout.check("transformer.h", model.transformer.h[:1], [spec], [wmap])
    assert reason is not None and "ALiBi" in reason


@pytest.mark.parametrize("name", ["granite", "bloom", "gpt_neo"])
@torch.no_grad()
def test_caller_given_inputs_embeds_get_what_hf_applies(name):
    """granite's embedding multiplier, bloom's embedding LayerNorm and gpt_neo's positions apply to inputs_embeds."""
    reference, fused = _pair(name, {})
    ids = torch.tensor([prompts()[0]])
    embeds = reference.get_input_embeddings()(ids)
    torch.testing.assert_close(
        fused(inputs_embeds=embeds).logits, reference(inputs_embeds=embeds).logits, atol=1e-4, rtol=1e-4
    )


def test_spec_fields_are_checked():
    from hf_dsinfer.modules import AttentionSpec, LayerSpec, MLPSpec, NormSpec

    with pytest.raises(ValueError, match="alibi_slopes"):
        AttentionSpec(4, 4, 16, 0.25, rotary=False, alibi_slopes=(0.5, 0.25))
    attention = AttentionSpec(4, 4, 16, 0.25)
    with pytest.raises(ValueError, match="residual_scale"):
        LayerSpec(attention, MLPSpec(), NormSpec(), residual="parallel", residual_scale=0.5)
