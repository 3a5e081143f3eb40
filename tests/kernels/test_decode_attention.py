"""decode_attention: split-KV Triton launcher against the torch reference, the reference against HF eager."""

import types

import pytest
import torch
from hf_dsinfer.kernels.decode_attention import (
    decode_attention,
    decode_attention_torch,
    decode_attention_triton,
    pick_num_splits,
)
from hf_dsinfer.kernels.prefill_attention import prefill_attention_torch
from tolerances import ATTENTION_TOL, assert_close
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.llama import modeling_llama

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (Hq, Hk, D, seq_lens, S, window, softcap)
CASES = [
    (8, 1, 64, [1, 7, 33], 40, None, None),  # 8:1 (MQA), odd lengths, a one-token row
    (4, 1, 80, [100], 100, None, None),  # 4:1, D=80, the cache exactly full
    (4, 4, 96, [33, 1], 48, 8, None),  # 1:1, sliding window
    (8, 2, 128, [7, 100, 64], 128, None, 30.0),  # 4:1, softcap
    (2, 1, 256, [50, 3], 64, 16, 50.0),  # D=256, window + softcap
]


def _case_id(c):
    return f"Hq{c[0]}-Hk{c[1]}-D{c[2]}-B{len(c[3])}-S{c[4]}-W{c[5]}-cap{c[6]}"


def _setup(Hq, Hk, D, seq_lens, S, dtype, device, seed=0, Bmax=None):
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    Bmax = Bmax or B
    k_cache = torch.randn(Bmax, Hk, S, D, generator=g).to(dtype).to(device)
    v_cache = torch.randn(Bmax, Hk, S, D, generator=g).to(dtype).to(device)
    q = torch.randn(B, Hq, D, generator=g).to(dtype).to(device)
    return q, k_cache, v_cache, torch.tensor(seq_lens, dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_triton_matches_torch(case, dtype, device):
    Hq, Hk, D, seq_lens, S, window, cap = case
    q, kc, vc, lens = _setup(Hq, Hk, D, seq_lens, S, dtype, device, Bmax=len(seq_lens) + 1)
    scale = D**-0.5
    ref = decode_attention_torch(q, kc, vc, lens, scale, window, cap)
    one = decode_attention_triton(q, kc, vc, lens, scale, window, cap, num_splits=1)
    many = decode_attention_triton(q, kc, vc, lens, scale, window, cap, num_splits=3)
    assert one.shape == (len(seq_lens), Hq, D) and one.dtype == dtype
    assert_close(one, ref, ATTENTION_TOL)
    assert_close(many, ref, ATTENTION_TOL)
    assert_close(many, one, ATTENTION_TOL)  # splitting only regroups the fp32 sums


@pytest.mark.parametrize("num_splits", [2, 5, 16, None])
def test_decode_split_counts_agree(num_splits, device):
    """More splits than key tiles (empty slices) and the automatic choice give the same answer."""
    q, kc, vc, lens = _setup(4, 2, 64, [1, 40, 97], 100, torch.float32, device)
    ref = decode_attention_torch(q, kc, vc, lens, 0.125)
    assert_close(decode_attention_triton(q, kc, vc, lens, 0.125, num_splits=num_splits), ref, ATTENTION_TOL)


def test_decode_window_of_one_returns_last_value(device):
    q, kc, vc, lens = _setup(4, 2, 64, [5, 1, 9], 9, torch.float32, device)
    out = decode_attention_triton(q, kc, vc, lens, 0.3, sliding_window=1, num_splits=2)
    expect = torch.stack([vc[b, :, n - 1] for b, n in enumerate([5, 1, 9])]).repeat_interleave(2, dim=1)
    assert_close(out, expect, ATTENTION_TOL)


def test_decode_noncontiguous_q_from_fused_qkv(device):
    B, Hq, Hk, D, S = 3, 4, 2, 64, 24
    qkv = torch.randn(B, Hq + 2 * Hk, D, device=device, dtype=torch.bfloat16)
    q = qkv[:, :Hq]
    assert not q.is_contiguous()
    _, kc, vc, lens = _setup(Hq, Hk, D, [3, 24, 11], S, torch.bfloat16, device)
    out = decode_attention_triton(q, kc, vc, lens, 0.125, num_splits=2)
    assert_close(out, decode_attention_torch(q.contiguous(), kc, vc, lens, 0.125), ATTENTION_TOL)


def test_decode_equals_one_token_prefill(device):
    """Decode is prefill of one token at position seq_len - 1 (the references must agree exactly)."""
    q, kc, vc, lens = _setup(8, 2, 32, [1, 6, 20], 20, torch.float32, device)
    dec = decode_attention_torch(q, kc, vc, lens, 0.2, sliding_window=4, softcap=5.0)
    zero = torch.zeros_like(lens)
    pre = prefill_attention_torch(q[:, None], kc, vc, lens - 1, zero, 0.2, sliding_window=4, softcap=5.0)
    torch.testing.assert_close(dec, pre[:, 0], atol=0, rtol=0)


def test_split_counts_are_a_few_powers_of_two():
    # The count sizes the scratch and the merge's block; powers of two keep the distinct merge compiles few.
    from hf_dsinfer.kernels._arch import assume_target

    with assume_target(90, 132):  # an H100's SM count, for meta tensors
        counts = {pick_num_splits(b, 8, 8192, torch.device("meta")) for b in range(1, 65)}
    assert all(c & (c - 1) == 0 for c in counts), counts
    assert 3 <= len(counts) <= 7 and max(counts) >= 16


def test_pick_num_splits_uses_shapes_only(device):
    assert pick_num_splits(1, 8, 100, device) == 1  # short cache: no split
    big = pick_num_splits(1, 8, 8192, device)
    assert 1 <= big <= 64 and big <= pick_num_splits(1, 1, 8192, device)
    assert pick_num_splits(64, 8, 8192, device) <= big


def _eager(module_fn, q, kc, vc, lens, window, cap, scale):
    """HF eager on [B, H, 1, D] with an additive mask built from transformers' own mask functions."""
    B, Hq, D = q.shape
    Hk = kc.shape[1]
    L = int(lens.max())
    positions = lens.long()[:, None, None] - 1  # [B, 1, 1]
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    allowed = fn(0, 0, positions, torch.arange(L, device=q.device)[None, None, :])  # [B, 1, L]
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, torch.finfo(q.dtype).min)
    module = types.SimpleNamespace(num_key_value_groups=Hq // Hk, training=False, head_dim=D)
    kwargs = {"softcap": cap} if cap is not None else {}
    out, _ = module_fn(module, q[:, :, None], kc[:B, :, :L], vc[:B, :, :L], mask[:, None], scaling=scale, **kwargs)
    return out[:, 0]  # [B, 1, Hq, D] -> [B, Hq, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_reference_matches_hf_eager(case, dtype, device):
    Hq, Hk, D, seq_lens, S, window, cap = case
    q, kc, vc, lens = _setup(Hq, Hk, D, seq_lens, S, dtype, device)
    scale = D**-0.5
    if window is None and cap is None:
        expect = _eager(modeling_llama.eager_attention_forward, q, kc, vc, lens, None, None, scale)
    else:
        expect = _eager(modeling_gemma2.eager_attention_forward, q, kc, vc, lens, window, cap, scale)
    assert_close(decode_attention_torch(q, kc, vc, lens, scale, window, cap), expect, ATTENTION_TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_dispatch(backend, device, monkeypatch):
    monkeypatch.setenv("HF_DSINFER_BACKEND", backend)
    q, kc, vc, lens = _setup(*CASES[0][:5], torch.float32, device)
    assert_close(decode_attention(q, kc, vc, lens, 0.1), decode_attention_torch(q, kc, vc, lens, 0.1), ATTENTION_TOL)


@pytest.mark.parametrize("fn", [decode_attention_triton, decode_attention_torch])
def test_decode_rejects_bad_arguments(fn, device):
    q, kc, vc, lens = _setup(6, 2, 64, [3, 5], 8, torch.float16, device)
    with pytest.raises(ValueError, match="q has 6 heads, not a multiple of the 4 kv heads"):
        fn(q, kc.repeat(1, 2, 1, 1), vc.repeat(1, 2, 1, 1), lens, 0.1)
    with pytest.raises(ValueError, match="q must have 3 dims"):
        fn(q[:, None], kc, vc, lens, 0.1)
    with pytest.raises(ValueError, match="k_cache must have shape"):
        fn(q, kc[..., :32], vc, lens, 0.1)
    with pytest.raises(ValueError, match="k_cache has 1 rows"):
        fn(q, kc[:1], vc[:1], lens, 0.1)
    with pytest.raises(ValueError, match="v_cache has dtype"):
        fn(q, kc, vc.to(torch.bfloat16), lens, 0.1)
    with pytest.raises(ValueError, match="v_cache is on meta"):
        fn(q, kc, vc.to("meta"), lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens must have dtype"):
        fn(q, kc, vc, lens.float(), 0.1)
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        fn(q, kc, vc, lens[:1], 0.1)


def test_decode_triton_rejects_bad_num_splits_and_strides(device):
    q, kc, vc, lens = _setup(4, 2, 64, [3, 5], 8, torch.float32, device)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention_triton(q, kc, vc, lens, 0.1, num_splits=0)
    with pytest.raises(ValueError, match="k_cache must have a unit stride"):
        decode_attention_triton(q, kc.transpose(2, 3).contiguous().transpose(2, 3), vc, lens, 0.1)


@pytest.mark.cuda
def test_decode_cuda_graph_replay():
    """No host sync in the launcher: it captures into a CUDA graph and replays with new lengths in place."""
    q, kc, vc, lens = _setup(32, 8, 128, [100, 2000], 4096, torch.float16, torch.device("cuda"))
    decode_attention(q, kc, vc, lens, 0.088)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, kc, vc, lens, 0.088)
    lens.copy_(torch.tensor([4096, 17], device="cuda"))
    graph.replay()
    assert_close(out, decode_attention_torch(q, kc, vc, lens, 0.088), ATTENTION_TOL)


def test_bench_attention_rows_smoke(device, monkeypatch):
    """bench_attention end to end at toy sizes (timing stubbed): every row carries the columns bench.py prints."""
    from hf_dsinfer.kernels import bench_attention as ba

    monkeypatch.setattr(ba, "DEVICE", device.type)
    monkeypatch.setattr(ba, "N_HEADS", 4)
    monkeypatch.setattr(ba, "N_KV_HEADS", 2)
    monkeypatch.setattr(ba, "HEAD_DIM", 32)
    monkeypatch.setattr(ba, "DECODE_BATCHES", (2,))
    monkeypatch.setattr(ba, "DECODE_LENS", (20,))
    monkeypatch.setattr(ba, "PREFILL_BATCHES", (1,))
    monkeypatch.setattr(ba, "PREFILL_LENS", (16,))
    monkeypatch.setattr(ba, "STORE_SHAPES", ((2, 1, 8),))
    monkeypatch.setattr(ba, "_bench_ms", lambda fn: (fn(), 1.0)[1])
    rows = ba.run_attention_benchmarks(copy_gbs=100.0, dtype=torch.float16)
    assert [r["kernel"] for r in rows] == ["store_kv", "decode_attention", "prefill_attention"]
    keys = {"kernel", "shape", "dtype", "triton_ms", "ref_ms", "triton_gbs", "ref_gbs", "pct_copy_bw", "sdpa_ms"}
    for r in rows:
        assert keys <= r.keys() and r["dtype"] == "float16" and r["triton_ms"] == 1.0
    dec = rows[1]
    assert dec["triton_gbs"] == pytest.approx((2 * 2 * 2 * 20 * 32 + 2 * 2 * 4 * 32) * 2 / 1e6)
    assert rows[2]["triton_tflops"] > 0 and rows[2]["sdpa_ms"] == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 3])
def test_decode_sdpa_path_matches_masked_reference(window, dtype, device):
    """The fused-SDPA path of decode_attention_torch equals the explicit fp32 reference, empty rows included."""
    from hf_dsinfer.kernels.prefill_attention import masked_attention_torch

    q, kc, vc, lens = _setup(6, 2, 48, [0, 1, 9, 17], 20, dtype, device, Bmax=5)
    out = decode_attention_torch(q, kc, vc, lens, 0.17, sliding_window=window)
    positions = lens.long()[:, None] - 1
    ref = masked_attention_torch(q[:, None], kc, vc, positions, positions >= 0, 0.17, window, None)[:, 0]
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # nothing cached: zeros, not NaN
    assert_close(out, ref, ATTENTION_TOL)
