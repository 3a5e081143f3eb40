"""Prefix sharing on the fast loop: repeated rows (GRPO's ``repeat_interleave``d prompts) and
``num_return_sequences > 1`` prefill each distinct prompt once and copy its KV rows into the repeats. Tokens equal the
run without sharing (and HF's greedy ``generate``); ``prefill_tokens_computed`` is the distinct prompts' tokens, in
the injected model's generate stats and in ``HybridStats``."""

from __future__ import annotations

import pytest
import torch
from tiny_models import PAD, build_tiny, left_pad, prompts

from hf_dsinfer.generation import loop
from hf_dsinfer.generation.stats import last_generate_stats
from hf_dsinfer.hybrid import HybridEngine

LENGTHS = (5, 9, 3)
G = 4  # completions per prompt


@pytest.fixture(scope="module")
def setup():
    model = build_tiny("llama", seed=0)
    he = HybridEngine(model, inference_config={"max_out_tokens": 64, "max_batch_size": 16, "cpu_compile": False})
    ids, mask = left_pad(prompts(LENGTHS))
    return model, he, ids, mask


def _run(he, share: bool, monkeypatch, **gen):
    monkeypatch.setattr(loop, "SHARE_PREFILL", share)
    torch.manual_seed(7)
    with he.inference():
        out = he.generate(**gen)
    return out, last_generate_stats(he.module), he.stats.last


@pytest.mark.parametrize("do_sample", [False, True])
def test_repeat_interleaved_rows_prefill_once(setup, monkeypatch, do_sample):
    model, he, ids, mask = setup
    gen = dict(input_ids=ids.repeat_interleave(G, 0), attention_mask=mask.repeat_interleave(G, 0), max_new_tokens=6,
               do_sample=do_sample, pad_token_id=PAD)  # fmt: skip
    shared, stats, it = _run(he, True, monkeypatch, **gen)
    alone, stats_alone, _ = _run(he, False, monkeypatch, **gen)
    assert torch.equal(shared, alone), "sharing the prefill changes no token (the seeded draws included)"
    assert stats.path == "fast"
    assert (stats.prompt_tokens_total, stats.prefill_tokens_computed) == (G * sum(LENGTHS), sum(LENGTHS))
    assert (it.prompt_tokens, it.prefill_tokens_computed) == (G * sum(LENGTHS), sum(LENGTHS))
    assert stats_alone.prefill_tokens_computed == G * sum(LENGTHS)
    if not do_sample:
        assert torch.equal(shared, model.generate(**gen))


def test_num_return_sequences_prefill_once(setup, monkeypatch):
    _, he, ids, mask = setup
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=0, pad_token_id=PAD,
               num_return_sequences=G, output_scores=True, return_dict_in_generate=True)  # fmt: skip
    shared, stats, _ = _run(he, True, monkeypatch, **gen)
    alone, _, _ = _run(he, False, monkeypatch, **gen)
    assert torch.equal(shared.sequences, alone.sequences)
    for a, b in zip(shared.scores, alone.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert (stats.prompt_tokens_total, stats.prefill_tokens_computed) == (G * sum(LENGTHS), sum(LENGTHS))


def test_mixed_rows_and_unpadded(setup, monkeypatch):
    """Rows repeated out of order, and one distinct row: only the distinct prompts are prefilled."""
    model, he, ids, mask = setup
    order = torch.tensor([2, 0, 2, 1, 0, 2])
    gen = dict(input_ids=ids[order], attention_mask=mask[order], max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    shared, stats, _ = _run(he, True, monkeypatch, **gen)
    assert torch.equal(shared, model.generate(**gen))
    assert stats.prefill_tokens_computed == sum(LENGTHS)
    same = torch.tensor([prompts((6,))[0]] * 3)  # no attention mask at all
    out, stats, _ = _run(he, True, monkeypatch, input_ids=same, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, model.generate(input_ids=same, max_new_tokens=4, do_sample=False, pad_token_id=PAD))
    assert (stats.prompt_tokens_total, stats.prefill_tokens_computed) == (18, 6)
