"""prefill_attention: Triton launcher against the torch reference, the reference against transformers' eager."""

import types

import pytest
import torch
from hf_dsinfer.kernels.kv_cache import store_kv_torch
from hf_dsinfer.kernels.prefill_attention import (
    prefill_attention,
    prefill_attention_torch,
    prefill_attention_triton,
)
from tolerances import ATTENTION_TOL, assert_close
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.llama import modeling_llama

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (Hq, Hk, D, cache_lens, start, T, S, window, softcap)
CASES = [
    (8, 1, 64, [0, 5, 30], [0, 2, 6], 7, 40, None, None),  # 8:1, mixed history and padding
    (4, 1, 80, [33], [0], 1, 40, None, None),  # a single token, D=80
    (4, 1, 96, [0, 7], [3, 0], 9, 20, 4, None),  # 4:1, sliding window
    (2, 2, 128, [100, 1], [0, 4], 6, 112, None, 50.0),  # 1:1, softcap, long history
    (4, 2, 256, [0], [0], 17, 17, 8, 30.0),  # T spans two query tiles; window + softcap
    (2, 1, 64, [7, 0, 33, 1], [2, 0, 9, 10], 10, 48, 5, None),  # one valid token; a fully padded row
]


def _case_id(c):
    return f"Hq{c[0]}-Hk{c[1]}-D{c[2]}-B{len(c[3])}-T{c[5]}-W{c[7]}-cap{c[8]}"


def _setup(Hq, Hk, D, cache_lens, start, T, S, dtype, device, seed=0):
    """Random cache history plus new left-padded tokens written with store_kv, as a model layer would."""
    g = torch.Generator().manual_seed(seed)
    B = len(cache_lens)
    k_cache = torch.randn(B, Hk, S, D, generator=g).to(dtype).to(device)
    v_cache = torch.randn(B, Hk, S, D, generator=g).to(dtype).to(device)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, T, Hk, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, T, Hk, D, generator=g).to(dtype).to(device)
    lens = torch.tensor(cache_lens, dtype=torch.int32, device=device)
    first = torch.tensor(start, dtype=torch.int32, device=device)
    store_kv_torch(k, v, k_cache, v_cache, lens, first)
    return q, k_cache, v_cache, lens, first


def _valid_rows(start, T):
    return torch.arange(T)[None, :] >= torch.tensor(start)[:, None]  # [B, T]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prefill_triton_matches_torch(case, dtype, device):
    Hq, Hk, D, cache_lens, start, T, S, window, cap = case
    q, kc, vc, lens, first = _setup(Hq, Hk, D, cache_lens, start, T, S, dtype, device)
    scale = D**-0.5
    out = prefill_attention_triton(q, kc, vc, lens, first, scale, window, cap)
    ref = prefill_attention_torch(q, kc, vc, lens, first, scale, window, cap)
    assert out.shape == (len(cache_lens), T, Hq, D) and out.dtype == dtype
    assert_close(out, ref, ATTENTION_TOL)
    pad = ~_valid_rows(start, T)
    assert out[pad.to(device)].abs().sum() == 0 and ref[pad.to(device)].abs().sum() == 0
    assert out[~pad.to(device)].abs().sum() > 0


def test_prefill_noncontiguous_q_from_fused_qkv(device):
    B, T, Hq, Hk, D, S = 2, 5, 4, 2, 64, 12
    qkv = torch.randn(B, T, Hq + 2 * Hk, D, device=device, dtype=torch.float16)
    q = qkv[:, :, :Hq]
    assert not q.is_contiguous()
    kc = torch.randn(B, Hk, S, D, device=device, dtype=torch.float16)
    vc = torch.randn_like(kc)
    lens = torch.tensor([3, 0], device=device)
    first = torch.tensor([0, 2], device=device)
    out = prefill_attention_triton(q, kc, vc, lens, first, 0.125)
    assert_close(out, prefill_attention_torch(q.contiguous(), kc, vc, lens, first, 0.125), ATTENTION_TOL)


def test_prefill_cache_view_with_spare_rows_and_int64_lengths(device):
    """Bmax > B, a cache that is a strided slice of a bigger buffer, and int64 cache_lens/start."""
    q, kc, vc, lens, first = _setup(4, 2, 32, [3, 0], [1, 2], 4, 10, torch.float16, device)
    big_k = torch.randn(3, 2, 16, 32, device=device, dtype=torch.float16)
    big_v = torch.randn_like(big_k)
    big_k[:2, :, 2:12], big_v[:2, :, 2:12] = kc, vc
    view_k, view_v = big_k[:, :, 2:12], big_v[:, :, 2:12]
    out = prefill_attention_triton(q, view_k, view_v, lens.long(), first.long(), 0.3, softcap=20.0)
    assert_close(out, prefill_attention_torch(q, kc, vc, lens, first, 0.3, softcap=20.0), ATTENTION_TOL)


def test_prefill_window_wider_than_history_equals_full(device):
    """A window covering every position changes nothing; a window of 1 attends only the token itself."""
    q, kc, vc, lens, first = _setup(2, 1, 64, [3, 0], [0, 1], 5, 9, torch.float32, device)
    full = prefill_attention_triton(q, kc, vc, lens, first, 0.2)
    assert_close(prefill_attention_triton(q, kc, vc, lens, first, 0.2, sliding_window=9), full, ATTENTION_TOL)
    own = prefill_attention_triton(q, kc, vc, lens, first, 0.2, sliding_window=1)
    expect = torch.stack([vc[0, 0, 3:8], torch.cat([torch.zeros(1, 64, device=device), vc[1, 0, 0:4]])])
    assert_close(own[:, :, 0], expect, ATTENTION_TOL)


def test_prefill_reference_chunked_equals_one_shot(device):
    """Prefilling 4 + 5 tokens in two calls gives the same rows as one call over all 9 (cache_lens semantics)."""
    g = torch.Generator().manual_seed(1)
    Hq, Hk, D, S = 4, 2, 32, 12
    q = torch.randn(1, 9, Hq, D, generator=g).to(device)
    k = torch.randn(1, 9, Hk, D, generator=g).to(device)
    v = torch.randn(1, 9, Hk, D, generator=g).to(device)
    kc = torch.zeros(1, Hk, S, D, device=device)
    vc = torch.zeros_like(kc)
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    store_kv_torch(k, v, kc, vc, zero, zero)
    one_shot = prefill_attention_torch(q, kc, vc, zero, zero, 0.3, sliding_window=3)
    second = prefill_attention_triton(q[:, 4:], kc, vc, zero + 4, zero, 0.3, sliding_window=3)
    assert_close(second, one_shot[:, 4:], ATTENTION_TOL)


def _eager_inputs(case, dtype, device):
    """The same problem as HF eager sees it: [B, H, T, D] queries, the cache prefix as keys, an additive mask."""
    Hq, Hk, D, cache_lens, start, T, S, window, cap = case
    q, kc, vc, lens, first = _setup(Hq, Hk, D, cache_lens, start, T, S, dtype, device)
    L = max(c + T - s for c, s in zip(cache_lens, start, strict=True))
    positions = lens.long()[:, None] + torch.arange(T, device=device)[None, :] - first.long()[:, None]  # [B, T]
    kv_idx = torch.arange(L, device=device)
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    allowed = fn(0, 0, positions[:, :, None], kv_idx[None, None, :])  # [B, T, L]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    module = types.SimpleNamespace(num_key_value_groups=Hq // Hk, training=False, head_dim=D)
    return (q, kc, vc, lens, first), (module, q.transpose(1, 2), kc[:, :, :L], vc[:, :, :L], mask[:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [c for c in CASES if c[7] is None and c[8] is None], ids=_case_id)
def test_prefill_reference_matches_llama_eager(case, dtype, device):
    (q, kc, vc, lens, first), (module, eq, ek, ev, mask) = _eager_inputs(case, dtype, device)
    scale = case[2] ** -0.5
    expect, _ = modeling_llama.eager_attention_forward(module, eq, ek, ev, mask, scaling=scale)
    ref = prefill_attention_torch(q, kc, vc, lens, first, scale)
    valid = _valid_rows(case[4], case[5]).to(device)
    assert_close(ref[valid], expect[valid], ATTENTION_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [c for c in CASES if c[7] is not None or c[8] is not None], ids=_case_id)
def test_prefill_reference_matches_gemma2_eager(case, dtype, device):
    """Gemma2's eager attention: softcap on the scaled scores, sliding-window causal mask."""
    (q, kc, vc, lens, first), (module, eq, ek, ev, mask) = _eager_inputs(case, dtype, device)
    scale, window, cap = case[2] ** -0.5, case[7], case[8]
    expect, _ = modeling_gemma2.eager_attention_forward(module, eq, ek, ev, mask, scaling=scale, softcap=cap)
    ref = prefill_attention_torch(q, kc, vc, lens, first, scale, sliding_window=window, softcap=cap)
    valid = _valid_rows(case[4], case[5]).to(device)
    assert_close(ref[valid], expect[valid], ATTENTION_TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_dispatch(backend, device, monkeypatch):
    monkeypatch.setenv("HF_DSINFER_BACKEND", backend)
    q, kc, vc, lens, first = _setup(*CASES[0][:7], torch.float32, device)
    ref = prefill_attention_torch(q, kc, vc, lens, first, 0.1)
    assert_close(prefill_attention(q, kc, vc, lens, first, 0.1), ref, ATTENTION_TOL)


@pytest.mark.parametrize("fn", [prefill_attention_triton, prefill_attention_torch])
def test_prefill_rejects_bad_arguments(fn, device):
    q, kc, vc, lens, first = _setup(4, 2, 64, [0, 1], [0, 0], 3, 8, torch.float16, device)
    with pytest.raises(ValueError, match="not a multiple of the 3 kv heads"):
        fn(q, kc[:, :1].expand(2, 3, 8, 64), vc[:, :1].expand(2, 3, 8, 64), lens, first, 0.1)
    with pytest.raises(ValueError, match="q must have 4 dims"):
        fn(q[:, 0], kc, vc, lens, first, 0.1)
    with pytest.raises(ValueError, match="k_cache must have shape"):
        fn(q, kc[..., :32], vc, lens, first, 0.1)
    with pytest.raises(ValueError, match="v_cache must have shape"):
        fn(q, kc, vc[:, :, :4], lens, first, 0.1)
    with pytest.raises(ValueError, match="k_cache has dtype"):
        fn(q, kc.float(), vc, lens, first, 0.1)
    with pytest.raises(ValueError, match="q must have dtype"):
        fn(q.to(torch.int16), kc, vc, lens, first, 0.1)
    with pytest.raises(ValueError, match="k_cache is on meta"):
        fn(q, kc.to("meta"), vc, lens, first, 0.1)
    with pytest.raises(ValueError, match="cache_lens must have shape"):
        fn(q, kc, vc, lens[:1], first, 0.1)
    with pytest.raises(ValueError, match="start must have dtype"):
        fn(q, kc, vc, lens, first.float(), 0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        fn(q, kc, vc, lens, first, 0.1, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        fn(q, kc, vc, lens, first, 0.1, softcap=-1.0)
