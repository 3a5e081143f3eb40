"""store_kv: the Triton launcher against the torch reference, the reference against a per-token oracle."""

import pytest
import torch
from hf_dsinfer.kernels.kv_cache import store_kv, store_kv_torch, store_kv_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (Hk, D, S, cache_lens, start, T, Bmax): mixed lengths, mixed left padding, single token, full cache, MQA.
CASES = [
    (2, 64, 16, [0, 3, 9], [0, 2, 4], 7, 4),
    (1, 80, 33, [32], [0], 1, 1),  # single token into the last slot
    (3, 96, 12, [0, 5], [3, 0], 7, 2),  # row 1 fills slot 11 exactly
    (8, 128, 9, [1, 0, 4, 2], [0, 1, 5, 3], 5, 6),
    (2, 256, 7, [0], [0], 7, 1),
]


def _random_setup(Hk, D, S, cache_lens, start, T, Bmax, dtype, device, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    B = len(cache_lens)
    k = torch.randn(B, T, Hk, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, T, Hk, D, generator=g).to(dtype).to(device)
    k_cache = torch.randn(Bmax, Hk, S, D, generator=g).to(dtype).to(device)
    v_cache = torch.randn(Bmax, Hk, S, D, generator=g).to(dtype).to(device)
    lens = torch.tensor(cache_lens, dtype=torch.int32, device=device)
    first = torch.tensor(start, dtype=torch.int64, device=device)
    return k, v, k_cache, v_cache, lens, first


def _oracle(k, v, k_cache, v_cache, cache_lens, start):
    """Per-token loop: the literal contract, independent of the vectorized reference."""
    k_out, v_out = k_cache.clone(), v_cache.clone()
    for b in range(k.shape[0]):
        for t in range(int(start[b]), k.shape[1]):
            slot = int(cache_lens[b]) + t - int(start[b])
            k_out[b, :, slot] = k[b, t]
            v_out[b, :, slot] = v[b, t]
    return k_out, v_out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"Hk{c[0]}-D{c[1]}-S{c[2]}-B{len(c[3])}-T{c[5]}")
def test_store_kv_triton_matches_torch(case, dtype, device):
    k, v, kc, vc, lens, first = _random_setup(*case, dtype=dtype, device=device)
    expect_k, expect_v = _oracle(k, v, kc, vc, lens, first)
    kc_t, vc_t = kc.clone(), vc.clone()
    store_kv_torch(k, v, kc_t, vc_t, lens, first)
    store_kv_triton(k, v, kc, vc, lens, first)
    # A copy: bit-exact, and every slot not written (padding, other rows, past the new tokens) is untouched.
    assert torch.equal(kc_t, expect_k) and torch.equal(vc_t, expect_v)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)
    assert torch.equal(lens.cpu(), torch.tensor(case[3], dtype=torch.int32))  # cache_lens are not advanced


def test_store_kv_strided_views_of_fused_qkv(device):
    """k/v as slices of a fused qkv projection output (non-contiguous in the head dim)."""
    B, T, Hq, Hk, D, S = 2, 5, 4, 2, 64, 11
    qkv = torch.randn(B, T, Hq + 2 * Hk, D, device=device, dtype=torch.float16)
    k, v = qkv[:, :, Hq : Hq + Hk], qkv[:, :, Hq + Hk :]
    assert not k.is_contiguous()
    kc = torch.zeros(B, Hk, S, D, device=device, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    lens = torch.tensor([2, 6], device=device)
    first = torch.tensor([1, 0], device=device)
    expect_k, expect_v = _oracle(k, v, kc, vc, lens, first)
    store_kv_triton(k, v, kc, vc, lens, first)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)


def test_store_kv_non_contiguous_cache_view(device):
    """A cache that is a slice of a bigger buffer (strided batch and slot dims) is written in place."""
    buf_k = torch.zeros(3, 2, 20, 64, device=device)
    buf_v = torch.zeros_like(buf_k)
    kc, vc = buf_k[:2, :, 4:14], buf_v[:2, :, 4:14]
    k = torch.randn(2, 3, 2, 64, device=device)
    v = torch.randn(2, 3, 2, 64, device=device)
    lens = torch.tensor([0, 7], device=device)
    first = torch.tensor([0, 0], device=device)
    expect_k, expect_v = _oracle(k, v, kc, vc, lens, first)
    store_kv_triton(k, v, kc, vc, lens, first)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)
    assert buf_k[:, :, :4].abs().sum() == 0 and buf_k[:, :, 14:].abs().sum() == 0 and buf_k[2].abs().sum() == 0


def test_store_kv_reference_raises_past_cache_end(device):
    k, v, kc, vc, lens, first = _random_setup(1, 64, 8, [6], [0], 3, 1, torch.float32, device)
    with pytest.raises(ValueError, match="S=8"):
        store_kv_torch(k, v, kc, vc, lens, first)


def test_store_kv_triton_drops_out_of_range_writes(device):
    """The Triton path cannot sync to check bounds: writes past S are masked, in-range ones still land."""
    k, v, kc, vc, lens, first = _random_setup(1, 64, 8, [6], [0], 3, 2, torch.float32, device)
    before_k = kc.clone()
    store_kv_triton(k, v, kc, vc, lens, first)
    assert torch.equal(kc[0, :, 6:8], k[0, :2].transpose(0, 1))
    assert torch.equal(kc[0, :, :6], before_k[0, :, :6]) and torch.equal(kc[1], before_k[1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_store_kv_dispatch(backend, device, monkeypatch):
    monkeypatch.setenv("HF_DSINFER_BACKEND", backend)
    k, v, kc, vc, lens, first = _random_setup(*CASES[0], dtype=torch.float16, device=device)
    expect_k, expect_v = _oracle(k, v, kc, vc, lens, first)
    store_kv(k, v, kc, vc, lens, first)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)


@pytest.mark.parametrize("fn", [store_kv_triton, store_kv_torch])
def test_store_kv_rejects_bad_arguments(fn, device):
    k, v, kc, vc, lens, first = _random_setup(2, 64, 8, [0, 1], [0, 0], 3, 2, torch.float16, device)
    with pytest.raises(ValueError, match="v must have shape"):
        fn(k, v[:, :2], kc, vc, lens, first)
    with pytest.raises(ValueError, match="k_cache must have shape"):
        fn(k, v, kc[:, :1], vc, lens, first)
    with pytest.raises(ValueError, match="k_cache has 1 rows"):
        fn(k, v, kc[:1], vc[:1], lens, first)
    with pytest.raises(ValueError, match="v_cache has dtype"):
        fn(k, v, kc, vc.float(), lens, first)
    with pytest.raises(ValueError, match="k must have dtype"):
        fn(k.to(torch.int32), v, kc, vc, lens, first)
    with pytest.raises(ValueError, match="v_cache is on meta"):
        fn(k, v, kc, vc.to("meta"), lens, first)
    with pytest.raises(ValueError, match="cache_lens must have dtype"):
        fn(k, v, kc, vc, lens.float(), first)
    with pytest.raises(ValueError, match="start must have shape"):
        fn(k, v, kc, vc, lens, first[:1])
    with pytest.raises(TypeError, match="cache_lens must be a torch.Tensor"):
        fn(k, v, kc, vc, [0, 1], first)


def test_store_kv_triton_needs_unit_last_stride(device):
    k, v, kc, vc, lens, first = _random_setup(2, 64, 8, [0, 1], [0, 0], 3, 2, torch.float32, device)
    k_strided = torch.randn(2, 3, 2, 128, device=device)[..., ::2]
    with pytest.raises(ValueError, match="k must have a unit stride"):
        store_kv_triton(k_strided, v, kc, vc, lens, first)
