"""encoder_attention: Triton launcher against the torch reference, the reference against transformers' eager BERT."""

import types

import pytest
import torch
from hf_dsinfer.kernels.encoder_attention import (
    encoder_attention,
    encoder_attention_sdpa,
    encoder_attention_torch,
    encoder_attention_triton,
)
from tolerances import ATTENTION_TOL, assert_close
from transformers.models.bert import modeling_bert

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (Hq, Hk, D, lens, T)
CASES = [
    (6, 6, 16, [5, 9, 3], 9),  # bert-like MHA, right padding
    (4, 1, 80, [17, 1], 17),  # MQA, D=80, T spans two query/key tiles, a single real token
    (4, 2, 24, [0, 7], 7),  # GQA 2:1, odd D, a row with no real token
    (2, 2, 64, [33], 33),  # one long row, several key blocks
]


def _case_id(c):
    return f"Hq{c[0]}-Hk{c[1]}-D{c[2]}-B{len(c[3])}-T{c[4]}"


def _setup(Hq, Hk, D, lens, T, dtype, device, seed=0):
    """q/k/v as strided views of one packed qkv projection, as the fused layer hands them over."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(len(lens), T, Hq + 2 * Hk, D, generator=g).to(dtype).to(device)
    q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq : Hq + Hk], qkv[:, :, Hq + Hk :]
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_encoder_triton_matches_torch(case, dtype, device):
    Hq, Hk, D, lens, T = case
    q, k, v, n = _setup(*case, dtype, device)
    assert not q.is_contiguous()
    out = encoder_attention_triton(q, k, v, n, D**-0.5)
    ref = encoder_attention_torch(q, k, v, n, D**-0.5)
    assert out.shape == (len(lens), T, Hq, D) and out.dtype == dtype
    assert_close(out, ref, ATTENTION_TOL)
    for b, length in enumerate(lens):
        assert (out[b].abs().sum() == 0) == (length == 0), "only a row without real tokens comes out as zeros"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES + [(3, 3, 8, [4, 4], 4)], ids=_case_id)  # + a batch without padding
def test_encoder_sdpa_matches_torch(case, dtype):
    """The CPU path (torch's fused SDPA with the key-padding mask) against the reference, zero-length rows included."""
    Hq, Hk, D, lens, T = case
    q, k, v, n = _setup(*case, dtype, "cpu")
    out = encoder_attention_sdpa(q, k, v, n, D**-0.5)
    assert out.shape == (len(lens), T, Hq, D) and out.dtype == dtype and out.is_contiguous()
    assert_close(out, encoder_attention_torch(q, k, v, n, D**-0.5), ATTENTION_TOL)
    for b, length in enumerate(lens):
        assert (out[b].abs().sum() == 0) == (length == 0), "only a row without real tokens comes out as zeros"


def _bert_eager(q, k, v, lens, scale):
    """transformers' eager BERT attention with the additive bidirectional padding mask it builds."""
    B, T, Hq, D = q.shape
    real = torch.arange(T, device=q.device)[None, :] < lens.long()[:, None]  # [B, T] keys
    mask = torch.zeros(B, 1, T, T, dtype=q.dtype, device=q.device)
    mask = mask.masked_fill(~real[:, None, None, :], torch.finfo(q.dtype).min)
    module = types.SimpleNamespace(training=False)
    out, _ = modeling_bert.eager_attention_forward(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scaling=scale
    )
    return out  # [B, T, H, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [c for c in CASES if c[0] == c[1] and 0 not in c[3]], ids=_case_id)
def test_encoder_reference_matches_bert_eager(case, dtype, device):
    """Every query row, padding rows included, equals HF's: the mask hides padding keys, not queries."""
    q, k, v, n = _setup(*case, dtype, device)
    scale = case[2] ** -0.5
    assert_close(encoder_attention_torch(q, k, v, n, scale), _bert_eager(q, k, v, n, scale), ATTENTION_TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_encoder_dispatch(backend, device, monkeypatch):
    monkeypatch.setenv("HF_DSINFER_BACKEND", backend)
    q, k, v, n = _setup(*CASES[0], torch.float32, device)
    assert_close(encoder_attention(q, k, v, n, 0.2), encoder_attention_torch(q, k, v, n, 0.2), ATTENTION_TOL)


@pytest.mark.parametrize("fn", [encoder_attention_triton, encoder_attention_torch, encoder_attention_sdpa])
def test_encoder_rejects_bad_arguments(fn, device):
    q, k, v, n = _setup(4, 2, 16, [3, 2], 3, torch.float16, device)
    with pytest.raises(ValueError, match="not a multiple of the 3 kv heads"):
        fn(q, torch.cat([k, k[:, :, :1]], 2), torch.cat([v, v[:, :, :1]], 2), n, 0.1)
    with pytest.raises(ValueError, match="k must have shape"):
        fn(q, k[:, :2], v, n, 0.1)
    with pytest.raises(ValueError, match="v must have shape"):
        fn(q, k, v[..., :8], n, 0.1)
    with pytest.raises(ValueError, match="k has dtype"):
        fn(q, k.float(), v, n, 0.1)
    with pytest.raises(ValueError, match="lens must have shape"):
        fn(q, k, v, n[:1], 0.1)
    with pytest.raises(ValueError, match="lens must have dtype"):
        fn(q, k, v, n.float(), 0.1)
