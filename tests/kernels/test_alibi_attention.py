"""ALiBi (BLOOM) in prefill and decode attention: Triton (interpreter on CPU) against the torch reference, and the
reference against HF BLOOM's own bias (``slopes * (cumsum(mask) - 1)`` on a left-padded layout)."""

import pytest
import torch
from hf_dsinfer.kernels.decode_attention import decode_attention_torch, decode_attention_triton
from hf_dsinfer.kernels.kv_cache import store_kv_torch
from hf_dsinfer.kernels.prefill_attention import prefill_attention_torch, prefill_attention_triton
from tolerances import ATTENTION_TOL, assert_close
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from hf_dsinfer.policies.bloom import alibi_slopes


def _slopes(Hq, device):
    return torch.tensor(alibi_slopes(Hq), dtype=torch.float32, device=device)


def _prefill_setup(Hq, Hk, D, cache_lens, start, T, S, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(cache_lens)
    kc = torch.randn(B, Hk, S, D, generator=g).to(dtype).to(device)
    vc = torch.randn(B, Hk, S, D, generator=g).to(dtype).to(device)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, T, Hk, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, T, Hk, D, generator=g).to(dtype).to(device)
    lens = torch.tensor(cache_lens, dtype=torch.int32, device=device)
    first = torch.tensor(start, dtype=torch.int32, device=device)
    store_kv_torch(k, v, kc, vc, lens, first)
    return q, kc, vc, lens, first


# (Hq, Hk, D, cache_lens, start, T, S): 6 heads (not a power of two), GQA 2:1, history + padding, a window
PREFILL_CASES = [(6, 6, 16, [0, 5], [2, 0], 7, 16, None), (4, 2, 32, [3, 0, 9], [0, 4, 1], 9, 24, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_alibi_triton_matches_torch(case, dtype, device):
    Hq, Hk, D, cache_lens, start, T, S, window = case
    q, kc, vc, lens, first = _prefill_setup(Hq, Hk, D, cache_lens, start, T, S, dtype, device)
    slopes = _slopes(Hq, device)
    ref = prefill_attention_torch(q, kc, vc, lens, first, D**-0.5, window, alibi_slopes=slopes)
    out = prefill_attention_triton(q, kc, vc, lens, first, D**-0.5, window, alibi_slopes=slopes)
    assert_close(out, ref, ATTENTION_TOL)
    plain = prefill_attention_torch(q, kc, vc, lens, first, D**-0.5, window)
    assert not torch.allclose(plain.float(), ref.float(), atol=1e-3)  # the bias changes the result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_alibi_triton_matches_torch(dtype, device):
    Hq, Hk, D, S = 6, 3, 16, 40
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(3, Hk, S, D, generator=g).to(dtype).to(device)
    vc = torch.randn(3, Hk, S, D, generator=g).to(dtype).to(device)
    q = torch.randn(3, Hq, D, generator=g).to(dtype).to(device)
    lens = torch.tensor([1, 17, 40], dtype=torch.int32, device=device)
    slopes = _slopes(Hq, device)
    ref = decode_attention_torch(q, kc, vc, lens, D**-0.5, alibi_slopes=slopes)
    for splits in (1, 3):
        out = decode_attention_triton(q, kc, vc, lens, D**-0.5, num_splits=splits, alibi_slopes=slopes)
        assert_close(out, ref, ATTENTION_TOL)
    # decode at position p equals the last row of a prefill over the same keys
    one = prefill_attention_torch(q[:, None], kc, vc, lens - 1, torch.zeros_like(lens), D**-0.5, alibi_slopes=slopes)
    assert_close(ref, one[:, 0], ATTENTION_TOL)


def test_alibi_reference_matches_bloom_bias():
    """HF BLOOM: scores ``q k^T / sqrt(D) + slope * (cumsum(mask) - 1)`` over a left-padded row; the fused layout
    stores only the real tokens (slots 0..n-1) and must give the same outputs for them."""
    H, D, T, pad = 6, 16, 7, 3
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, H, T, D, generator=g) for _ in range(3))
    mask = torch.tensor([[0] * pad + [1] * (T - pad)])
    alibi = build_alibi_tensor(mask, H, torch.float32).view(1, H, 1, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril() & mask.bool()[:, None, :]
    scores = (q @ k.transpose(-1, -2)) * D**-0.5 + alibi
    want = torch.softmax(scores.masked_fill(~causal[:, None], float("-inf")), -1) @ v  # [1, H, T, D]

    n = T - pad
    kc, vc = torch.zeros(1, H, 8, D), torch.zeros(1, H, 8, D)
    kc[0, :, :n], vc[0, :, :n] = k[0, :, pad:], v[0, :, pad:]
    got = prefill_attention_torch(
        q.transpose(1, 2).contiguous(), kc, vc, torch.tensor([0], dtype=torch.int32),
        torch.tensor([pad], dtype=torch.int32), D**-0.5, alibi_slopes=_slopes(H, "cpu"),
    )  # fmt: skip
    torch.testing.assert_close(got[0, pad:], want[0, :, pad:].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_alibi_slopes_are_checked(device):
    q, kc, vc, lens, first = _prefill_setup(4, 2, 16, [0], [0], 3, 8, torch.float32, device)
    with pytest.raises(ValueError, match="alibi_slopes"):
        prefill_attention_torch(q, kc, vc, lens, first, 0.25, alibi_slopes=_slopes(3, device))
