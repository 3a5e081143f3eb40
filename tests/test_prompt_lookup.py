"""Prompt-lookup decoding on the fused layers (generation/speculative.py) against HF's plain greedy.

The proposals only change how many forwards run, never the tokens. A random tiny model rarely repeats its prompt, so
besides real lookups the tests feed proposals that are fully right (greedy's own continuation), fully wrong, and
right for a while, which exercises accepting, rejecting and rolling the static cache back.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import PAD, load_pair, prompts, save_tiny

from hf_dsinfer import hf_compat
from hf_dsinfer.generation import last_generate_stats, speculative

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 96}
NEW = 14


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    ref, opt, _ = load_pair("llama", tmp_path_factory.mktemp("llama"), INJECT)
    return ref, opt


def _greedy(model, ids, **kw):
    return model.generate(input_ids=ids, do_sample=False, pad_token_id=PAD, **{"max_new_tokens": NEW, **kw})


@pytest.fixture(scope="module")
def case(models):
    ref, _ = models
    ids = torch.tensor([prompts((7,))[0] * 3])  # a repeated prompt: lookups find matches
    return ids, _greedy(ref, ids)


def test_propose_takes_the_latest_longest_match():
    assert speculative.propose([1, 2, 3, 9, 1, 2, 4, 8, 1, 2], k=2, max_ngram=2) == [4, 8]  # latest "1 2"
    assert speculative.propose([5, 6, 7, 6], k=3, max_ngram=2) == [7, 6]  # no "7 6" before: the 1-gram "6"
    assert speculative.propose([1, 2, 3], k=2, max_ngram=2) == []


def test_lookup_equals_plain_greedy(models, case):
    _, opt = models
    ids, want = case
    got = _greedy(opt, ids, prompt_lookup_num_tokens=4)
    assert torch.equal(got, want)
    assert last_generate_stats(opt).path == "fast+lookup"


@pytest.mark.parametrize("mode", ["right", "wrong", "partly"])
def test_accepting_and_rejecting_proposals_keeps_greedy_tokens(models, case, monkeypatch, mode):
    _, opt = models
    ids, want = case
    truth = want[0].tolist()
    forwards = []

    def propose(seq, k, max_ngram):
        forwards.append(k)
        follow = truth[len(seq) : len(seq) + k]
        if mode == "wrong":
            return [(t + 1) % 500 for t in follow]
        if mode == "partly":
            return follow[:2] + [(t + 1) % 500 for t in follow[2:]]
        return follow

    monkeypatch.setattr(speculative, "propose", propose)
    out = _greedy(opt, ids, prompt_lookup_num_tokens=5, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    if mode == "right":  # five proposals accepted per forward: a handful of forwards for 14 tokens
        assert len(forwards) <= 3
    cache = hf_compat.output_cache(out)
    assert cache.get_seq_length() == want.shape[1] - 1  # as plain greedy leaves it: the last token is not cached


def test_eos_inside_accepted_proposals_stops_there(models, case, monkeypatch):
    ref, opt = models
    ids, want = case
    truth = want[0].tolist()
    width = ids.shape[1]
    eos = truth[width + 4]  # the fifth new token ends the sequence
    want_eos = _greedy(ref, ids, eos_token_id=eos)
    monkeypatch.setattr(speculative, "propose", lambda seq, k, n: truth[len(seq) : len(seq) + k])
    out = _greedy(opt, ids, eos_token_id=eos, prompt_lookup_num_tokens=6, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want_eos)
    assert hf_compat.output_cache(out).get_seq_length() == want_eos.shape[1] - 1


def test_continuing_after_lookup_equals_hf(models, case):
    ref, opt = models
    ids, _ = case
    key = hf_compat.cache_kwarg()
    a_ref = _greedy(ref, ids, max_new_tokens=5, return_dict_in_generate=True)
    a_opt = _greedy(opt, ids, max_new_tokens=5, prompt_lookup_num_tokens=3, return_dict_in_generate=True)
    assert torch.equal(a_ref.sequences, a_opt.sequences)
    b_ref = _greedy(ref, a_ref.sequences, max_new_tokens=4, **{key: hf_compat.output_cache(a_ref)})
    b_opt = _greedy(opt, a_opt.sequences, max_new_tokens=4, **{key: hf_compat.output_cache(a_opt)})
    assert torch.equal(b_opt, b_ref)


def test_requests_lookup_cannot_serve(models, case):
    """A batch of two (plain fast loop, same tokens) and sampling (transformers' assisted loop)."""
    ref, opt = models
    ids, want = case
    two = torch.cat([ids, ids])
    assert torch.equal(_greedy(opt, two, prompt_lookup_num_tokens=3), torch.cat([want, want]))
    assert last_generate_stats(opt).path == "fast"
    torch.manual_seed(0)
    opt.generate(input_ids=ids, do_sample=True, max_new_tokens=4, prompt_lookup_num_tokens=3, pad_token_id=PAD)
    assert last_generate_stats(opt).path == "hf"


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_draft_model_equals_plain_greedy(models, case, tmp_path, seed):
    """assistant_model= a fused draft: the same weights (every proposal accepted) or other weights (most rejected)."""
    ref, opt = models
    ids, want = case
    draft_path = save_tiny("llama", tmp_path / "draft", seed=seed)
    draft = transformers.AutoModelForCausalLM.from_pretrained(draft_path, inference_config=INJECT).eval()
    out = _greedy(opt, ids, assistant_model=draft, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert last_generate_stats(opt).path == "fast+draft"
    assert hf_compat.output_cache(out).get_seq_length() == want.shape[1] - 1
    eos = int(want[0, ids.shape[1] + 6])
    assert torch.equal(_greedy(opt, ids, assistant_model=draft, eos_token_id=eos), _greedy(ref, ids, eos_token_id=eos))
    assert torch.equal(_greedy(draft, ids), _greedy(draft, ids))  # the draft still generates on its own afterwards
