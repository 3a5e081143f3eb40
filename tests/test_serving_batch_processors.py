"""``generate_batch`` on fused layers honours what HF's ``generate`` honours: per request, transformers' own logits
processors in generate's order (min_new_tokens, min_length, no_repeat_ngram_size, bad_words_ids, suppress_tokens,
begin_suppress_tokens, sequence_bias, forced BOS / EOS, stop_strings with ``tokenizer=``); each request's greedy tokens
equal HF ``generate`` of that request alone. The sampling-only warpers (typical_p, epsilon_cutoff, eta_cutoff) keep
every drawn token inside the set HF's warper keeps. Beam and contrastive search stay refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import PAD, load_pair, prompts
from transformers.generation import logits_process as lp
from transformers.generation.continuous_batching import RequestStatus

import hf_dsinfer  # noqa: F401 - registers inference_config=

pytestmark = pytest.mark.usefixtures("one_thread")

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 64}
N = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """HF eager model, injected model, tokenizer, a batch of prompts (one of a single token, for forced BOS) and each
    prompt's free greedy tokens."""
    ref, opt, path = load_pair("llama", tmp_path_factory.mktemp("llama"), INJECT)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    batch = prompts((1, 5, 9, 14), seed=21)
    free = [alone(ref, p, config()) for p in batch]
    return ref, opt, tok, batch, free


def config(**kw) -> transformers.GenerationConfig:
    return transformers.GenerationConfig(**{"max_new_tokens": N, "do_sample": False, "pad_token_id": PAD,
                                            "eos_token_id": -1, **kw})  # fmt: skip


def alone(ref, prompt: list[int], cfg, **kw) -> list[int]:
    """HF generate of ``prompt`` alone (a single row ends where it finishes: nothing to trim)."""
    ids = torch.tensor([prompt])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **kw)
    return out[0, len(prompt) :].tolist()


# Each case: GenerationConfig settings, from the prompts' free greedy tokens (so that each one changes something).
CASES = {
    "min_new_tokens": lambda free: dict(eos_token_id=free[1][2], min_new_tokens=7),
    "min_length": lambda free: dict(eos_token_id=[free[2][1], free[3][0]], min_length=12),
    "no_repeat_ngram_size": lambda free: dict(no_repeat_ngram_size=1),
    "bad_words_ids": lambda free: dict(bad_words_ids=[[free[0][1]], [free[1][0], free[1][1]], [free[3][2]]]),
    "suppress_tokens": lambda free: dict(suppress_tokens=[free[0][0], free[2][3]]),
    "begin_suppress_tokens": lambda free: dict(begin_suppress_tokens=[free[1][0], free[3][0]]),
    "sequence_bias": lambda free: dict(sequence_bias=[[[free[2][0]], -5.0], [[free[1][0], free[1][1]], -5.0]]),
    "forced_bos_token_id": lambda free: dict(forced_bos_token_id=7),
    "forced_eos_token_id": lambda free: dict(forced_eos_token_id=9, eos_token_id=9),
    "exponential_decay_length_penalty": lambda free: dict(exponential_decay_length_penalty=(2, 1.6),
                                                          eos_token_id=[free[1][6], free[3][7]]),  # fmt: skip
    "with_repetition_penalty": lambda free: dict(no_repeat_ngram_size=2, repetition_penalty=1.3,
                                                 sequence_bias=[[[free[0][0]], 2.0]]),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_generate_batch_greedy_equals_generate_alone(setup, case):
    ref, opt, _, batch, free = setup
    cfg = config(**CASES[case](free))
    got = opt.generate_batch(batch, generation_config=cfg)
    assert list(got) == [f"req_{i}" for i in range(len(batch))]
    changed = 0
    for i, prompt in enumerate(batch):
        out = got[f"req_{i}"]
        assert out.status == RequestStatus.FINISHED and out.error is None, out.error
        want = alone(ref, prompt, cfg)
        assert out.generated_tokens == want, f"{case}: req_{i}"
        changed += want != free[i]
    assert changed, f"{case} should change some request's greedy tokens"


def test_stop_strings_need_the_tokenizer_and_stop_like_generate(setup):
    ref, opt, tok, batch, free = setup
    text = tok.decode(free[2][:6])
    stop = text[len(tok.decode(free[2][:3])) :][:3]  # a piece of request 2's text after its third token
    assert stop.strip(), "a visible stop string"
    cfg = config(stop_strings=[stop, "\x00never"])
    refused = opt.generate_batch(batch, generation_config=cfg)
    assert all(o.status == RequestStatus.FAILED and "tokenizer" in o.error for o in refused.values())
    got = opt.generate_batch(batch, generation_config=cfg, tokenizer=tok)
    for i, prompt in enumerate(batch):
        assert got[f"req_{i}"].generated_tokens == alone(ref, prompt, cfg, tokenizer=tok), f"req_{i}"
    assert len(got["req_2"].generated_tokens) < N and stop in tok.decode(got["req_2"].generated_tokens)


def test_min_new_tokens_equal_to_max_new_tokens_runs_every_request_to_the_end(setup):
    ref, opt, _, batch, free = setup
    eos = [free[1][1], free[2][2], free[3][0]]  # without min_new_tokens these stop early
    short = opt.generate_batch(batch, generation_config=transformers.GenerationConfig(max_new_tokens=48,
                                                                                      eos_token_id=eos))
    assert any(len(o.generated_tokens) < 48 for o in short.values())
    for cfg in (transformers.GenerationConfig(max_new_tokens=48, min_new_tokens=48),
                transformers.GenerationConfig(max_new_tokens=48, min_new_tokens=48, eos_token_id=eos)):  # fmt: skip
        got = opt.generate_batch(batch, generation_config=cfg)
        assert all(o.status == RequestStatus.FINISHED and len(o.generated_tokens) == 48 for o in got.values())
    assert got["req_1"].generated_tokens == alone(ref, batch[1], cfg)


WARPERS = {
    "typical_p": (dict(typical_p=0.3), lambda: lp.TypicalLogitsWarper(mass=0.3)),
    "epsilon_cutoff": (dict(epsilon_cutoff=0.0021), lambda: lp.EpsilonLogitsWarper(epsilon=0.0021)),
    "eta_cutoff": (dict(eta_cutoff=0.9), lambda: lp.EtaLogitsWarper(epsilon=0.9)),
}


@pytest.mark.parametrize("case", list(WARPERS))
def test_sampling_warpers_keep_every_token_in_hfs_set(setup, case):
    ref, opt, _, batch, _ = setup
    settings, warper = WARPERS[case]
    torch.manual_seed(0)
    got = opt.generate_batch(batch, generation_config=config(do_sample=True, top_k=0, **settings))
    kept_fraction = []
    for i, prompt in enumerate(batch):
        tokens = got[f"req_{i}"].generated_tokens
        assert len(tokens) == N
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()  # [N, V]
        for step, token in enumerate(tokens):
            kept = torch.isfinite(warper()(None, logits[step : step + 1])[0])
            assert kept[token], f"{case}: req_{i} drew token {token} at step {step}, outside HF's set"
            kept_fraction.append(kept.float().mean().item())
    # the set is small enough that 48 draws all inside it by chance (without the warper) is out of the question
    assert sum(kept_fraction) / len(kept_fraction) < 0.7


def test_beam_and_contrastive_search_are_refused_by_name(setup):
    ref, opt, _, batch, free = setup
    for settings, name in ((dict(num_beams=2), "beam search"), (dict(penalty_alpha=0.6, top_k=4), "contrastive")):
        got = opt.generate_batch(batch[:2], generation_config=config(**settings))
        assert all(o.status == RequestStatus.FAILED and name in o.error for o in got.values()), name
    greedy_lookup = opt.generate_batch(batch, generation_config=config(prompt_lookup_num_tokens=3))
    assert [o.generated_tokens for o in greedy_lookup.values()] == free, "greedy prompt lookup gives greedy's tokens"


def test_manager_requests_take_per_request_settings(setup):
    _, opt, _, batch, _ = setup
    manager = opt.init_continuous_batching(generation_config=config(do_sample=True, top_k=0))
    manager.start()
    try:
        ids = [manager.add_request(batch[1], max_new_tokens=6, seed=5, logprobs=1) for _ in range(2)]
        ids.append(manager.add_request(batch[1], max_new_tokens=6, seed=6))
        outs = {}
        while len(outs) < 3:
            out = manager.get_result(timeout=60)
            assert out is not None
            outs[out.request_id] = out.generated_tokens
    finally:
        manager.stop()
    assert outs[ids[0]] == outs[ids[1]] != outs[ids[2]], "the same seed, the same tokens; another seed, others"
