"""act_and_mul: Triton launcher vs torch reference, reference vs transformers' ACT2FN, checks, dispatch."""

import pytest
import torch
from hf_dsinfer.kernels import activations
from hf_dsinfer.kernels.activations import act_and_mul, act_and_mul_torch, act_and_mul_triton
from tolerances import assert_close
from transformers.activations import ACT2FN

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTS = ["silu", "gelu", "gelu_tanh"]
HF_NAMES = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
# Shapes of x [..., 2I]: non-powers of two, a single token, a 3D batch, an I larger than one column block.
SHAPES = [(1, 2 * 37), (3, 2 * 96), (2, 3, 2 * 200), (2, 2 * 1100)]


def _x(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(shape, generator=g)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_act_and_mul_triton_matches_reference(device, dtype, act, shape):
    x = _x(shape, dtype, device)
    got = act_and_mul_triton(x, act)
    want = act_and_mul_torch(x, act)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_act_and_mul_row_strided_input(device, dtype):
    big = _x((5, 300), dtype, device, seed=1)
    x = big[:, 10:210]  # [5, 200] with row stride 300
    assert not x.is_contiguous()
    for act in ACTS:
        assert_close(act_and_mul_triton(x, act), act_and_mul_torch(x.contiguous(), act))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_reference_matches_act2fn(dtype, act):
    x = _x((4, 2 * 96), dtype, "cpu", seed=2)
    gate, up = x[..., :96], x[..., 96:]
    want = ACT2FN[HF_NAMES[act]](gate) * up  # what HF's gated MLPs compute
    torch.testing.assert_close(act_and_mul_torch(x, act), want, atol=0, rtol=0)
    torch.testing.assert_close(act_and_mul_torch(x, HF_NAMES[act]), want, atol=0, rtol=0)


def test_activations_differ():
    # Guards against a kernel that ignores its ACT switch: the three activations give different results.
    x = _x((2, 2 * 64), torch.float32, "cpu", seed=3)
    outs = [act_and_mul_torch(x, a) for a in ACTS]
    assert not torch.allclose(outs[0], outs[1]) and not torch.allclose(outs[1], outs[2], atol=1e-6, rtol=0)


def test_launcher_rejects_bad_arguments(device):
    x = _x((2, 64), torch.float16, device)
    with pytest.raises(ValueError, match="x"):
        act_and_mul_triton(x[:, :63], "silu")
    with pytest.raises(ValueError, match="x"):
        act_and_mul_triton(x.to(torch.int32), "silu")
    with pytest.raises(ValueError, match="x"):
        act_and_mul_triton(x.t(), "silu")  # last dim not unit stride
    with pytest.raises(ValueError, match="activation"):
        act_and_mul_triton(x, "relu")
    with pytest.raises(TypeError, match="x"):
        act_and_mul_triton(x.tolist(), "silu")
    with pytest.raises(ValueError, match="activation"):
        act_and_mul_torch(x, "tanh")


def test_dispatch_follows_env(monkeypatch, device):
    calls = []
    monkeypatch.setattr(activations, "act_and_mul_triton", lambda *a, **kw: calls.append("triton") or "T")
    monkeypatch.setattr(activations, "act_and_mul_torch", lambda *a, **kw: calls.append("torch") or "R")
    x = _x((2, 16), torch.float32, device)
    monkeypatch.setenv("HF_DSINFER_BACKEND", "torch")
    assert act_and_mul(x, "silu") == "R"
    monkeypatch.setenv("HF_DSINFER_BACKEND", "triton")
    assert act_and_mul(x, "silu") == "T"
    monkeypatch.setenv("HF_DSINFER_BACKEND", "auto")
    assert act_and_mul(x, "silu") == ("T" if x.is_cuda else "R")
    monkeypatch.setenv("HF_DSINFER_BACKEND", "bogus")
    with pytest.raises(ValueError, match="HF_DSINFER_BACKEND"):
        act_and_mul(x, "silu")
