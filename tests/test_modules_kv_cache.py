"""The static KV cache: lazy allocation, room checks, reset, growth past max_batch_size, allocation errors."""

from __future__ import annotations

import pytest
import torch

from hf_dsinfer.modules import StaticKVCache


def _cache(**kw) -> StaticKVCache:
    args = dict(kv_heads=[2, 2], head_dims=[16, 16], max_tokens=32, max_batch_size=2) | kw
    return StaticKVCache(**args)


def test_allocates_lazily_on_first_use():
    cache = _cache()
    assert cache.keys == [] and cache.lengths is None
    cache.start(2, torch.device("cpu"), torch.bfloat16)
    k, v = cache.layer(1)
    assert k.shape == (2, 2, 32, 16) and v.dtype == torch.bfloat16
    assert cache.lengths.dtype == torch.int32 and cache.lengths.tolist() == [0, 0]


def test_room_check_names_max_out_tokens_and_changes_nothing():
    cache = _cache()
    cache.start(1, torch.device("cpu"), torch.float32)
    cache.advance(torch.tensor([20]), 20)
    with pytest.raises(ValueError, match="max_out_tokens=32"):
        cache.check_room(13, fresh=False)
    assert cache.padded_len == 20 and cache.lengths[0] == 20
    cache.check_room(12, fresh=False)  # exactly full is fine
    cache.check_room(32, fresh=True)  # a fresh request only needs its own length
    with pytest.raises(ValueError, match="max_out_tokens=32"):
        cache.check_room(33, fresh=True)


def test_reset_zeroes_lengths_and_invalidates_handles():
    cache = _cache()
    cache.start(2, torch.device("cpu"), torch.float32)
    cache.advance(torch.tensor([3, 5]), 5)
    epoch = cache.epoch
    cache.reset()
    assert cache.lengths.tolist() == [0, 0] and cache.padded_len == 0 and cache.epoch == epoch + 1


def test_batch_above_max_batch_size_reallocates_to_fit():
    cache = _cache(max_batch_size=1)
    cache.start(1, torch.device("cpu"), torch.float32)
    assert cache.allocated_rows == 1
    cache.start(3, torch.device("cpu"), torch.float32)
    assert cache.allocated_rows == 3 and cache.layer(0)[0].shape[0] == 3
    cache.start(2, torch.device("cpu"), torch.float32)  # smaller batches reuse the buffers
    assert cache.allocated_rows == 3 and cache.batch == 2


def test_allocation_that_cannot_fit_names_max_out_tokens_and_batch():
    cache = _cache(max_tokens=2**40)
    with pytest.raises(MemoryError, match=r"max_out_tokens=1099511627776 and batch 2"):
        cache.start(1, torch.device("cpu"), torch.float32)
    cache.max_tokens = 8  # the cache stays usable after the failure
    cache.start(1, torch.device("cpu"), torch.float32)
    assert cache.layer(0)[0].shape == (2, 2, 8, 16)


def test_reorder_moves_rows():
    cache = _cache()
    cache.start(2, torch.device("cpu"), torch.float32)
    cache.layer(0)[0][1].fill_(1.0)
    cache.advance(torch.tensor([1, 2]), 2)
    cache.reorder(torch.tensor([1, 1]))
    assert cache.lengths.tolist() == [2, 2] and bool((cache.layer(0)[0][:2] == 1).all())


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_out_tokens"):
        _cache(max_tokens=0)
    with pytest.raises(ValueError, match="one entry per layer"):
        _cache(head_dims=[16])
