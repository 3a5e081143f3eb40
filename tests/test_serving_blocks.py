"""The serving block manager and scheduler without a model: reference counts, the prefix table, copy-on-write,
reclaiming cached blocks, and a randomized run of joins, cancellations and preemptions that must keep every block
accounted for and every request's token budget."""

from __future__ import annotations

import random

import pytest
import transformers

from hf_dsinfer.serving.blocks import BlockManager, OutOfBlocks, prefix_keys
from hf_dsinfer.serving.handle import RequestHandle
from hf_dsinfer.serving.requests import SamplingParams, Sequence
from hf_dsinfer.serving.scheduler import Scheduler


def test_prefix_keys_chain_and_partial_blocks():
    a = prefix_keys([1, 2, 3, 4, 5, 6], 4)
    b = prefix_keys([1, 2, 3, 4, 5, 7], 4)
    c = prefix_keys([9, 2, 3, 4, 5, 6], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # same first block, different partial tails
    assert a[1] != c[1], "a block's key depends on everything before it"
    assert prefix_keys([1, 2, 3, 4, 5], 4)[1] != a[1], "a partial block's key depends on its length"


def test_refcounts_cache_and_reclaim():
    copies = []
    bm = BlockManager(3, 4, lambda src, dst: copies.append((src, dst)))
    x, y, z = bm.allocate(), bm.allocate(), bm.allocate()
    with pytest.raises(OutOfBlocks):
        bm.allocate()
    key = prefix_keys([1, 2, 3, 4], 4)[0]
    bm.register(x, key)
    bm.share(x)  # two holders
    assert bm.writable(y) == y, "a private, unregistered block is written in place"
    bm.release(y)  # y back to the free list
    w = bm.writable(x)  # x is registered and shared: a copy
    assert w == y and copies == [(x, y)] and bm.refs[x] == 1
    bm.release(x)
    assert x in bm.cached and bm.lookup([key]) == [x], "a registered block stays findable at count 0"
    bm.release(z)
    assert bm.allocate() == z, "free blocks go before cached ones"
    assert bm.allocate() == x and bm.lookup([key]) == [], "reclaiming a cached block forgets its key"
    bm.check()


def test_forget_cached_frees_registered_blocks():
    bm = BlockManager(2, 4)
    b = bm.allocate()
    bm.register(b, prefix_keys([1], 4)[0])
    bm.release(b)
    assert bm.num_available == 2 and bm.cached
    bm.forget_cached()
    assert not bm.cached and not bm.by_key and bm.num_available == 2
    bm.check()


def _sequence(rid: str, prompt: list[int], max_new: int) -> Sequence:
    config = transformers.GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1)
    return Sequence(rid, prompt, SamplingParams.from_generation_config(config, len(prompt)), RequestHandle(rid, prompt))


def test_randomized_schedule_keeps_blocks_and_budgets():
    """Random prompts (many sharing prefixes), joins between steps, cancellations and a cache too small for all of
    them: every step respects the token budget, every block stays accounted for, every request gets exactly its
    max_new_tokens (or is cancelled), and at the end every block is free or cached."""
    assert sum(_random_run(seed) for seed in range(4)) > 0, "the cache is small enough that decode growth preempts"


def _random_run(seed: int) -> int:
    """One randomized run (see above); returns the number of preemptions."""
    rng = random.Random(seed)
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_batch_tokens=12, max_num_seqs=6)
    stems = [[rng.randrange(3, 50) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    seqs, step, preempted = [], 0, 0
    while step < 400 and (step < 40 or sched.has_work):
        if step < 40 and rng.random() < 0.5:
            prompt = rng.choice(stems) + [rng.randrange(3, 50) for _ in range(rng.randrange(0, 6))]
            seq = _sequence(f"r{len(seqs)}", prompt, rng.randrange(1, 16))
            sched.check_fits(len(prompt) + seq.params.max_new_tokens)
            sched.add(seq)
            seqs.append(seq)
        if seqs and rng.random() < 0.05:
            sched.cancel(rng.choice(seqs).request_id)
        plan = sched.schedule()
        assert plan.num_tokens <= 12
        for s, n in plan.chunks:
            assert len(s.block_table) * 4 >= s.num_computed + n, "room for every scheduled token"
            first = s.num_computed // 4
            assert bm.refs[s.block_table[first]] == 1 and s.block_table[first] not in bm.key_of, (
                "written blocks private"
            )
        sampled = {id(s): 3 + (s.num_computed + n) % 40 for s, n in plan.chunks if s.num_computed + n == len(s.tokens)}
        preempted += plan.preemptions
        sched.update(plan, sampled)
        bm.check()
        step += 1
    assert not sched.has_work, "every request finished"
    for s in seqs:
        assert s.handle.finish_reason in ("length", "cancelled")
        if s.handle.finish_reason == "length":
            assert len(s.handle.tokens) == s.params.max_new_tokens
    assert bm.num_available == bm.num_blocks and not sched.pending
    return preempted


def test_release_idle_openmp_workers_keeps_torch_working():
    """The starting thread's OpenMP team is released (GNU OpenMP with several threads) or left alone (one thread,
    another device, another runtime); torch ops of that thread work afterwards either way (a new team)."""
    import torch

    from hf_dsinfer.serving.omp import release_idle_openmp_workers

    before = torch.get_num_threads()
    x = torch.randn(64, 64)
    expected = x @ x
    try:
        torch.set_num_threads(1)
        assert release_idle_openmp_workers("cpu") is False, "one thread: no team to release"
        torch.set_num_threads(2)
        assert release_idle_openmp_workers("meta") is False, "only the CPU's workers matter"
        assert isinstance(release_idle_openmp_workers("cpu"), bool)
        torch.testing.assert_close(x @ x, expected)
    finally:
        torch.set_num_threads(before)
