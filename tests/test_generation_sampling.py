"""Sampling, processors, scores and the requests that fall back to transformers' loop.

Sampled tokens cannot equal transformers' (a different, sync-free draw), so sampling is checked through its parts:
the processed scores equal transformers' processors on the same logits, draws are reproducible under
``torch.manual_seed`` and follow the filtered distribution; greedy with penalties equals transformers exactly.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import PAD, VOCAB, left_pad, load_pair, prompts
from transformers import GenerationConfig, LogitsProcessorList

from hf_dsinfer.generation import last_generate_stats
from hf_dsinfer.generation.processors import DecodePlan, StepProcessor, plan_decoding

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 64}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    ref, opt, _ = load_pair("llama", tmp_path_factory.mktemp("llama"), INJECT)
    return ref, opt


def _hf_processors(model, ids, mask, **gen):
    """transformers' own processors and criteria for ``gen``, as generate would build them."""
    cfg, _ = model._prepare_generation_config(GenerationConfig(pad_token_id=PAD, **gen))
    model._prepare_special_tokens(cfg, True, device=ids.device)
    procs = model._get_logits_processor(
        generation_config=cfg, input_ids_seq_length=ids.shape[1], encoder_input_ids=ids,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=ids.device,
        model_kwargs={"attention_mask": mask},
    )  # fmt: skip
    crit = model._get_stopping_criteria(generation_config=cfg, stopping_criteria=transformers.StoppingCriteriaList())
    return procs, crit


@pytest.mark.parametrize(
    "gen",
    [
        dict(do_sample=True, top_k=7),
        dict(do_sample=True, top_p=0.8, temperature=0.7),
        dict(do_sample=True, min_p=0.05, top_k=0),
        dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.4),
        dict(do_sample=False, repetition_penalty=0.7, min_new_tokens=3, eos_token_id=[5, 9]),
    ],
)
def test_processed_scores_match_hf_processors(models, gen):
    ref, _ = models
    ids, mask = left_pad(prompts())
    procs, crit = _hf_processors(ref, ids, mask, max_new_tokens=8, **gen)
    plan = plan_decoding(procs, crit, gen["do_sample"])
    assert not isinstance(plan, str), plan
    g = torch.Generator().manual_seed(0)
    seq = ids
    proc = StepProcessor(plan, ids, VOCAB, None)
    for step in range(3):  # the penalty's seen-token mask and the min-new-tokens floor evolve with the steps
        logits = torch.randn(ids.shape[0], VOCAB, generator=g) * 3
        want = procs(seq, logits.clone())
        got = proc.warp(proc.process(logits, step))
        assert torch.equal(torch.isinf(got), torch.isinf(want)), "different tokens removed"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        tok = torch.randint(3, VOCAB, (ids.shape[0],), generator=g)
        proc.observe(tok)
        seq = torch.cat([seq, tok[:, None]], dim=1)


def test_unsupported_processors_are_named(models):
    ref, _ = models
    ids, mask = left_pad(prompts())
    procs, crit = _hf_processors(ref, ids, mask, max_new_tokens=8, no_repeat_ngram_size=2)
    assert plan_decoding(procs, crit, False) == "logits processor NoRepeatNGramLogitsProcessor"


def test_seeded_sampling_is_reproducible(models):
    _, opt = models
    ids, mask = left_pad(prompts())
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=True, top_k=50,
              top_p=0.95, temperature=0.9, pad_token_id=PAD, num_return_sequences=2)  # fmt: skip
    torch.manual_seed(123)
    a = opt.generate(**kw)
    torch.manual_seed(123)
    b = opt.generate(**kw)
    c = opt.generate(**kw)
    assert a.shape == (6, ids.shape[1] + 10) and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, : ids.shape[1]], ids.repeat_interleave(2, dim=0))  # num_return_sequences expands rows
    assert last_generate_stats(opt).path == "fast"


def test_draws_follow_the_filtered_distribution(models):
    _, opt = models
    plan = DecodePlan(do_sample=True, top_k=3, max_length=8)
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0]]).repeat(4000, 1)
    proc = StepProcessor(plan, torch.zeros(4000, 1, dtype=torch.long), 5, torch.Generator().manual_seed(0))
    counts = torch.bincount(proc.select(proc.warp(proc.process(logits, 0))), minlength=5).float() / 4000
    want = torch.tensor([2.0, 1.0, float("-inf"), 3.0, float("-inf")]).softmax(-1)
    torch.testing.assert_close(counts, want, atol=0.03, rtol=0)


def test_scores_and_logits_like_hf(models):
    ref, opt = models
    ids, mask = left_pad(prompts())
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, repetition_penalty=1.3,
              return_dict_in_generate=True, output_scores=True, output_logits=True, pad_token_id=PAD)  # fmt: skip
    want, got = ref.generate(**kw), opt.generate(**kw)
    assert type(got) is type(want) and torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == len(got.logits) == 6
    for a, b in zip(got.scores + got.logits, want.scores + want.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_beam_search_runs_hf_loop_and_equals_hf(models):
    ref, opt = models
    ids, mask = left_pad(prompts())
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=2, do_sample=False, pad_token_id=PAD)
    assert torch.equal(opt.generate(**kw), ref.generate(**kw))
    assert last_generate_stats(opt).path == "hf"


def test_user_processor_runs_hf_loop(models):
    ref, opt = models
    ids, mask = left_pad(prompts())

    class Ban7(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores.index_fill(1, torch.tensor([7]), float("-inf"))

    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
              logits_processor=LogitsProcessorList([Ban7()]))  # fmt: skip
    assert torch.equal(opt.generate(**kw), ref.generate(**kw))
    assert last_generate_stats(opt).path == "hf"
    # a generation-config processor the fast loop lacks also falls back (inside the loop)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
              no_repeat_ngram_size=2)  # fmt: skip
    assert torch.equal(opt.generate(**kw), ref.generate(**kw))
    assert last_generate_stats(opt).path == "hf"


def test_sampled_batch_under_eos(models):
    _, opt = models
    ids, mask = left_pad(prompts())
    torch.manual_seed(0)
    out = opt.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=3,
                       eos_token_id=list(range(3, 60)), pad_token_id=PAD)  # fmt: skip
    new = out[:, ids.shape[1]:]
    for row in new:  # after a row's first EOS, only padding follows
        hits = [(i, t) for i, t in enumerate(row.tolist()) if 3 <= t < 60]
        if hits:
            assert (row[hits[0][0] + 1:] == PAD).all()


def test_eos_floor_in_place_only_when_owned(models):
    """min_new_tokens masks its EOS ids by column (ids outside the vocabulary ignored, as transformers' ``isin``
    ignores them): a new tensor unless the caller owns the logits (the fast loop's step output), then in place."""
    ref, _ = models
    ids, mask = left_pad(prompts())
    procs, crit = _hf_processors(ref, ids, mask, max_new_tokens=8, do_sample=False, min_new_tokens=3,
                                 eos_token_id=[5, 9, VOCAB + 3])  # fmt: skip
    plan = plan_decoding(procs, crit, False)
    assert not isinstance(plan, str), plan
    proc = StepProcessor(plan, ids, VOCAB, None)
    logits = torch.randn(ids.shape[0], VOCAB, generator=torch.Generator().manual_seed(0))
    want = procs(ids, logits.clone())
    kept = logits.clone()
    got = proc.process(logits, 0)
    assert torch.equal(logits, kept) and got is not logits, "not owned: the caller's logits stay as they were"
    assert torch.equal(got, want)
    owned = proc.process(logits, 0, owned=True)
    assert owned is logits and torch.equal(owned, want)
    assert torch.equal(proc.process(kept, 3, owned=True), kept), "past min_new_tokens nothing is masked"
