"""The CPU prefill path through torch's SDPA (kernels/prefill_attention.py, ``_prefill_sdpa``) computes what the
explicit fp32 reference (``masked_attention_torch``) computes: plain causal prompts, left padding, a cache before the
chunk, sliding windows, GQA; padding rows are zeros."""

from __future__ import annotations

import pytest
import torch
from hf_dsinfer.kernels.prefill_attention import masked_attention_torch, prefill_attention_torch

EXACT = dict(rtol=1e-5, atol=1e-5)  # fp32: summation order only


def _case(B, T, Hq, Hk, D, cache_lens, start, S=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g)
    kc, vc = torch.randn(B + 1, Hk, S, D, generator=g), torch.randn(B + 1, Hk, S, D, generator=g)  # a spare row
    return q, kc, vc, torch.tensor(cache_lens), torch.tensor(start)


@pytest.mark.parametrize("case", [
    dict(B=2, T=16, Hq=6, Hk=2, D=16, cache_lens=[0, 0], start=[0, 0]),  # plain causal prompts: is_causal
    dict(B=3, T=12, Hq=4, Hk=4, D=8, cache_lens=[0, 0, 0], start=[0, 3, 11]),  # left padding, a 1-token row
    dict(B=2, T=8, Hq=6, Hk=3, D=16, cache_lens=[10, 4], start=[0, 2]),  # a chunk after cached tokens
    dict(B=1, T=20, Hq=2, Hk=1, D=32, cache_lens=[0], start=[0], window=5),  # sliding window
    dict(B=2, T=9, Hq=6, Hk=2, D=16, cache_lens=[7, 0], start=[0, 4], window=4),  # all of them
])  # fmt: skip
def test_sdpa_path_equals_reference(case):
    window = case.pop("window", None)
    q, kc, vc, lens, start = _case(**case)
    got = prefill_attention_torch(q, kc, vc, lens, start, 0.25, sliding_window=window)
    t = torch.arange(q.shape[1])
    positions = lens[:, None] + t[None, :] - start[:, None]
    valid = t[None, :] >= start[:, None]
    want = masked_attention_torch(q, kc, vc, positions, valid, 0.25, window, None)
    torch.testing.assert_close(got, want, **EXACT)
    assert got.shape == q.shape and got.is_contiguous()
    assert torch.all(got[~valid] == 0)  # padding rows are zeros
