"""Continuous batching on fused layers (hf_dsinfer.serving): every request's greedy tokens equal HF ``generate`` of
that request alone (fp32), with mixed prompt lengths, requests joining mid-run, chunked prefill forced by a small
token budget, block exhaustion (preemption), prefix sharing and copy-on-write; per-request sampling settings; the
background thread, cancellation and refusals."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers
from tiny_models import ARCHITECTURES, PAD, load_pair, prompts

import hf_dsinfer  # noqa: F401 - registers inference_config=
from hf_dsinfer.policies import POLICIES
from hf_dsinfer.serving import ServingEngine

pytestmark = pytest.mark.usefixtures("one_thread")

# Every decoder family with a policy (bloom: ALiBi on the torch path; with the Triton kernels it falls back, see
# test_serving_api.py).
FAMILIES = [n for n, a in ARCHITECTURES.items() if not a.encoder and a.model_type in POLICIES]
INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 64}
NEW = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``pair(name) -> (hf_model, injected_model)``, cached per module."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            ref, opt, _ = load_pair(name, tmp_path_factory.mktemp(name), INJECT)
            cache[name] = (ref, opt)
        return cache[name]

    return get


def greedy(max_new_tokens: int = NEW, eos=None) -> transformers.GenerationConfig:
    # eos -1: none (transformers' continuous-batching convention), so every request runs max_new_tokens
    return transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD, eos_token_id=eos if eos is not None else -1
    )


def hf_alone(ref, prompt: list[int], config: transformers.GenerationConfig) -> list[int]:
    """HF generate of ``prompt`` alone (eos -1: transformers warns once and never stops early); tokens up to and
    including the first EOS."""
    ids = torch.tensor([prompt])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, len(prompt) :].tolist()
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    end = next((k + 1 for k, t in enumerate(out) if t in eos), len(out))
    return out[:end]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_hf_alone_with_chunked_prefill_and_joining_requests(name, pair):
    ref, opt = pair(name)
    batch = prompts((5, 21, 3, 12, 8))
    engine = ServingEngine(opt, block_size=4, max_batch_tokens=8, num_blocks=64)  # 21-token prompt: 3 chunks
    handles = [engine.submit(p, greedy()) for p in batch[:2]]
    engine.step()
    engine.step()  # the first two are mid-prefill when the others join
    handles += [engine.submit(p, greedy()) for p in batch[2:]]
    engine.run_until_idle()
    for prompt, handle in zip(batch, handles):
        assert handle.tokens == hf_alone(ref, prompt, greedy()), f"{name}: request {handle.request_id} differs"
        assert handle.finish_reason == "length"
    stats = engine.stats
    assert stats.prefill_tokens_computed == stats.prompt_tokens == sum(map(len, batch))  # no shared prefixes
    assert stats.generated_tokens == NEW * len(batch) and stats.requests_finished == len(batch)
    engine.runner.blocks.check()
    assert engine.runner.blocks.num_available == 64, "finished requests give every block back"


def test_eos_stops_each_request_like_hf(pair):
    ref, opt = pair("llama")
    batch = prompts((5, 9, 3))
    free = [hf_alone(ref, p, greedy()) for p in batch]
    eos = [free[0][3], free[1][6]]  # request 0 stops after 4 tokens, request 1 after 7 (or earlier)
    engine = ServingEngine(opt, block_size=4)
    handles = [engine.submit(p, greedy(eos=eos)) for p in batch]
    engine.run_until_idle()
    for prompt, handle in zip(batch, handles):
        want = hf_alone(ref, prompt, greedy(eos=eos))
        assert handle.tokens == want
        assert handle.finish_reason == ("stop" if want[-1] in eos else "length")
    assert handles[0].finish_reason == "stop" and len(handles[0].tokens) <= 4


def test_block_exhaustion_preempts_and_stays_exact(pair):
    ref, opt = pair("llama")
    batch = prompts((9, 14, 6, 11), seed=3)
    # 10 blocks of 4 slots: each request needs 4-6 blocks by its end, so running all four at once is impossible.
    engine = ServingEngine(opt, block_size=4, num_blocks=10, max_batch_tokens=16)
    handles = [engine.submit(p, greedy(12)) for p in batch]
    engine.run_until_idle()
    for prompt, handle in zip(batch, handles):
        assert handle.tokens == hf_alone(ref, prompt, greedy(12))
    assert engine.stats.preemptions > 0, "the cache was sized so that decode growth must preempt"
    engine.runner.blocks.check()


def test_identical_prompts_prefill_once(pair):
    ref, opt = pair("llama")
    prompt = prompts((10,), seed=5)[0]
    engine = ServingEngine(opt, block_size=4)
    handles = [engine.submit(prompt, greedy()) for _ in range(4)]
    engine.run_until_idle()
    want = hf_alone(ref, prompt, greedy())
    assert all(h.tokens == want for h in handles)
    stats = engine.stats
    # The first request computes the prompt; the others wait for its blocks and compute only their last token
    # (whose logits they need), writing it into a private copy of the shared partial block.
    assert stats.prompt_tokens == 40 and stats.prefill_tokens_computed == 10 + 3
    assert stats.prefix_hit_tokens == 3 * 9
    assert stats.copy_on_write_blocks >= 3
    engine.runner.blocks.check()


def test_shared_system_prompt_with_different_tails(pair):
    ref, opt = pair("llama")
    system = prompts((13,), seed=7)[0]
    tails = prompts((3, 6, 1, 4), seed=8)
    engine = ServingEngine(opt, block_size=4)
    first = engine.submit(system + tails[0], greedy())
    engine.run_until_idle()  # its prompt blocks stay cached after it finishes
    handles = [engine.submit(system + t, greedy()) for t in tails[1:]]
    engine.run_until_idle()
    for tail, handle in zip(tails, [first, *handles]):
        assert handle.tokens == hf_alone(ref, system + tail, greedy())
    stats = engine.stats
    assert stats.prefix_hit_tokens == 3 * 12  # three full blocks of the 13-token system prompt, per later request
    assert stats.prefill_tokens_computed == stats.prompt_tokens - 3 * 12


def test_copy_on_write_keeps_the_shared_block_intact(pair):
    """Two requests share a partial prompt block; each writes its own tokens into a copy, the original (cached for
    the next request) keeps the prompt's KV: a third identical request still gets HF's tokens."""
    ref, opt = pair("qwen3")
    prompt = prompts((6,), seed=9)[0]
    engine = ServingEngine(opt, block_size=4)
    a = engine.submit(prompt, greedy())
    b = engine.submit(prompt + [5], greedy())  # shares block 0 and diverges inside block 1
    engine.run_until_idle()
    c = engine.submit(prompt, greedy())
    engine.run_until_idle()
    assert a.tokens == c.tokens == hf_alone(ref, prompt, greedy())
    assert b.tokens == hf_alone(ref, prompt + [5], greedy())
    assert engine.stats.copy_on_write_blocks >= 2
    engine.runner.blocks.check()


def test_prefix_sharing_off_computes_every_prompt(pair):
    _, opt = pair("llama")
    prompt = prompts((10,), seed=5)[0]
    engine = ServingEngine(opt, block_size=4, prefix_sharing=False)
    for _ in range(3):
        engine.submit(prompt, greedy(2))
    engine.run_until_idle()
    assert engine.stats.prefill_tokens_computed == 30 and engine.stats.prefix_hit_tokens == 0


def test_per_request_sampling_settings(pair):
    ref, opt = pair("llama")
    batch = prompts((5, 9, 7), seed=2)
    engine = ServingEngine(opt, block_size=4)
    top1 = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=True, top_k=1, eos_token_id=-1)
    hot = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=True, temperature=1.5, top_p=0.9, eos_token_id=-1)
    penalty = transformers.GenerationConfig(
        max_new_tokens=NEW, do_sample=False, repetition_penalty=1.5, eos_token_id=-1
    )
    torch.manual_seed(0)
    h_top1, h_hot, h_pen = (engine.submit(p, c) for p, c in zip(batch, (top1, hot, penalty)))
    engine.run_until_idle()
    assert h_top1.tokens == hf_alone(ref, batch[0], greedy()), "top_k=1 sampling is greedy"
    assert h_pen.tokens == hf_alone(ref, batch[2], penalty), "repetition penalty as HF's"
    assert len(h_hot.tokens) == NEW and all(0 <= t < opt.config.vocab_size for t in h_hot.tokens)
    assert h_hot.tokens != hf_alone(ref, batch[1], greedy()), "temperature 1.5 sampling should leave greedy's path"


def test_background_thread_streams_and_cancels(pair):
    ref, opt = pair("llama")
    batch = prompts((5, 9, 3, 7), seed=4)
    engine = ServingEngine(opt, block_size=4, max_batch_tokens=16).start()
    try:
        results: dict[int, list[int]] = {}

        def client(i: int) -> None:
            handle = engine.submit(batch[i], greedy())
            results[i] = list(handle)  # streamed token by token, ends when finished

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(batch))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, prompt in enumerate(batch):
            assert results[i] == hf_alone(ref, prompt, greedy())
        long = engine.submit(batch[0], greedy(50))
        next(iter(long))  # it has started
        long.cancel()
        assert long.wait(30) and long.finish_reason == "cancelled" and len(long.tokens) < 50
    finally:
        engine.stop()
    assert not engine.is_running
    engine.runner.blocks.check()
    assert engine.runner.blocks.num_available == engine.runner.blocks.num_blocks


def test_refusals_name_the_setting(pair):
    _, opt = pair("llama")
    engine = ServingEngine(opt, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="num_blocks=8"):
        engine.submit(list(range(3, 30)), greedy(10))  # 37 tokens > 8 blocks x 4
    with pytest.raises(ValueError, match="max_out_tokens"):
        ServingEngine(opt, block_size=4, num_blocks=100).submit(list(range(3, 60)), greedy(10))  # 67 > 64 positions
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], greedy())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit([3, 10**6], greedy())
    with pytest.raises(ValueError, match="num_beams"):
        engine.submit([3, 4], transformers.GenerationConfig(num_beams=2, max_new_tokens=3))
    with pytest.raises(ValueError, match="max_batch_tokens"):
        ServingEngine(opt, max_batch_tokens=0)


def test_a_failing_step_fails_its_requests_and_the_engine_recovers(pair, monkeypatch):
    ref, opt = pair("llama")
    batch = prompts((5, 9), seed=11)
    engine = ServingEngine(opt, block_size=4)
    handles = [engine.submit(p, greedy()) for p in batch]
    engine.step()  # both requests hold blocks now
    real_run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda plan: (_ for _ in ()).throw(MemoryError("device full")))
    with pytest.raises(MemoryError, match="device full"):
        engine.run_until_idle()
    assert all(h.finish_reason == "error" and "device full" in h.error for h in handles)
    with pytest.raises(RuntimeError, match="device full"):
        handles[0].result()
    engine.runner.blocks.check()
    assert engine.runner.blocks.num_available == engine.runner.blocks.num_blocks, "the failed requests' blocks are back"
    monkeypatch.setattr(engine.runner, "run", real_run)
    again = engine.submit(batch[1], greedy())
    engine.run_until_idle()
    assert again.tokens == hf_alone(ref, batch[1], greedy())


def test_a_raising_client_callback_does_not_stop_the_engine(pair):
    ref, opt = pair("llama")
    batch = prompts((5, 9), seed=12)
    engine = ServingEngine(opt, block_size=4).start()
    try:

        def broken(handle, new_tokens, finished):
            raise RuntimeError("client bug")

        bad = engine.submit(batch[0], greedy(), on_update=broken)
        good = engine.submit(batch[1], greedy())
        assert good.result(timeout=60) == hf_alone(ref, batch[1], greedy())
        assert bad.result(timeout=60) == hf_alone(ref, batch[0], greedy())
    finally:
        engine.stop()


def test_paused_engine_takes_no_step_and_resumes(pair):
    ref, opt = pair("llama")
    prompt = prompts((6,), seed=13)[0]
    engine = ServingEngine(opt, block_size=4).start()
    try:
        with engine.paused():  # e.g. a weight update in place
            handle = engine.submit(prompt, greedy())
            assert not handle.wait(0.3) and handle.tokens == [], "no step while paused"
        assert handle.result(timeout=60) == hf_alone(ref, prompt, greedy())
    finally:
        engine.stop()


def test_stop_without_cancelling_keeps_requests_for_the_next_start(pair):
    ref, opt = pair("llama")
    prompt = prompts((7,), seed=14)[0]
    engine = ServingEngine(opt, block_size=4)
    with engine.paused():
        engine.start()
        handle = engine.submit(prompt, greedy())
        engine.stop(cancel_pending=False, timeout=0)  # the thread ends before taking a step
    engine.join(30)
    assert not engine.is_running and not handle.done
    engine.start()
    try:
        assert handle.result(timeout=60) == hf_alone(ref, prompt, greedy())
    finally:
        engine.stop()
