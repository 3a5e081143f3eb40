"""quant_gemm: the Triton w8a16 / w4a16 GEMM (interpreter on CPU) against quant_matmul_reference.

Shapes are small and awkward (the interpreter is slow): 1, 3 and 17 rows (decode and prefill tiles), N and K not
multiples of the tiles, odd K for int4, ragged last groups, per-channel and grouped scales, group sizes no
power-of-two K tile divides (the per-element scale path), forced split-K counts (the two-pass reduction).
"""

import pytest
import torch
from hf_dsinfer.kernels._arch import Target
from hf_dsinfer.kernels.quant_format import QuantSpec, quant_matmul_reference, quantize_weight
from hf_dsinfer.kernels.quant_gemm import _num_splits, quant_matmul, quant_matmul_triton, quant_tiles
from tolerances import assert_close

# Per dtype, what may separate the kernel from the reference, whose weight is dequantized in fp32 and whose sum is
# one fp32 matmul rounded once to the activation dtype: fp32, the summation order only (results are O(1) here, so
# 1e-5 is ~100 fp32 ulps); fp16 / bf16, one rounding of the output (2^-11 / 2^-8 relative) plus, on the per-element
# scale path, the weight rounded to the activation dtype before the dot.
QUANT_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}

# (M, N, K, bits, group_size (None: per channel), symmetric (or "float": asymmetric with a fractional zero point,
# whose q - z the aligned path rounds to the activation dtype), bias, dtype, splits (None: the launcher's choice))
CASES = [
    (1, 40, 72, 8, None, True, False, torch.float32, None),  # int8 per channel, decode
    (3, 24, 67, 4, 32, True, True, torch.float32, None),  # int4, odd K, ragged last group (67 = 2 * 32 + 3)
    (17, 24, 100, 4, 64, False, True, torch.bfloat16, None),  # prefill tile, asymmetric, ragged group
    (1, 33, 129, 4, 128, True, True, torch.bfloat16, 3),  # split-K (two-pass reduction), odd K, bias
    (3, 24, 96, 8, 48, False, False, torch.float16, 2),  # group 48: K tile shrunk to 16, asymmetric int8, split
    (17, 20, 90, 8, 40, True, True, torch.float16, None),  # group 40: per-element scales (no aligned K tile)
    (1, 48, 129, 4, None, False, False, torch.float32, 3),  # int4 per channel asymmetric, odd K, split
    (3, 17, 160, 8, 128, False, True, torch.bfloat16, None),  # int8 asymmetric g128, ragged (160 = 128 + 32)
    (3, 24, 96, 4, 32, "float", True, torch.float32, None),  # float zero point, aligned groups
    (17, 20, 100, 4, 64, "float", False, torch.bfloat16, None),  # float zero, prefill tile, ragged group
    (1, 33, 129, 4, 32, "float", True, torch.float16, 2),  # float zero, split-K, odd K
    (3, 24, 90, 8, 40, "float", False, torch.float32, None),  # float zero int8, per-element scales
]


def _problem(m, n, k, bits, group, sym, bias, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    spec = QuantSpec(bits, group or k, sym is True, float_zero=sym == "float")
    w = torch.randn(n, k, generator=g) / k**0.5  # results O(1)
    qweight, scales, zeros = quantize_weight(w, spec, scale_dtype=dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(qweight), to(scales), to(zeros), spec, to(b)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-N{c[1]}-K{c[2]}-int{c[3]}-g{c[4]}-{c[7]}")
def test_quant_gemm_triton_matches_reference(device, case):
    m, n, k, bits, group, sym, bias, dtype, splits = case
    x, qweight, scales, zeros, spec, b = _problem(m, n, k, bits, group, sym, bias, dtype, device)
    got = quant_matmul_triton(x, qweight, scales, zeros, spec, k, b, splits=splits)
    want = quant_matmul_reference(x, qweight, scales, zeros, spec, k, b)
    assert got.shape == (m, n) and got.dtype == dtype
    assert_close(got, want, QUANT_TOL)


def test_split_k_is_deterministic_and_matches_one_split(device):
    x, qweight, scales, zeros, spec, b = _problem(2, 24, 128, 4, 32, True, True, torch.float32, device, seed=1)
    one = quant_matmul_triton(x, qweight, scales, zeros, spec, 128, b, splits=1)
    four = quant_matmul_triton(x, qweight, scales, zeros, spec, 128, b, splits=4)
    assert torch.equal(four, quant_matmul_triton(x, qweight, scales, zeros, spec, 128, b, splits=4))
    assert_close(four, one, QUANT_TOL)


def test_leading_dims_strided_input_and_dispatch(device, monkeypatch):
    x, qweight, scales, zeros, spec, b = _problem(6, 24, 64, 8, 32, True, True, torch.float32, device, seed=2)
    x3 = torch.cat([x, x], dim=1).view(2, 3, 128)[..., ::2]  # [2, 3, 64] with a column stride of 2
    want = quant_matmul_reference(x3, qweight, scales, zeros, spec, 64, b)
    got = quant_matmul_triton(x3, qweight, scales, zeros, spec, 64, b)
    assert got.shape == (2, 3, 24)
    assert_close(got, want, QUANT_TOL)
    monkeypatch.setenv("HF_DSINFER_BACKEND", "torch")
    assert torch.equal(quant_matmul(x3, qweight, scales, zeros, spec, 64, b), want)


def test_tiles_and_split_counts():
    bf16 = torch.bfloat16
    # K tiles never straddle a group: shrunk to the largest power of two dividing the group size (>= 16)
    assert quant_tiles(1, 4096, 4096, bf16, QuantSpec(4, 128), None)[-1] is True
    assert quant_tiles(1, 4096, 4096, bf16, QuantSpec(8, 48), None)[2] == 16
    assert quant_tiles(1, 4096, 4096, bf16, QuantSpec(8, 40), None)[-1] is False
    assert quant_tiles(1, 4096, 100, bf16, QuantSpec(8, 100), None)[-1] is True  # per channel: one group
    h100 = Target(90, 132)
    assert _num_splits(1, 448, 4096, 128, h100) == 1  # gate_up: the tiles alone fill the GPU
    assert _num_splits(1, 64, 4096, 128, h100) == 8  # o_proj: split until ~2 programs per SM
    assert _num_splits(1, 64, 256, 128, h100) == 1  # keep >= 2 K tiles per split
    assert _num_splits(1, 64, 4096, 128, None) == 1


def test_bad_arguments():
    spec = QuantSpec(4, 32)
    x = torch.randn(2, 64)
    q = torch.zeros(8, 32, dtype=torch.uint8)
    s = torch.ones(8, 2)
    with pytest.raises(ValueError, match="qweight must be"):
        quant_matmul_triton(x, q[:, :31], s, None, spec, 64)
    with pytest.raises(ValueError, match="qweight must have dtype"):
        quant_matmul_triton(x, q.to(torch.int8), s, None, spec, 64)
    with pytest.raises(ValueError, match="scales must be"):
        quant_matmul_triton(x, q, s[:, :1], None, spec, 64)
    with pytest.raises(ValueError, match="zeros must be None"):
        quant_matmul_triton(x, q, s, s, spec, 64)
    with pytest.raises(ValueError, match="in_features=64"):
        quant_matmul_triton(torch.randn(2, 63), q, s, None, spec, 64)
    with pytest.raises(ValueError, match="bias must be"):
        quant_matmul_triton(x, q, s, None, spec, 64, torch.zeros(7))


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [8, 4])
def test_quant_gemm_cuda_graph_capture(bits):
    dev = torch.device("cuda")
    x, qweight, scales, zeros, spec, b = _problem(1, 4096, 4096, bits, 128, True, True, torch.bfloat16, dev)
    want = quant_matmul(x, qweight, scales, zeros, spec, 4096, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_matmul(x, qweight, scales, zeros, spec, 4096, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert_close(out, quant_matmul_reference(x, qweight, scales, zeros, spec, 4096, b), QUANT_TOL)
    assert not torch.equal(out, want)
