"""Per-request sampling inside the serving engine (hf_dsinfer/serving/sampling.py), against HF's eager model: seeds
(the same tokens alone, among other requests and after preemption), OpenAI's penalties and logit_bias, min_tokens /
ignore_eos / stop_token_ids, structured-output masks, log-probs of generated and prompt tokens, and refusals."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import load_pair, prompts

import hf_dsinfer  # noqa: F401 - registers inference_config=
from hf_dsinfer.serving import ServingEngine
from hf_dsinfer.serving.requests import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 64}
ATOL = 1e-4  # fp32 log-probs: fused layers vs HF eager


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ref, opt, _ = load_pair("llama", tmp_path_factory.mktemp("llama"), INJECT)
    return ref, opt


def config(n: int = 10, eos: int | list[int] = -1, **kw) -> transformers.GenerationConfig:
    return transformers.GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=eos, **kw)


def sampled(n: int = 10, **kw) -> transformers.GenerationConfig:
    return transformers.GenerationConfig(max_new_tokens=n, do_sample=True, top_k=0, eos_token_id=-1, **kw)


@torch.no_grad()
def hf_logits(ref, ids: list[int]) -> torch.Tensor:
    """HF eager's fp32 logits ``[L, V]`` of every position of ``ids``."""
    return ref(torch.tensor([ids])).logits[0].float()


def hf_greedy_loop(ref, prompt: list[int], n: int, process) -> list[int]:
    """Greedy decoding on HF eager's logits after ``process(logits [V], generated so far)``."""
    out: list[int] = []
    for _ in range(n):
        logits = hf_logits(ref, prompt + out)[-1]
        out.append(int(process(logits.clone(), out).argmax()))
    return out


def run(engine: ServingEngine, *requests) -> list:
    handles = [engine.submit(p, c, **kw) for p, c, kw in requests]
    engine.run_until_idle()
    return handles


# -- seeds ---------------------------------------------------------------------------------------------------------


def test_a_seeded_request_is_the_same_alone_among_others_and_after_preemption(pair):
    _, opt = pair
    batch = prompts((9, 14, 6, 11), seed=3)
    settings = [dict(seed=11), dict(seed=12, logprobs=2), dict(seed=13), dict(seed=14, presence_penalty=0.5)]
    hot = sampled(12, temperature=0.9, top_p=0.95)
    alone = [run(ServingEngine(opt, block_size=4), (p, hot, kw))[0].tokens for p, kw in zip(batch, settings)]
    # together, with an unseeded sampled request and a greedy one in the same steps
    engine = ServingEngine(opt, block_size=4, max_batch_tokens=16)
    extra = [(batch[0], hot, {}), (batch[1], config(12), {})]
    together = run(engine, *[(p, hot, kw) for p, kw in zip(batch, settings)], *extra)
    assert [h.tokens for h in together[:4]] == alone
    # a cache too small for all four at once: decode growth preempts, and the preempted ones recompute
    small = ServingEngine(opt, block_size=4, num_blocks=10, max_batch_tokens=16)
    preempted = run(small, *[(p, hot, kw) for p, kw in zip(batch, settings)])
    assert small.stats.preemptions > 0
    assert [h.tokens for h in preempted] == alone
    other = run(ServingEngine(opt, block_size=4), (batch[0], hot, dict(seed=99)))[0]
    assert other.tokens != alone[0], "another seed gives other tokens"
    assert len(set(alone[0])) > 3, "temperature 0.9 on a near-flat model: a varied draw"


# -- penalties and logit_bias against OpenAI's formula on HF eager logits ------------------------------------------


def openai_reference(prompt, presence=0.0, frequency=0.0, bias=(), repetition=1.0):
    """What the engine must do to HF eager's logits: transformers' repetition penalty (prompt + generated), then
    OpenAI's ``logit -= frequency * count + presence * (count > 0)`` over the generated tokens, then logit_bias."""

    def process(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        if repetition != 1.0:
            ids = torch.tensor(prompt + generated)
            logits = transformers.RepetitionPenaltyLogitsProcessor(repetition)(ids[None], logits[None])[0]
        for token in set(generated):
            count = generated.count(token)
            logits[token] -= frequency * count + presence * (count > 0)
        for token, value in bias:
            logits[token] += value
        return logits

    return process


def test_penalties_and_logit_bias_follow_openai_per_request(pair):
    ref, opt = pair
    batch = prompts((5, 9, 7, 6), seed=2)
    plain = [hf_greedy_loop(ref, p, 12, lambda x, g: x) for p in batch]
    cases = [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=0.05, presence_penalty=-0.02),
        dict(logit_bias=((plain[2][1], -5.0), (77, 0.04), (plain[2][0], 0.01))),
        dict(repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    engine = ServingEngine(opt, block_size=4)
    handles = run(engine, *[(p, config(12), kw) for p, kw in zip(batch, cases)])
    for prompt, kw, handle, free in zip(batch, cases, handles, plain):
        bias = kw.get("logit_bias", ())
        process = openai_reference(prompt, kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0), bias,
                                   kw.get("repetition_penalty", 1.0))  # fmt: skip
        want = hf_greedy_loop(ref, prompt, 12, process)
        assert handle.tokens == want, kw
        assert want != free, f"{kw} should change greedy's path on this model"


# -- when a request stops ------------------------------------------------------------------------------------------


def test_min_tokens_ignore_eos_and_stop_token_ids(pair):
    ref, opt = pair
    prompt = prompts((6,), seed=5)[0]
    free = hf_greedy_loop(ref, prompt, 16, lambda x, g: x)
    eos = free[2]  # greedy meets it at its third token
    engine = ServingEngine(opt, block_size=4)
    stops, at_min, ignoring, stop_id, biased, biased_min = run(
        engine,
        (prompt, config(16, eos), {}),
        (prompt, config(16, eos), dict(min_tokens=6)),
        (prompt, config(16, eos), dict(ignore_eos=True)),
        (prompt, config(16), dict(stop_token_ids=[free[4]])),  # a list, as callers pass it
        (prompt, config(16, eos), dict(logit_bias={eos: 100.0})),  # a dict, as OpenAI's field
        (prompt, config(16, eos), dict(logit_bias=((eos, 100.0),), min_tokens=3)),
    )
    assert stops.tokens == free[:3] and stops.finish_reason == "stop" and stops.stop_reason is None
    # min_tokens is HF's min_new_tokens: EOS masked for the first 6 tokens
    hf_min = ref.generate(torch.tensor([prompt]), generation_config=config(16, eos, min_new_tokens=6))[0, 6:].tolist()
    end = next((k + 1 for k, t in enumerate(hf_min) if t == eos), len(hf_min))
    assert at_min.tokens == hf_min[:end] and eos not in at_min.tokens[:6]
    assert ignoring.tokens == free and ignoring.finish_reason == "length" and eos in ignoring.tokens
    assert stop_id.tokens == free[:5] and stop_id.finish_reason == "stop" and stop_id.stop_reason == free[4]
    assert biased.tokens == [eos] and biased.finish_reason == "stop"
    assert len(biased_min.tokens) == 4 and biased_min.tokens[3] == eos and eos not in biased_min.tokens[:3]


# -- structured-output constraints (the matcher protocol of SamplingParams.constraint) ----------------------------


class _Allowed:
    """A test constraint: ``allowed_ids(i)`` are the tokens allowed at step ``i``; terminated after ``length``."""

    def __init__(self, allowed_ids, length: int | None = None):
        self.allowed_ids, self.length = allowed_ids, length

    def matcher(self):
        return _Matcher(self)


class _Matcher:
    def __init__(self, spec: _Allowed):
        self.spec, self.accepted = spec, []

    def allowed(self, vocab: int) -> torch.Tensor:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[list(self.spec.allowed_ids(len(self.accepted)))] = True
        return mask

    def accept(self, token: int) -> bool:
        ok = token in self.spec.allowed_ids(len(self.accepted))
        self.accepted.append(token)
        return ok

    def is_terminated(self) -> bool:
        return self.spec.length is not None and len(self.accepted) >= self.spec.length


def test_constraints_mask_each_request_in_a_mixed_batch(pair):
    ref, opt = pair
    batch = prompts((5, 8, 6), seed=7)
    even = _Allowed(lambda i: range(0, 500, 2))
    word = [41, 42, 43, 44]
    fixed = _Allowed(lambda i: [word[i]], length=len(word))
    engine = ServingEngine(opt, block_size=4)
    handles = run(
        engine,
        (batch[0], config(10), dict(constraint=even)),
        (batch[1], sampled(10, temperature=1.2), dict(constraint=fixed, seed=1)),
        (batch[2], config(10), {}),
        (batch[1], config(10), dict(constraint=fixed)),
    )
    odd_masked = hf_greedy_loop(ref, batch[0], 10, lambda x, g: x.index_fill(0, torch.arange(1, 500, 2), -1e9))
    assert handles[0].tokens == odd_masked and all(t % 2 == 0 for t in handles[0].tokens)
    assert handles[1].tokens == word and handles[1].finish_reason == "stop", "sampled, constrained, then terminated"
    assert handles[3].tokens == word and handles[3].finish_reason == "stop"
    assert handles[2].tokens == hf_greedy_loop(ref, batch[2], 10, lambda x, g: x), "an unconstrained neighbour"


def test_a_failing_constraint_fails_only_its_request(pair):
    ref, opt = pair
    batch = prompts((5, 7), seed=8)
    broken = _Allowed(lambda i: [][0])  # raises IndexError when asked
    engine = ServingEngine(opt, block_size=4)
    bad, good = run(engine, (batch[0], config(6), dict(constraint=broken)), (batch[1], config(6), {}))
    assert bad.finish_reason == "error" and "IndexError" in bad.error and bad.tokens == []
    assert good.tokens == hf_greedy_loop(ref, batch[1], 6, lambda x, g: x)
    engine.runner.blocks.check()
    assert engine.runner.blocks.num_available == engine.runner.blocks.num_blocks


# -- log-probs -----------------------------------------------------------------------------------------------------


def check_entry(entry, token: int, lsm_row: torch.Tensor, k: int) -> None:
    """One TokenLogprobs against HF eager's log_softmax row."""
    assert entry.token == token
    assert abs(entry.logprob - float(lsm_row[token])) < ATOL
    assert len(entry.top) == k
    want = lsm_row.topk(k).values.tolist() if k else []
    assert all(abs(lp - w) < ATOL for (_, lp), w in zip(entry.top, want)), "the k largest log-probs"
    assert all(abs(lp - float(lsm_row[i])) < ATOL for i, lp in entry.top), "each one that of its id"


def test_logprobs_equal_hf_log_softmax_generated_and_prompt(pair):
    ref, opt = pair
    prompt = prompts((21,), seed=9)[0]
    # a small token budget: the prompt is prefilled in chunks; the first request's blocks would be shared
    engine = ServingEngine(opt, block_size=4, max_batch_tokens=8)
    first, greedy, hot = run(
        engine,
        (prompt, config(6), {}),
        (prompt, config(6), dict(logprobs=5, prompt_logprobs=3)),
        (prompt, sampled(6, temperature=0.5), dict(logprobs=2, seed=4)),
    )
    assert first.logprobs is None and first.prompt_logprobs is None, "not asked, not computed"
    for handle, k in ((greedy, 5), (hot, 2)):
        lsm = torch.log_softmax(hf_logits(ref, prompt + handle.tokens), -1)  # [L, V]
        assert len(handle.logprobs) == len(handle.tokens) == 6
        for i, (token, entry) in enumerate(zip(handle.tokens, handle.logprobs)):
            check_entry(entry, token, lsm[len(prompt) - 1 + i], k)  # raw logits: before temperature
    assert all(e.rank == 1 for e in greedy.logprobs), "greedy takes the most likely token"
    lsm = torch.log_softmax(hf_logits(ref, prompt), -1)
    assert greedy.prompt_logprobs[0] is None and len(greedy.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        check_entry(greedy.prompt_logprobs[i], prompt[i], lsm[i - 1], 3)
    # the prompt_logprobs request computed its whole prompt; the sampled one shared the first request's blocks
    assert engine.stats.prefill_tokens_computed == 2 * len(prompt) + 1


def test_logprobs_are_there_with_each_streamed_token(pair):
    _, opt = pair
    prompt = prompts((6,), seed=10)[0]
    engine = ServingEngine(opt, block_size=4).start()
    seen: list[tuple[int, int]] = []
    try:
        handle = engine.submit(prompt, sampled(8), logprobs=1,
                               on_update=lambda h, new, done: seen.append((len(h.tokens), len(h.logprobs))))
        tokens = list(handle)
    finally:
        engine.stop()
    assert tokens == handle.tokens and len(handle.logprobs) == 8
    assert all(n_lp >= n_tok for n_tok, n_lp in seen) and seen[-1] == (8, 8)


# -- refusals ------------------------------------------------------------------------------------------------------


def test_invalid_settings_are_refused_by_name_and_the_engine_stays_usable(pair):
    ref, opt = pair
    engine = ServingEngine(opt, block_size=4)
    prompt = prompts((5,), seed=6)[0]
    bad = {
        "logit_bias": dict(logit_bias=((5, 150.0),)),
        "min_tokens": dict(min_tokens=-1),
        "logprobs": dict(logprobs=21),
        "prompt_logprobs": dict(prompt_logprobs=-2),
        "presence_penalty": dict(presence_penalty=3.0),
        "seed": dict(seed=2**70),
        "unknown sampling settings": dict(temprature=0.5),
        "vocabulary": dict(logit_bias=((10**6, 1.0),)),
        "constraint": dict(constraint=object()),
    }
    for name, kw in bad.items():
        with pytest.raises(ValueError, match=name):
            engine.submit(prompt, config(4), **kw)
    with pytest.raises(ValueError, match="min_tokens"):
        engine.submit(prompt, config(4), min_tokens=5)  # more than max_new_tokens
    with pytest.raises(ValueError, match="not both"):
        engine.submit(prompt, config(4), sampling_params=SamplingParams(max_new_tokens=4, eos_token_ids=frozenset()))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_new_tokens=4, eos_token_ids=frozenset(), do_sample=True, temperature=0.0)
    params = SamplingParams(max_new_tokens=4, eos_token_ids=frozenset(), logprobs=0)
    handle = engine.submit(prompt, sampling_params=params)
    engine.run_until_idle()
    assert handle.tokens == hf_greedy_loop(ref, prompt, 4, lambda x, g: x) and len(handle.logprobs) == 4


# -- the warpers' top-p shortcut ----------------------------------------------------------------------------------


@pytest.mark.parametrize("spread", [8.0, 0.05], ids=["peaked: the shortcut", "flat: the full sort"])
def test_top_p_keeps_the_set_transformers_keeps(spread, monkeypatch):
    from hf_dsinfer.serving import sampling

    full_sorts: list[int] = []
    real = sampling.filter_logits
    monkeypatch.setattr(sampling, "filter_logits", lambda x, *a: (full_sorts.append(x.shape[0]), real(x, *a))[1])
    logits = torch.randn(6, 4096, generator=torch.Generator().manual_seed(1)) * spread
    knobs = [(0.7, 0, 0.9, 0.0), (1.0, 0, 0.5, 0.0), (1.3, 0, 0.95, 0.0), (1.0, 0, 0.8, 0.0), (0.9, 5, 0.9, 0.0),
             (1.0, 0, 1.0, 0.05)]  # fmt: skip
    got = sampling.warp(logits.clone(), knobs)
    # peaked: the four temperature / top-p rows take the shortcut; flat: their mass is spread too wide for it
    assert full_sorts == ([2] if spread == 8.0 else [6])
    for row, (t, k, p, m) in enumerate(knobs):
        hf = transformers.LogitsProcessorList([transformers.TemperatureLogitsWarper(t)] if t != 1.0 else [])
        hf += [transformers.TopKLogitsWarper(k)] if k else []
        hf += [transformers.TopPLogitsWarper(p)] if p < 1.0 else []
        hf += [transformers.MinPLogitsWarper(m)] if m else []
        want = hf(None, logits[row : row + 1].clone())[0]
        assert torch.equal(torch.isfinite(got[row]), torch.isfinite(want)), (spread, row)
        kept = torch.isfinite(want)
        assert torch.allclose(got[row][kept], want[kept]), "kept tokens keep their tempered logits"
