"""RMSNorm / LayerNorm: Triton launcher vs torch reference, references vs HF modules, argument checks, dispatch."""

import pytest
import torch
from hf_dsinfer.kernels import norms
from hf_dsinfer.kernels.norms import (
    layer_norm,
    layer_norm_torch,
    layer_norm_triton,
    rms_norm,
    rms_norm_torch,
    rms_norm_triton,
)
from tolerances import assert_close
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 37), (3, 96), (2, 3, 200), (5, 128)]


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype).to(device)
    res = torch.randn(shape, generator=g).to(dtype).to(device)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
    b = (0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
    return x, res, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_triton_matches_reference(device, dtype, shape, weight_offset, with_residual):
    x, res, w, _ = _inputs(shape, dtype, device)
    residual = res if with_residual else None
    got = rms_norm_triton(x, w, 1e-6, residual, weight_offset)
    want = rms_norm_torch(x, w, 1e-6, residual, weight_offset)
    if with_residual:
        assert isinstance(got, tuple) and len(got) == 2
        torch.testing.assert_close(got[1], x + res, atol=0, rtol=0)  # the sum is rounded exactly like torch's add
        assert_close(got[0], want[0])
        got = got[0]
    else:
        assert_close(got, want)
    assert got.shape == x.shape and got.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_triton_matches_reference(device, dtype, shape, with_bias, with_residual):
    x, res, w, b = _inputs(shape, dtype, device, seed=1)
    bias = b if with_bias else None
    residual = res if with_residual else None
    got = layer_norm_triton(x, w, bias, 1e-5, residual)
    want = layer_norm_torch(x, w, bias, 1e-5, residual)
    if with_residual:
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
        got, want = got[0], want[0]
    assert_close(got, want)
    assert got.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_accept_row_strided_inputs(device, dtype):
    # x and residual are column slices of wider buffers: unit last stride, row stride != C.
    torch.manual_seed(0)
    big = torch.randn(6, 160, dtype=dtype, device=device)
    big_r = torch.randn(6, 150, dtype=dtype, device=device)
    x, res = big[:, 7:103], big_r[:, :96]
    assert not x.is_contiguous() and x.stride(-1) == 1
    w = torch.randn(96, dtype=dtype, device=device)
    got = rms_norm_triton(x, w, 1e-5, res)
    want = rms_norm_torch(x, w, 1e-5, res)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    assert_close(layer_norm_triton(x, w, None, 1e-5), layer_norm_torch(x, w, None, 1e-5))
    # A 3D view whose rows cannot be flattened without a copy.
    x3 = torch.randn(4, 3, 2, 96, dtype=dtype, device=device)[:, :, 1]
    assert_close(rms_norm_triton(x3, w, 1e-5), rms_norm_torch(x3, w, 1e-5))


def test_rms_norm_single_element_rows(device):
    x = torch.tensor([[0.5], [-2.0], [3.0], [-0.1]], device=device)
    w = torch.ones(1, device=device)
    # Each row normalizes to sign(x) * |x| / sqrt(x^2 + eps).
    assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))
    assert_close(rms_norm_torch(x, w, 1e-6), torch.sign(x), dtype=torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reference_is_llama_rmsnorm(dtype):
    torch.manual_seed(0)
    mod = LlamaRMSNorm(200, eps=1e-5)
    with torch.no_grad():
        mod.weight.normal_()
    mod = mod.to(dtype)
    x = torch.randn(3, 4, 200).to(dtype)
    with torch.no_grad():
        want = mod(x)
    got = rms_norm_torch(x, mod.weight.detach(), 1e-5)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reference_is_gemma2_rmsnorm(dtype):
    torch.manual_seed(0)
    mod = Gemma2RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        mod.weight.normal_(std=0.3)
    mod = mod.to(dtype)
    x = torch.randn(5, 96).to(dtype)
    with torch.no_grad():
        want = mod(x)
    got = rms_norm_torch(x, mod.weight.detach(), 1e-6, weight_offset=1.0)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # And the order of ops matters in low precision: the Llama order gives something else here.
    if dtype != torch.float32:
        assert not torch.equal(rms_norm_torch(x, 1 + mod.weight.detach(), 1e-6), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_layer_norm_reference_matches_nn_layernorm(dtype, with_bias):
    torch.manual_seed(0)
    mod = torch.nn.LayerNorm(37, eps=1e-5, bias=with_bias)
    with torch.no_grad():
        mod.weight.normal_()
        if with_bias:
            mod.bias.normal_()
    mod = mod.to(dtype)
    x = torch.randn(6, 37).to(dtype)
    with torch.no_grad():
        want = mod(x)
    got = layer_norm_torch(x, mod.weight.detach(), mod.bias.detach() if with_bias else None, 1e-5)
    assert_close(got, want)


def test_fused_residual_equals_add_then_norm(device):
    x, res, w, b = _inputs((3, 96), torch.bfloat16, device, seed=3)
    out, new_res = rms_norm_triton(x, w, 1e-6, res)
    assert_close(out, rms_norm_torch(x + res, w, 1e-6))
    out, new_res = layer_norm_triton(x, w, b, 1e-6, res)
    assert_close(out, layer_norm_torch(x + res, w, b, 1e-6))
    assert new_res.data_ptr() not in (x.data_ptr(), res.data_ptr())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_wide_rows_loop_over_chunks(monkeypatch, device, dtype, with_residual):
    # Rows too wide for registers take the chunked kernels; shrink the limits so a small row exercises them.
    monkeypatch.setattr(norms, "_MAX_ROW_BLOCK", 64)
    monkeypatch.setattr(norms, "_WIDE_BLOCK", 32)
    assert norms._launch_config(200)[2]
    x, res, w, b = _inputs((3, 200), dtype, device, seed=2)
    residual = res if with_residual else None
    for got, want in (
        (rms_norm_triton(x, w, 1e-6, residual), rms_norm_torch(x, w, 1e-6, residual)),
        (rms_norm_triton(x, w, 1e-6, residual, 1.0), rms_norm_torch(x, w, 1e-6, residual, 1.0)),
        (layer_norm_triton(x, w, b, 1e-5, residual), layer_norm_torch(x, w, b, 1e-5, residual)),
    ):
        if with_residual:
            torch.testing.assert_close(got[1], x + res, atol=0, rtol=0)
            got, want = got[0], want[0]
        assert_close(got, want)


def test_launchers_reject_bad_arguments(device):
    x = torch.randn(4, 32, device=device)
    w = torch.randn(32, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.randn(31, device=device), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, w.to("meta"), 1e-6)
    with pytest.raises(ValueError, match="x"):
        rms_norm_triton(x.to(torch.int32), w, 1e-6)
    with pytest.raises(ValueError, match="x"):
        rms_norm_triton(torch.randn(32, 4, device=device).t(), w, 1e-6)  # last dim not unit stride
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, w, 1e-6, residual=torch.randn(4, 33, device=device))
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, w, 1e-6, residual=x.half())
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, w, 1e-6, residual=x.to("meta"))
    with pytest.raises(ValueError, match="bias"):
        layer_norm_triton(x, w, torch.randn(16, device=device), 1e-6)
    with pytest.raises(ValueError, match="bias"):
        layer_norm_triton(x, w, torch.randn(32, device="meta"), 1e-6)
    with pytest.raises(TypeError, match="weight"):
        layer_norm_triton(x, [1.0] * 32, None, 1e-6)


@pytest.mark.parametrize("fn,name", [(rms_norm, "rms_norm"), (layer_norm, "layer_norm")])
def test_dispatch_follows_env(monkeypatch, device, fn, name):
    calls = []
    monkeypatch.setattr(norms, f"{name}_triton", lambda *a, **k: calls.append("triton") or "T")
    monkeypatch.setattr(norms, f"{name}_torch", lambda *a, **k: calls.append("torch") or "R")
    x = torch.randn(2, 8, device=device)
    w = torch.ones(8, device=device)
    args = (x, w, 1e-6) if name == "rms_norm" else (x, w, None, 1e-6)
    monkeypatch.setenv("HF_DSINFER_BACKEND", "torch")
    assert fn(*args) == "R"
    monkeypatch.setenv("HF_DSINFER_BACKEND", "triton")
    assert fn(*args) == "T"
    monkeypatch.setenv("HF_DSINFER_BACKEND", "auto")
    assert fn(*args) == ("T" if x.is_cuda else "R")
    assert calls == ["torch", "triton", "triton" if x.is_cuda else "torch"]
