"""Memory counted and releasable (hybrid/memory.py): ``memory()`` counts the oneDNN-packed CPU copies (within 25% of
the RSS they add), the re-pack happens at the switch (in ``refresh_ms``), and ``sleep()`` / ``wake()`` free and
restore the inference copy and KV cache for full fine-tuning, with the wake timed and the tokens unchanged."""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch
from tiny_models import PAD, build_tiny, left_pad, prompts

from hf_dsinfer.hybrid import HybridEngine
from hf_dsinfer.modules import cpu_packed

# linears above cpu_packed.MIN_ELEMENTS, so batch-4 decoding packs them
SIZE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, vocab_size=4000)


def _rss() -> int:
    """Resident bytes after returning the allocator's free pages to the OS (live memory, not malloc's cache)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def setup():
    model = build_tiny("llama", seed=0, **SIZE).train()
    he = HybridEngine(model, inference_config={"max_out_tokens": 32, "max_batch_size": 4, "cpu_compile": False})
    ids, mask = left_pad(prompts((5, 9, 3, 7)))
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    return model, he, gen


@pytest.mark.skipif(not cpu_packed.available(), reason="oneDNN packed linear not available here")
def test_memory_counts_packed_copies_and_repack_is_in_the_switch(setup, monkeypatch):
    model, he, gen = setup
    monkeypatch.setenv(cpu_packed.ENV_VAR, "0")  # warm-up without packing: KV cache, activations, allocator pools
    with he.inference():
        he.generate(**gen)
        monkeypatch.setenv(cpu_packed.ENV_VAR, "1")
        gc.collect()
        rss0 = _rss()
        he.generate(**gen)  # the same request, now packing its linears
        gc.collect()
        grown = _rss() - rss0
    mem = he.memory()
    assert mem["cpu_packed"] > 0 and mem["cpu_packed"] == cpu_packed.packed_bytes(he.module)
    print(f"RSS growth from packing {grown / 2**20:.1f} MiB, cpu_packed {mem['cpu_packed'] / 2**20:.1f} MiB")
    assert abs(grown - mem["cpu_packed"]) <= 0.25 * mem["cpu_packed"], (grown, mem["cpu_packed"])
    packs = cpu_packed._stats["packs"]
    he.eval()  # the refresh re-packs what was packed
    assert cpu_packed._stats["packs"] > packs, "re-packed at the switch"
    packs = cpu_packed._stats["packs"]
    he.generate(**gen)
    he.train()
    assert cpu_packed._stats["packs"] == packs, "nothing left to re-pack in the generate"


def test_sleep_and_wake(setup):
    model, he, gen = setup
    with he.inference():
        he.generate(**gen)
    before = he.memory()
    freed = he.sleep()
    after = he.memory()
    assert he.asleep and after["kv_cache"] == after["cpu_packed"] == 0
    assert after["weights"] < 0.05 * before["weights"], "the parameters' storage is freed (small buffers stay)"
    assert freed >= 0.95 * (before["weights"] + before["kv_cache"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # a full fine-tuning step while the copy sleeps
    model(input_ids=gen["input_ids"], labels=gen["input_ids"]).loss.backward()
    opt.step()
    opt.zero_grad()
    he.eval()
    assert not he.asleep and he.stats.last.wake_ms > 0 and he.stats.last.refreshed
    got = he.generate(**gen)
    he.train()
    model.eval()
    assert torch.equal(got, model.generate(**gen)), "woken copy holds the trained weights"
    assert he.memory()["weights"] == before["weights"]
