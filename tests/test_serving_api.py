"""transformers' continuous-batching API on injected models: ``generate_batch`` / ``init_continuous_batching`` run
hf_dsinfer's paged engine and return what transformers returns (ids, order, types, tokens); the Hybrid Engine's
``generate_batch`` after a weight update; the padded fallback for ALiBi models."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from tiny_models import PAD, build_tiny, load_pair, prompts
from transformers.generation.continuous_batching import RequestStatus

import hf_dsinfer  # noqa: F401 - registers inference_config=
from hf_dsinfer.hybrid import HybridEngine
from hf_dsinfer.serving.hf_api import ENGINE_ATTR, FusedContinuousBatchingManager, last_batch_stats

pytestmark = pytest.mark.usefixtures("one_thread")

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 64}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            ref, opt, _ = load_pair(name, tmp_path_factory.mktemp(name), INJECT)
            cache[name] = (ref, opt)
        return cache[name]

    return get


def config(**kw) -> transformers.GenerationConfig:
    return transformers.GenerationConfig(**{"max_new_tokens": 8, "do_sample": False, "pad_token_id": PAD, **kw})


def small_cb() -> transformers.ContinuousBatchingConfig:
    """A cache sized for the tiny workloads (transformers sizes its own from free memory: 25 s per call on CPU)."""
    return transformers.ContinuousBatchingConfig(num_blocks=32, page_size=16, max_batch_tokens=64)


def alone(model, prompt: list[int], cfg: transformers.GenerationConfig) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0, len(prompt) :].tolist()
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    return out[: next((k + 1 for k, t in enumerate(out) if t in eos), len(out))]


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_generate_batch_equals_transformers(name, pair):
    ref, opt = pair(name)
    batch = prompts((5, 17, 3, 9), seed=1)
    free = [alone(ref, p, config(eos_token_id=-1)) for p in batch]
    cfg = config(eos_token_id=[free[1][2], free[3][5]])  # two requests stop early
    want = ref.generate_batch(batch, generation_config=cfg, continuous_batching_config=small_cb())  # transformers'
    got = opt.generate_batch(batch, generation_config=cfg, continuous_batching_config=small_cb())
    assert list(got) == list(want) == ["req_0", "req_1", "req_2", "req_3"]
    for rid, w in want.items():
        g = got[rid]
        assert type(g) is type(w) and g.request_id == w.request_id == rid
        assert g.prompt_ids == w.prompt_ids and g.status == w.status == RequestStatus.FINISHED and g.error is None
        assert g.generated_tokens == w.generated_tokens, rid
    assert isinstance(getattr(opt, ENGINE_ATTR).runner.cache.keys[0], torch.Tensor), "the paged engine ran"
    stats = last_batch_stats(opt)
    assert stats.requests_finished == 4 and stats.generated_tokens == sum(
        len(w.generated_tokens) for w in want.values()
    )


def test_generate_batch_children_share_the_prompt(pair):
    ref, opt = pair("llama")
    batch = prompts((12, 7), seed=2)
    cfg = config(do_sample=True, num_return_sequences=3, eos_token_id=-1, top_k=5)
    want = ref.generate_batch(batch, generation_config=cfg, continuous_batching_config=small_cb())
    got = opt.generate_batch(batch, generation_config=cfg)
    assert list(got) == list(want) == [
        "req_0__child#0", "req_0__child#1", "req_0", "req_1__child#0", "req_1__child#1", "req_1",
    ]  # fmt: skip
    assert all(len(o.generated_tokens) == 8 and o.prompt_ids == batch[int(k[4])] for k, o in got.items())
    stats = last_batch_stats(opt)
    # each prompt is prefilled once; each child computes only the prompt's last token (its logits)
    assert stats.prompt_tokens == 3 * 19 and stats.prefill_tokens_computed == 19 + 2 * 2
    # max_new_tokens given as an argument, as TRL does
    short = opt.generate_batch(batch, generation_config=cfg, max_new_tokens=3)
    assert all(len(o.generated_tokens) == 3 for o in short.values())


def test_init_continuous_batching_manager(pair):
    ref, opt = pair("llama")
    batch = prompts((6, 10, 4), seed=3)
    cfg = config(eos_token_id=-1)
    manager = opt.init_continuous_batching(generation_config=cfg)
    assert isinstance(manager, FusedContinuousBatchingManager)
    manager.start()
    try:
        ids = manager.add_requests(batch[:2])
        streamed = manager.add_request(batch[2], request_id="mine", streaming=True, max_new_tokens=4)
        partial = list(manager.request_id_iter("mine"))
        results = {}
        while len(results) < 2:
            out = manager.get_result(timeout=30)
            assert out is not None
            results[out.request_id] = out
    finally:
        manager.stop(block=True)
    assert not manager.is_running()
    assert ids == ["req_0", "req_1"] and streamed == "mine"
    for rid, prompt in zip(ids, batch):
        assert results[rid].generated_tokens == alone(ref, prompt, cfg) and results[rid].is_finished()
    assert [len(o.generated_tokens) for o in partial] == [1, 2, 3, 4, 4]  # one per token, then the finished one
    assert partial[-1].status == RequestStatus.FINISHED and partial[0].status == RequestStatus.DECODING
    assert partial[-1].generated_tokens == alone(ref, batch[2], config(eos_token_id=-1, max_new_tokens=4))
    with opt.continuous_batching_context_manager(generation_config=cfg) as m:
        rid = m.add_request(batch[0])
        out = m.get_result(rid, timeout=30)
    assert out.generated_tokens == alone(ref, batch[0], cfg)


def test_continuous_batching_config_sizes_the_engine(pair):
    _, opt = pair("llama")
    cb = transformers.ContinuousBatchingConfig(
        page_size=8, num_blocks=40, max_batch_tokens=32, allow_block_sharing=False
    )
    opt.generate_batch(prompts((5,)), generation_config=config(eos_token_id=-1), continuous_batching_config=cb)
    engine = getattr(opt, ENGINE_ATTR)
    assert engine.runner.blocks.block_size == 8 and engine.runner.blocks.num_blocks == 40
    assert engine.scheduler.max_batch_tokens == 32 and not engine.scheduler.prefix_sharing


def test_alibi_model_on_the_triton_kernels_falls_back_to_padded_batches(pair, caplog, monkeypatch):
    """With the Triton paged kernels (no ALiBi; simulated here) bloom's ``generate_batch`` runs padded batches."""
    ref, opt = pair("bloom")
    monkeypatch.setattr("hf_dsinfer.serving.runner._triton_paged", lambda model: True)
    batch = prompts((5, 9), seed=4)
    cfg = config(eos_token_id=-1)
    with caplog.at_level(logging.WARNING, logger="transformers.hf_dsinfer"):
        got = opt.generate_batch(batch, generation_config=cfg)
    assert "ALiBi" in caplog.text and "padded" in caplog.text
    assert [o.generated_tokens for o in got.values()] == [alone(ref, p, cfg) for p in batch]
    with pytest.raises(ValueError, match="ALiBi"):
        opt.init_continuous_batching()


def test_alibi_model_is_served_by_the_engine_on_the_torch_path(pair):
    ref, opt = pair("bloom")
    batch = prompts((5, 9, 3), seed=4)
    cfg = config(eos_token_id=-1)
    got = opt.generate_batch(batch, generation_config=cfg)
    assert [o.generated_tokens for o in got.values()] == [alone(ref, p, cfg) for p in batch]
    assert last_batch_stats(opt).requests_finished == 3, "the paged engine served it (not padded batches)"


def test_hybrid_engine_generate_batch_after_weight_update():
    model = build_tiny("llama", seed=0)
    he = HybridEngine(model, inference_config={"max_out_tokens": 64, "max_batch_size": 2})
    batch = prompts((5, 9, 3, 7), seed=6)
    cfg = config(eos_token_id=-1)
    before = he.generate_batch(batch, generation_config=cfg)
    assert [o.generated_tokens for o in before.values()] == [alone(model, p, cfg) for p in batch]
    with torch.no_grad():  # a training step's worth of change, in place
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = he.generate_batch(batch, generation_config=cfg)
    want = [alone(model, p, cfg) for p in batch]
    assert [o.generated_tokens for o in after.values()] == want, "the refreshed weights generate"
    assert want != [o.generated_tokens for o in before.values()], "the update changes the completions"
    assert last_batch_stats(he.module).requests_finished == 4, "the paged engine served it (not padded batches)"


def test_grpo_shaped_rollouts_prefill_each_prompt_once():
    """TRL's GRPO sends every prompt ``num_generations`` times in a row (sampling): each prompt is computed once,
    its copies compute only their last prompt token."""
    model = build_tiny("llama", seed=0)
    he = HybridEngine(model, inference_config={"max_out_tokens": 64})
    unique = prompts((11, 6, 14, 9), seed=8)
    batch = [p for p in unique for _ in range(4)]  # 4 prompts x 4 generations
    cfg = config(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=-1)
    results = he.generate_batch(batch, generation_config=cfg)
    assert list(results) == [f"req_{i}" for i in range(16)]
    assert all(len(o.generated_tokens) == 8 for o in results.values())
    stats = last_batch_stats(he.module)
    assert stats.prompt_tokens == 4 * sum(map(len, unique))
    assert stats.prefill_tokens_computed == sum(map(len, unique)) + 4 * 3  # ~4x fewer than requested


def test_manager_result_handlers_on_an_event_loop(pair):
    """What transformers' ``serve --continuous-batching`` uses: per-request handlers called on its event loop, and
    ``background_thread_status.fatal_error``."""
    import asyncio

    ref, opt = pair("llama")
    prompt = prompts((6,), seed=9)[0]
    cfg = config(eos_token_id=-1)
    manager = opt.init_continuous_batching(generation_config=cfg)
    manager.start()

    async def serve_one():
        loop = asyncio.get_running_loop()
        finished, seen = loop.create_future(), []

        def on_output(out):
            assert asyncio.get_running_loop() is loop, "called on the registering loop"
            seen.append(out)
            if out.is_finished():
                finished.set_result(out)

        manager.register_result_handler("a", on_output)
        manager.add_request(prompt, request_id="a", streaming=True, max_new_tokens=4)
        return await asyncio.wait_for(finished, 60), seen

    try:
        out, seen = asyncio.run(serve_one())
        assert manager.background_thread_status.fatal_error is None
    finally:
        manager.stop(block=True)
    assert out.generated_tokens == alone(ref, prompt, config(eos_token_id=-1, max_new_tokens=4))
    assert [len(o.generated_tokens) for o in seen] == [1, 2, 3, 4, 4] and manager.output_queue.empty()
