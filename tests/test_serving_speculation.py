"""Speculative decoding inside the serving engine (n-gram proposals, hf_dsinfer.serving.speculation): greedy output
equals plain decoding token for token (and HF generate alone, the oracle) with proposals accepted and rejected,
several requests per step, with and without prefix sharing, under preemption, with stop tokens inside an accepted
run; seeded sampled and penalized requests speculate and keep their text; requests that cannot speculate run exactly
as without it; the config's refusals; SmolLM2 on a copy-heavy prompt. Sampled verification's distribution and the
draft model: tests/test_serving_spec_sampling.py."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import PAD, load_pair, prompts

import hf_dsinfer  # noqa: F401 - registers inference_config=
from hf_dsinfer.serving import ServingEngine
from hf_dsinfer.serving.speculation import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 96}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    ref, opt, _ = load_pair("llama", tmp_path_factory.mktemp("llama"), INJECT)
    return ref, opt


def greedy(max_new_tokens: int) -> transformers.GenerationConfig:
    return transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD,
                                         eos_token_id=-1)  # fmt: skip


def hf_alone(ref, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy(n))
    return out[0, len(prompt) :].tolist()


def batch() -> list[list[int]]:
    """Prompts that repeat themselves (proposals found and mostly accepted), random ones, and two identical ones."""
    a, b, c, d = prompts((7, 5, 13, 9), seed=11)
    return [a * 4, b * 5 + a[:3], c, d, d, (a + b) * 2]


def run(opt, requests: list[list[int]], n: int, speculative_config=None, **engine_kw):
    engine = ServingEngine(opt, speculative_config=speculative_config, **engine_kw)
    handles = [engine.submit(p, greedy(n)) for p in requests]
    engine.run_until_idle()
    engine.runner.blocks.check()
    return handles, engine.stats


@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_greedy_output_equals_plain_decoding(llama, prefix_sharing):
    ref, opt = llama
    reqs = batch()
    kw = dict(block_size=4, max_batch_tokens=24, prefix_sharing=prefix_sharing)
    plain, plain_stats = run(opt, reqs, 24, **kw)
    spec, stats = run(opt, reqs, 24, NGRAM, **kw)
    for p, h, s in zip(reqs, plain, spec):
        assert s.tokens == h.tokens, f"prompt {p}"
        assert s.finish_reason == h.finish_reason == "length"
    for p, s in zip(reqs[:3], spec[:3]):
        assert s.tokens == hf_alone(ref, p, 24)
    assert plain_stats.spec_decode_num_draft_tokens is None  # no speculation: no counters
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0
    assert stats.steps < plain_stats.steps, "accepted proposals save steps"
    assert stats.generated_tokens == plain_stats.generated_tokens == 24 * len(reqs)
    if prefix_sharing:
        assert stats.prefix_hit_tokens == plain_stats.prefix_hit_tokens > 0


def test_preemption_stays_exact(llama):
    ref, opt = llama
    reqs = batch()[:4]
    # 16 blocks of 4 slots: the requests cannot all grow to their end at once, so decodes preempt.
    kw = dict(block_size=4, num_blocks=16, max_batch_tokens=16)
    spec, stats = run(opt, reqs, 20, NGRAM, **kw)
    for p, s in zip(reqs, spec):
        assert s.tokens == hf_alone(ref, p, 20)
    assert stats.preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_stop_token_inside_an_accepted_run(llama):
    _, opt = llama
    prompt = batch()[0]
    plain, _ = run(opt, [prompt], 24)
    stop = plain[0].tokens[10]  # a token that a speculating step may accept in the middle of its proposals
    want = plain[0].tokens[: plain[0].tokens.index(stop) + 1]
    engine = ServingEngine(opt, block_size=4, speculative_config=NGRAM)
    h = engine.submit(prompt, greedy(24), stop_token_ids=frozenset({stop}))
    engine.run_until_idle()
    assert h.tokens == want and h.finish_reason == "stop" and h.stop_reason == stop
    engine.runner.blocks.check()


def test_requests_with_log_probs_run_as_without_it_sampled_and_penalized_ones_speculate(llama):
    _, opt = llama
    prompt = batch()[0]
    sampled = transformers.GenerationConfig(max_new_tokens=16, do_sample=True, temperature=0.9, top_k=50,
                                            pad_token_id=PAD, eos_token_id=-1)  # fmt: skip
    results = []
    for cfg in (None, NGRAM):
        engine = ServingEngine(opt, block_size=4, speculative_config=cfg)
        hs = [engine.submit(prompt, sampled, seed=5), engine.submit(prompt, greedy(16), logprobs=2),
              engine.submit(prompt, greedy(16), repetition_penalty=1.3)]  # fmt: skip
        engine.run_until_idle()
        results.append(([h.tokens for h in hs], [(e.token, e.logprob) for e in hs[1].logprobs], engine.stats))
    (tokens, lps, _), (spec_tokens, spec_lps, stats) = results
    assert spec_tokens == tokens  # the seeded sampled request draws the same text; the penalized one is exact
    assert [t for t, _ in spec_lps] == [t for t, _ in lps]
    # the log-probs request never speculates; its step packs other tokens around it, so only rounding may differ
    assert [lp for _, lp in spec_lps] == pytest.approx([lp for _, lp in lps], abs=1e-4)
    assert stats.spec_decode_num_draft_tokens > 0


def test_config_refusals_name_the_setting():
    assert SpeculativeConfig.parse(None) is None
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 5, 5)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    draft = SpeculativeConfig.parse({"model": "/some/draft", "num_speculative_tokens": 3})  # vLLM infers the method
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/some/draft", 3)
    bad = [
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "method='ngram'"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "needs \"model\""),
        ({"num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}, "unknown key"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "method='eagle'"),
        ({"method": "ngram"}, "num_speculative_tokens=None"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4"),
        ("{not json", "not valid JSON"),
        ([1], "pass a dict"),
    ]
    for config, words in bad:
        with pytest.raises(ValueError, match="speculative_config") as e:
            SpeculativeConfig.parse(config)
        assert words in str(e.value)


def test_smollm2_copy_heavy_prompt_equals_plain():
    real_model = pytest.importorskip("hf_dsinfer.real_model")
    if not real_model.smollm2_available():
        pytest.skip(f"SmolLM2 is not installed: {real_model.SMOLLM2_INSTALL}")
    path = real_model.smollm2_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config={"dtype": "fp32"}).eval()
    text = ("The quick brown fox jumps over the lazy dog near the river bank, while the old farmer watches "
            "from his porch and counts the clouds drifting over the hills.")  # fmt: skip
    chat = [{"role": "user", "content": f"Repeat this text exactly: {text}"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    config = transformers.GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=tok.eos_token_id)
    out = []
    for cfg in (None, {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 2}):
        engine = ServingEngine(model, speculative_config=cfg)
        h = engine.submit(ids, config)
        engine.run_until_idle()
        out.append((h.tokens, engine.stats))
    (plain, plain_stats), (spec, stats) = out
    assert spec == plain
    assert stats.spec_decode_num_accepted_tokens >= 10 and stats.steps < plain_stats.steps


def test_generate_batch_with_prompt_lookup_speculates_and_metrics_count_it(llama):
    from hf_dsinfer.serving.hf_api import last_batch_stats

    _, opt = llama
    reqs = batch()[:3]
    plain = opt.generate_batch(reqs, generation_config=greedy(16))
    cfg = greedy(16)
    cfg.prompt_lookup_num_tokens = 4
    spec = opt.generate_batch(reqs, generation_config=cfg)
    assert [o.generated_tokens for o in spec.values()] == [o.generated_tokens for o in plain.values()]
    stats = last_batch_stats(opt)
    assert stats.spec_decode_num_accepted_tokens > 0
    pytest.importorskip("prometheus_client")
    from hf_dsinfer.serving.metrics import ServerMetrics

    engine = ServingEngine(opt, block_size=4, speculative_config=NGRAM)
    engine.submit(reqs[0], greedy(16))
    engine.run_until_idle()
    body = ServerMetrics(engine, "tiny", 96).render()[0].decode()
    accepted = engine.stats.spec_decode_num_accepted_tokens
    assert f'hf_dsinfer:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(accepted)}' in body


def test_serve_refuses_a_bad_speculative_config_before_loading():
    from hf_dsinfer.serving.serve_cli import build_server

    with pytest.raises(ValueError, match="unknown key"):
        build_server("/nonexistent", speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "x": 1}')
