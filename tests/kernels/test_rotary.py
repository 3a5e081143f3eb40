"""Rotary: Triton launcher vs torch reference (in place), references vs HF llama / gptj rotary, checks, dispatch."""

import pytest
import torch
from hf_dsinfer.kernels import rotary
from hf_dsinfer.kernels.rotary import apply_rotary_, apply_rotary_torch, apply_rotary_triton
from tolerances import assert_close
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply_rotary
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rotary

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (head_dim D, rotary dim R): full rotary at the common head dims, and partial rotary.
DIMS = [(64, 64), (80, 80), (96, 96), (128, 128), (96, 32), (80, 40)]


def _tables(R, max_pos=64, base=10000.0, device="cpu"):
    inv_freq = 1.0 / (base ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return ang.cos().to(device), ang.sin().to(device)


def _qk(N, Hq, Hk, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, Hq, D, generator=g).to(dtype).to(device)
    k = torch.randn(N, Hk, D, generator=g).to(dtype).to(device)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,R", DIMS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_triton_matches_reference(device, dtype, D, R, interleaved):
    q, k = _qk(5, 4, 2, D, dtype, device)
    cos, sin = _tables(R, device=device)
    pos = torch.tensor([0, 7, 63, 3, 3], device=device)
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    out = apply_rotary_triton(q1, k1, cos, sin, pos, interleaved)
    assert out[0] is q1 and out[1] is k1  # in place, returns its inputs
    apply_rotary_torch(q2, k2, cos, sin, pos, interleaved)
    assert_close(q1, q2)
    assert_close(k1, k2)
    # Dims past the rotary dim are untouched (bitwise); position 0 is the identity rotation.
    assert torch.equal(q1[..., R:], q[..., R:]) and torch.equal(k1[..., R:], k[..., R:])
    assert_close(q1[0], q[0])
    assert not torch.allclose(q1[1].float(), q[1].float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_on_views_into_fused_qkv(device, dtype, interleaved):
    N, Hq, Hk, D, R = 3, 4, 2, 64, 48
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(N, (Hq + 2 * Hk) * D, generator=g).to(dtype).to(device)
    orig = qkv.clone()
    q = qkv[:, : Hq * D].view(N, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(N, Hk, D)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = _tables(R, device=device)
    pos = torch.tensor([5, 0, 2], dtype=torch.int32, device=device)
    apply_rotary_triton(q, k, cos, sin, pos, interleaved)
    q_ref, k_ref = orig[:, : Hq * D].view(N, Hq, D).clone(), orig[:, Hq * D : (Hq + Hk) * D].view(N, Hk, D).clone()
    apply_rotary_torch(q_ref, k_ref, cos, sin, pos, interleaved)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(qkv[:, (Hq + Hk) * D :], orig[:, (Hq + Hk) * D :])  # v is not touched


def test_rotary_head_major_views_and_single_token(device):
    # q viewed as [N, H, D] out of a head-major [H, N, D] buffer: token stride D, head stride N * D.
    torch.manual_seed(0)
    q = torch.randn(4, 3, 80, device=device).transpose(0, 1)
    k = torch.randn(2, 3, 80, device=device).transpose(0, 1)
    assert q.stride() == (80, 240, 1)
    cos, sin = _tables(80, device=device)
    cases = [(q, k, torch.tensor([11, 0, 5], device=device)), (q[:1], k[:1], torch.tensor([9], device=device))]
    for qq, kk, pos in cases:
        q_ref, k_ref = qq.clone(), kk.clone()
        apply_rotary_triton(qq, kk, cos, sin, pos)
        apply_rotary_torch(q_ref, k_ref, cos, sin, pos)
        assert_close(qq, q_ref)
        assert_close(kk, k_ref)


@pytest.mark.parametrize("D,R", [(64, 64), (96, 32)])
def test_rotate_half_reference_matches_llama(D, R):
    N, Hq, Hk = 6, 3, 2
    q, k = _qk(N, Hq, Hk, D, torch.float32, "cpu", seed=2)
    cos, sin = _tables(R)
    pos = torch.tensor([0, 1, 2, 30, 31, 9])
    # HF layout: [B, H, T, D] with cos/sin [B, T, R] = cat(freqs, freqs); partial rotary splits off the tail.
    cos_hf = torch.cat([cos, cos], dim=-1)[pos][None]
    sin_hf = torch.cat([sin, sin], dim=-1)[pos][None]
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    q_rot, k_rot = llama_apply_rotary(qh[..., :R], kh[..., :R], cos_hf, sin_hf)
    want_q = torch.cat([q_rot, qh[..., R:]], dim=-1)[0].transpose(0, 1)
    want_k = torch.cat([k_rot, kh[..., R:]], dim=-1)[0].transpose(0, 1)
    apply_rotary_torch(q, k, cos, sin, pos, interleaved=False)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("D,R", [(64, 64), (80, 32)])
def test_interleaved_reference_matches_gptj(D, R):
    N, H = 5, 3
    q, _ = _qk(N, H, 1, D, torch.float32, "cpu", seed=3)
    k = q.clone()
    cos, sin = _tables(R)
    pos = torch.tensor([4, 0, 17, 2, 2])
    # GPT-J: tensor [B, T, H, D], sin/cos [B, T, R/2], rotary on the first R dims.
    t = q[None]
    want = torch.cat([gptj_apply_rotary(t[..., :R], sin[pos][None], cos[pos][None]), t[..., R:]], dim=-1)[0]
    apply_rotary_torch(q, k, cos, sin, pos, interleaved=True)
    torch.testing.assert_close(q, want, atol=1e-6, rtol=1e-6)


def test_launcher_rejects_bad_arguments(device):
    q, k = _qk(4, 2, 1, 64, torch.float16, device)
    cos, sin = _tables(64, device=device)
    pos = torch.arange(4, device=device)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary_triton(q, k, cos, sin, torch.arange(3, device=device))
    with pytest.raises(ValueError, match="positions"):
        apply_rotary_triton(q, k, cos, sin, pos.float())
    with pytest.raises(ValueError, match="positions"):
        apply_rotary_triton(q, k, cos, sin, pos.to("meta"))
    with pytest.raises(ValueError, match="sin"):
        apply_rotary_triton(q, k, cos, sin[:, :16], pos)
    with pytest.raises(ValueError, match="cos"):
        apply_rotary_triton(q, k, cos.to("meta"), sin, pos)
    with pytest.raises(ValueError, match="cos"):
        c2, s2 = _tables(128, device=device)  # R = 128 > D = 64
        apply_rotary_triton(q, k, c2, s2, pos)
    with pytest.raises(ValueError, match="k"):
        apply_rotary_triton(q, k[..., :32], cos, sin, pos)
    with pytest.raises(ValueError, match="k"):
        apply_rotary_triton(q, k.float(), cos, sin, pos)
    with pytest.raises(ValueError, match="k"):
        apply_rotary_triton(q, k.to("meta"), cos, sin, pos)
    with pytest.raises(ValueError, match="q"):
        apply_rotary_triton(q.reshape(4, 128), k, cos, sin, pos)
    with pytest.raises(ValueError, match="q"):
        apply_rotary_triton(torch.randn(4, 2, 64, 2, device=device)[..., 0], k, cos, sin, pos)  # last stride 2


def test_dispatch_follows_env(monkeypatch, device):
    calls = []
    monkeypatch.setattr(rotary, "apply_rotary_triton", lambda *a, **kw: calls.append("triton") or "T")
    monkeypatch.setattr(rotary, "apply_rotary_torch", lambda *a, **kw: calls.append("torch") or "R")
    q, k = _qk(2, 2, 1, 64, torch.float32, device)
    cos, sin = _tables(64, device=device)
    pos = torch.arange(2, device=device)
    monkeypatch.setenv("HF_DSINFER_BACKEND", "torch")
    assert apply_rotary_(q, k, cos, sin, pos) == "R"
    monkeypatch.setenv("HF_DSINFER_BACKEND", "triton")
    assert apply_rotary_(q, k, cos, sin, pos) == "T"
    assert calls == ["torch", "triton"]
