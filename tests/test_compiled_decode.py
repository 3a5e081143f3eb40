"""The compiled CPU decode step (generation/compiled_cpu.py) against the eager step and HF's generate.

Compiling costs seconds per model and bucket, so the suite runs with ``HF_DSINFER_CPU_COMPILE=0`` (conftest) and
these tests switch it on; they use the smallest models that still cover GQA, padding buckets, sliding windows and
soft-capping.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from tiny_models import PAD, left_pad, prompts, save_tiny
from torch._dynamo.utils import counters

from hf_dsinfer.generation.api import GEN_ATTR
from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.modules import cpu_packed

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 48, "max_batch_size": 4}


@pytest.fixture
def compile_on(monkeypatch):
    monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", "sync")  # compiled in the calling thread: the first call runs it


def _load(name: str, tmp_path, **overrides):
    path = save_tiny(name, tmp_path / name, num_hidden_layers=1, **overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    opt = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=INJECT).eval()
    return ref, opt


def _gen(model, ids, mask, n=10, **kw):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=PAD,
        **kw,
    )


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_compiled_step_equals_eager_and_hf_without_recompiles(tmp_path, compile_on, monkeypatch):
    ref, opt = _load("llama", tmp_path)  # GQA 3:1
    compiled = getattr(opt, GEN_ATTR).step.compiled
    ids, mask = left_pad(prompts())  # 3 left-padded rows: bucket 4, one pad row

    graphs0 = _graphs()
    out = _gen(opt, ids, mask, return_dict_in_generate=True, output_logits=True)
    assert set(compiled.compile_s) == {4} and not compiled.failed
    graphs1 = _graphs()
    assert graphs1 > graphs0  # it did compile
    # another call of the same bucket, with a longer prompt (other attended lengths): no new graph
    longer = prompts((11, 4, 7), seed=1)
    ids2, mask2 = left_pad(longer)
    got2 = _gen(opt, ids2, mask2, n=14)
    assert _graphs() == graphs1, "a second call of the same bucket recompiled the decode step"
    assert compiled.runner.stats.replays >= 9 + 13

    assert torch.equal(out.sequences, _gen(ref, ids, mask)), "compiled greedy tokens differ from HF"
    assert torch.equal(got2, _gen(ref, ids2, mask2, n=14))
    monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", "0")  # the eager step: the reference path
    eager = _gen(opt, ids, mask, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(out.sequences, eager.sequences)
    for a, b in zip(out.logits, eager.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    # a single row runs in its own bucket; the padded batch's rows equal their single runs
    monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", "sync")
    p = prompts()[0]
    single = _gen(opt, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
    assert set(compiled.compile_s) == {1, 4}
    assert torch.equal(single[0, len(p) :], out.sequences[0, ids.shape[1] :])


@pytest.mark.slow
def test_compiled_step_calls_the_packed_gemm_and_sees_weight_updates(tmp_path, compile_on, monkeypatch):
    # batch 4: the linears and the LM head call the oneDNN packed op from the graph (modules/cpu_packed.py); the
    # tiny weights are below the production size threshold, so it is lowered
    monkeypatch.setenv(cpu_packed.ENV_VAR, "1")
    monkeypatch.setattr(cpu_packed, "MIN_ELEMENTS", 0)
    ref, opt = _load("llama", tmp_path)
    ids, mask = left_pad(prompts((5, 9, 3, 7)))
    got = _gen(opt, ids, mask)
    assert set(getattr(opt, GEN_ATTR).step.compiled.compile_s) == {4}
    assert torch.equal(got, _gen(ref, ids, mask)), "compiled packed greedy tokens differ from HF"
    graphs = _graphs()
    with torch.profiler.profile() as prof:
        assert torch.equal(_gen(opt, ids, mask), got)
    calls = sum(e.count for e in prof.key_averages() if e.key == "hf_dsinfer::cpu_packed_linear")
    assert calls >= 9 * 5, f"{calls} packed GEMMs in 9 decode steps of 4 linears + the LM head"

    # an in-place weight update (load_state_dict, an optimizer step) between calls: the graph's op re-packs
    scale = torch.linspace(0.2, 3.0, opt.lm_head.weight.shape[0])[:, None]  # [V, 1]
    with torch.no_grad():
        opt.lm_head.weight.mul_(scale)
        ref.lm_head.weight.mul_(scale)
    after = _gen(opt, ids, mask)
    assert not torch.equal(after, got), "the update did not change the tokens (the test would prove nothing)"
    assert torch.equal(after, _gen(ref, ids, mask))
    assert _graphs() == graphs, "a weight update recompiled the decode step"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_compiled_step_window_and_softcap(name, tmp_path, compile_on):
    # mistral: sliding window 16 is passed during decoding; gemma2: attention soft-capping and sandwich norms
    ref, opt = _load(name, tmp_path)
    ids, mask = left_pad(prompts((12, 7)))
    got = _gen(opt, ids, mask, n=16)
    assert getattr(opt, GEN_ATTR).step.compiled.compile_s, "the decode step did not run compiled"
    assert torch.equal(got, _gen(ref, ids, mask, n=16))


def test_compile_failure_falls_back_with_one_warning(tmp_path, compile_on, monkeypatch, caplog):
    import hf_dsinfer.generation.compiled_cpu as compiled_cpu

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler here")

        return run

    monkeypatch.setattr(compiled_cpu.torch, "compile", broken_compile)
    ref, opt = _load("llama", tmp_path)
    ids, mask = left_pad(prompts())
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        first = _gen(opt, ids, mask)
        second = _gen(opt, ids, mask)
    warnings = [r for r in caplog.records if "compiling the CPU decode step failed" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler here" in warnings[0].getMessage()
    assert getattr(opt, GEN_ATTR).step.compiled.failed
    want = _gen(ref, ids, mask)
    assert torch.equal(first, want) and torch.equal(second, want)


def test_config_switch_keeps_the_eager_step(tmp_path, compile_on):
    path = save_tiny("llama", tmp_path / "m", num_hidden_layers=1)
    opt = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config={**INJECT, "cpu_compile": False})
    assert getattr(opt, GEN_ATTR).step.compiled is None
    with pytest.raises(ValueError, match="cpu_compile"):
        transformers.AutoModelForCausalLM.from_pretrained(path, inference_config={**INJECT, "cpu_compile": "yes"})


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_compiled_moe_step_runs_the_per_pair_op(name, tmp_path, compile_on, monkeypatch):
    """MoE decode in the compiled step: the few (token, expert) pairs go through the one opaque per-pair op per layer
    (the expert ids are read on the host inside it); tokens equal HF's and the eager step's, logits within 1e-5."""
    ref, opt = _load(name, tmp_path)
    compiled = getattr(opt, GEN_ATTR).step.compiled
    ids, mask = left_pad(prompts()[1:2])  # bucket 1: top-k pairs per step, within the per-pair window
    with torch.profiler.profile() as prof:
        out = _gen(opt, ids, mask, return_dict_in_generate=True, output_logits=True)
    assert set(compiled.compile_s) == {1} and not compiled.failed
    ops = {e.name for e in prof.events()}
    assert "hf_dsinfer::moe_experts_per_pair" in ops, "the compiled MoE step did not call the per-pair op"
    assert torch.equal(out.sequences, _gen(ref, ids, mask)), "compiled greedy tokens differ from HF"
    # a padded batch (bucket 4: more pairs than experts) takes the sorted grouped path, its loop one op too
    bids, bmask = left_pad(prompts())
    with torch.profiler.profile() as prof:
        batch = _gen(opt, bids, bmask, return_dict_in_generate=True, output_logits=True)
    assert set(compiled.compile_s) == {1, 4} and not compiled.failed
    assert "hf_dsinfer::moe_gemm_host_counts" in {e.name for e in prof.events()}
    assert torch.equal(batch.sequences, _gen(ref, bids, bmask)), "compiled greedy tokens differ from HF"
    monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", "0")
    for got, (i, m) in ((out, (ids, mask)), (batch, (bids, bmask))):
        eager = _gen(opt, i, m, return_dict_in_generate=True, output_logits=True)
        assert torch.equal(got.sequences, eager.sequences)
        for a, b in zip(got.logits, eager.logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_compile_threads_setting(tmp_path, compile_on, monkeypatch):
    """Each bucket compiles a one-thread variant and, after it, one with a team of torch's thread count;
    HF_DSINFER_COMPILE_THREADS pins the choice (1: no team variant; N: a team of at most torch's count), "auto" /
    unset lets the governor choose, a bad value is refused naming the variable. At 2 threads both variants run, give
    HF's greedy tokens, and torch's count is left as it was."""
    from hf_dsinfer.generation import compiled_cpu
    from hf_dsinfer.generation.thread_governor import COMPILE_THREADS_ENV as env
    from hf_dsinfer.generation.thread_governor import ThreadGovernor, team_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.delenv(env, raising=False)
        assert compiled_cpu.inductor_options() == {"cpp.threads": 1}
        assert team_threads() == 2
        for value, team, ran in (("all", 2, 2), ("1", 1, 1), ("8", 2, 2)):
            monkeypatch.setenv(env, value)
            assert team_threads() == team
            with ThreadGovernor().step(2) as n:
                assert n == ran and torch.get_num_threads() == ran
            assert torch.get_num_threads() == 2
        for bad in ("0", "two"):
            monkeypatch.setenv(env, bad)
            with pytest.raises(ValueError, match=env):
                compiled_cpu.inductor_options()
        monkeypatch.delenv(env)
        ref, opt = _load("llama", tmp_path)
        ids, mask = left_pad(prompts()[:1])
        assert torch.equal(_gen(opt, ids, mask, n=8), _gen(ref, ids, mask, n=8))
        compiled = getattr(opt, GEN_ATTR).step.compiled
        assert list(compiled.compile_s) == [1] and list(compiled.team_compile_s) == [(1, 2)]  # both variants compiled
        (governor,) = compiled.governors.values()
        assert set(governor._avg) == {1, 2}  # both ran and were timed (after one untimed warm-up step each)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_thread_governor_follows_the_faster_count(monkeypatch):
    """The governor runs torch's count while it is faster, tries one thread every EXPLORE_EVERY steps, moves to one
    thread when the other becomes slower (a busy machine), and back when it is fast again."""
    from hf_dsinfer.generation import thread_governor as tg

    monkeypatch.delenv(tg.COMPILE_THREADS_ENV, raising=False)
    cost = {1: 13.0, 2: 9.0}  # ms per step at each count: a quiet machine
    now = [0.0]
    gov = tg.ThreadGovernor(clock=lambda: now[0])

    def run(steps: int, team: int | None = 2) -> list[int]:
        used = []
        for _ in range(steps):
            with gov.step(team) as n:
                now[0] += cost[n] / 1e3
            used.append(n)
        return used

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        used = run(4 + 2 * tg.EXPLORE_EVERY)
        assert used[:4] == [2, 2, 1, 1]  # each count: an untimed warm-up step, then a timed one
        assert used[4:].count(1) == 2 and used[4:].count(2) == 2 * tg.EXPLORE_EVERY - 2  # one try per EXPLORE_EVERY
        cost[2] = 25.0  # another process takes a core: the two-thread step stalls at its barriers
        used = run(3 * tg.EXPLORE_EVERY)
        assert used[-tg.EXPLORE_EVERY :].count(1) >= tg.EXPLORE_EVERY - 1  # one thread, but for its try of 2
        cost[2] = 9.0  # quiet again
        used = run(3 * tg.EXPLORE_EVERY)
        assert used[-tg.EXPLORE_EVERY :].count(2) >= tg.EXPLORE_EVERY - 1
        assert torch.get_num_threads() == 2  # restored after every step
        assert set(run(5, team=None)) == {1}  # no team variant (yet, or at all): one thread
    finally:
        torch.set_num_threads(before)
