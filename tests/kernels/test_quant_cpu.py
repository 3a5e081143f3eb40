"""quant_format and quant_cpu: quantization round-trip error bounds, the int4 byte layout, and the packed CPU
matmuls (torch's int8/int4 weight ops and the dequant fallback) against quant_matmul_reference."""

import pytest
import torch
from hf_dsinfer.kernels import quant_cpu
from hf_dsinfer.kernels.quant_cpu import (
    FALLBACK_KIND,
    FP16GEMM_MAX_EXPANDED_ROWS,
    CpuPackedWeight,
    check_kind,
    cpu_quant_matmul,
    default_kind,
    fbgemm_available,
    known_bad,
    pack_for_cpu,
    supported_kinds,
)
from hf_dsinfer.kernels.quant_format import (
    QuantSpec,
    dequantize_weight,
    quant_matmul_reference,
    quantize_weight,
    unpack_int4,
)
from hf_dsinfer.kernels.quant_gemm import quant_matmul

pytestmark = pytest.mark.usefixtures("one_thread")

# fp32 compute: the same dequantized fp32 weights as the reference, another summation order (results O(1): 1e-5 is
# ~100 fp32 ulps). bf16 compute rounds the activations and the output to bf16: 2^-8 relative each, so about
# 1e-2 of the result's scale.
EXACT = dict(atol=1e-5, rtol=1e-5)
BF16_COMPUTE = dict(atol=3e-2, rtol=2e-2)
# fp16gemm with groups rounds each dequantized weight to fp16 (2^-11 relative): ~1e-3 of the O(1) outputs.
FP16_ROUNDED = dict(atol=3e-3, rtol=3e-3)


def _weight(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5


@pytest.mark.parametrize(
    "spec, bound",
    [
        (QuantSpec(8, 1 << 30, True), 0.01),  # int8 per channel: 1/254 of the row's absmax per weight
        (QuantSpec(8, 1 << 30, False), 0.01),
        (QuantSpec(4, 128, True), 0.13),  # int4 group 128: 1/14 of the group's absmax per weight (~0.12 Gaussian)
        (QuantSpec(4, 128, False), 0.13),
    ],
)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_bounds(spec, bound, scale_dtype):
    w = _weight(96, 300)  # ragged last int4 group (300 = 2 * 128 + 44)
    q, s, z = quantize_weight(w, spec, scale_dtype=scale_dtype)
    assert s.dtype == scale_dtype
    back = dequantize_weight(q, s, z, spec, 300, dtype=torch.float32)
    rel = (back - w).norm() / w.norm()
    assert rel < bound, f"relative error {rel:.4f} >= {bound}"
    assert rel > bound / 100  # it did quantize
    # every weight is within half a step of its group's grid, also with scales stored in bf16/fp16: the integers
    # are chosen against the stored scale, not the fp32 one it was rounded from
    step = s.float()[:, torch.arange(300) // spec.for_features(300).group_size]
    assert ((back - w).abs() <= step * 0.5 * (1 + 1e-5)).all()


def test_zero_and_constant_rows_stay_finite():
    w = torch.zeros(3, 40)
    w[1] = 0.5
    w[2, :3] = 1e-9  # below fp16's smallest scale: the scale must not underflow to 0
    for spec in (QuantSpec(8, 40), QuantSpec(4, 16, False), QuantSpec(4, 16)):
        for dt in (torch.float32, torch.float16):
            q, s, z = quantize_weight(w, spec, scale_dtype=dt)
            back = dequantize_weight(q, s, z, spec, 40, dtype=torch.float32)
            assert (s > 0).all() and torch.isfinite(back).all()
            # a constant row is one grid point: exact up to the stored scale's rounding (int4 scales keep 8 / 7
            # significant bits, symmetric / asymmetric, for exact fp16 products on CPU: up to 2^-7 / 2^-6 relative)
            rtol = (2**-7 if spec.symmetric else 2**-6) if spec.num_bits == 4 else 1e-6 if dt == torch.float32 else 2e-3
            assert torch.allclose(back, w, atol=1e-6, rtol=rtol)


def test_int4_nibble_order_and_odd_k():
    # column k of row n is byte k // 2: the low nibble when k is even; a padding nibble of 0 when K is odd
    w = torch.tensor([[-7.0, -6.0, 0.0, 6.0, 7.0]])  # symmetric, scale 1: stored u = q + 8
    spec = QuantSpec(4, 5)
    q, s, z = quantize_weight(w, spec)
    assert q.dtype == torch.uint8 and q.shape == (1, 3) and z is None
    assert s.item() == pytest.approx(1.0)
    assert q.tolist() == [[1 | (2 << 4), 8 | (14 << 4), 15]]
    assert unpack_int4(q, 5).tolist() == [[1, 2, 8, 14, 15]]
    assert dequantize_weight(q, s, z, spec, 5).tolist() == w.tolist()


def test_int8_layout_and_concatenation_along_n():
    w1, w2 = _weight(8, 40, 1), _weight(5, 40, 2)
    spec = QuantSpec(8, 16, False)
    a, b, both = quantize_weight(w1, spec), quantize_weight(w2, spec), quantize_weight(torch.cat([w1, w2]), spec)
    assert a[0].dtype == torch.int8 and a[1].shape == (8, 3)  # ceil(40 / 16) groups
    for i in range(3):
        assert torch.equal(torch.cat([a[i], b[i]]), both[i])


# (M, N, K, bits, group (None: per channel), symmetric)
CPU_CASES = [
    (1, 40, 72, 8, None, True),
    (3, 24, 67, 4, 32, True),  # odd K, ragged group
    (5, 24, 100, 4, 64, False),
    (2, 33, 129, 4, 128, True),  # N not a multiple of 16 (int4pack pads rows)
    (3, 48, 129, 4, None, False),
    (2, 16, 96, 4, 96, False),  # group 96 expressed with the op's 32
    (3, 20, 90, 8, 40, True),  # int8 grouped: dequant only
    (4, 24, 64, 8, None, False),  # int8 asymmetric: dequant only
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"M{c[0]}-N{c[1]}-K{c[2]}-int{c[3]}-g{c[4]}-sym{c[5]}")
def test_cpu_kinds_match_reference(case):
    m, n, k, bits, group, sym = case
    spec = QuantSpec(bits, group or k, sym)
    q, s, z = quantize_weight(_weight(n, k), spec)
    g = torch.Generator().manual_seed(5)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    want = quant_matmul_reference(x, q, s, z, spec, k, b)
    kinds = supported_kinds(spec, k)
    assert ("int8pack" in kinds) == (bits == 8 and sym and group is None)
    assert ("int4pack" in kinds) == (bits == 4 and (group is None or group % 32 == 0))
    assert ("fp16gemm" in kinds) == ("fp16gemm_exact" in kinds) == fbgemm_available() and "dequant" in kinds
    per_channel = group is None or group >= k
    assert default_kind(spec, k) == ("fp16gemm" if per_channel and fbgemm_available() else "dequant")
    for kind in kinds:
        exact = pack_for_cpu(q, s, z, spec, k, kind=kind)
        assert exact.kind == kind  # fp32 compute: every kind passes its check on these shapes
        rounded = kind == "fp16gemm" and not per_channel
        torch.testing.assert_close(
            cpu_quant_matmul(x, exact, b), want, **(FP16_ROUNDED if rounded else EXACT), msg=kind
        )
        if kind.startswith("fp16gemm"):
            continue  # computes in fp32 only
        fast = pack_for_cpu(q, s, z, spec, k, kind=kind, compute_dtype=torch.bfloat16)
        # int8pack with bf16 at K = 72 (not a multiple of 16) is torch's known-bad case: packed as dequant instead
        assert fast.kind == (FALLBACK_KIND if known_bad(kind, k, torch.bfloat16) else kind)
        got = cpu_quant_matmul(x, fast, b)
        assert got.dtype == torch.float32
        want16 = quant_matmul_reference(x.bfloat16(), q, s, z, spec, k, b).float()  # activations rounded first
        torch.testing.assert_close(got, want16, **BF16_COMPUTE, msg=kind)


def test_dispatch_leading_dims_and_dtypes(monkeypatch):
    monkeypatch.setenv("HF_DSINFER_BACKEND", "torch")
    spec = QuantSpec(4, 32)
    q, s, z = quantize_weight(_weight(32, 64), spec)
    packed = pack_for_cpu(q, s, z, spec, 64)
    x = torch.randn(2, 3, 64)
    want = quant_matmul_reference(x, q, s, z, spec, 64)
    got = quant_matmul(x, q, s, z, spec, 64, cpu_packed=packed)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got, want, **EXACT)
    assert torch.equal(quant_matmul(x, q, s, z, spec, 64), want)  # no packing: the reference
    xb = x.bfloat16()  # bf16 activations on the fp32-compute packing: computed in fp32, rounded once
    torch.testing.assert_close(cpu_quant_matmul(xb, packed), quant_matmul_reference(xb, q, s, z, spec, 64))


def test_buffers_round_trip_and_bad_arguments():
    spec = QuantSpec(8, 48)
    q, s, z = quantize_weight(_weight(16, 48), spec)
    packed = pack_for_cpu(q, s, z, spec, 48, kind="int8pack")
    rebuilt = packed.from_buffers({k: v.clone() for k, v in packed.buffers().items()})
    assert isinstance(rebuilt, CpuPackedWeight) and rebuilt.kind == "int8pack"
    x = torch.randn(2, 48)
    assert torch.equal(cpu_quant_matmul(x, rebuilt), cpu_quant_matmul(x, packed))
    with pytest.raises(ValueError, match="kind='int4pack' cannot hold"):
        pack_for_cpu(q, s, z, spec, 48, kind="int4pack")
    with pytest.raises(ValueError, match="compute_dtype"):
        pack_for_cpu(q, s, z, spec, 48, compute_dtype=torch.float16)
    with pytest.raises(ValueError, match="in_features=48"):
        cpu_quant_matmul(torch.randn(2, 47), packed)


@pytest.mark.skipif(not fbgemm_available(), reason="this torch build has no fbgemm")
def test_fp16gemm_groups_decode_and_prefill_rows():
    # Up to FP16GEMM_MAX_EXPANDED_ROWS rows x groups run block-expanded through one GEMM; more dequantize once.
    spec = QuantSpec(4, 32, False)
    q, s, z = quantize_weight(_weight(24, 100), spec)  # 4 groups, the last one ragged
    packed = pack_for_cpu(q, s, z, spec, 100, kind="fp16gemm_exact")
    b = torch.randn(24)
    for m in (1, FP16GEMM_MAX_EXPANDED_ROWS // 4, FP16GEMM_MAX_EXPANDED_ROWS // 4 + 1, 40):
        x = torch.randn(m, 100)
        want = quant_matmul_reference(x, q, s, z, spec, 100, b)
        torch.testing.assert_close(cpu_quant_matmul(x, packed, b), want, **EXACT)


@pytest.mark.skipif(not fbgemm_available(), reason="this torch build has no fbgemm")
def test_fp16gemm_deep_copy_packs_again():
    # fbgemm's packed handle cannot be cloned; a deep copy (of a model holding the packing) packs the copy again.
    import copy

    spec = QuantSpec(8, 40, False)
    q, s, z = quantize_weight(_weight(24, 40), spec)
    packed = pack_for_cpu(q, s, z, spec, 40)
    assert packed.kind == "fp16gemm" and "weight" not in packed.buffers()
    twin = copy.deepcopy(packed)
    assert twin.weight is not packed.weight and twin.source[0] is not q
    x = torch.randn(3, 40)
    assert torch.equal(cpu_quant_matmul(x, twin), cpu_quant_matmul(x, packed))
    torch.testing.assert_close(cpu_quant_matmul(x, packed), quant_matmul_reference(x, q, s, z, spec, 40), **EXACT)


@pytest.mark.parametrize("spec", [QuantSpec(8, 96, True), QuantSpec(4, 32, False), QuantSpec(4, 32, False, True)])
def test_no_kind_calls_deprecated_torch_functions(spec):
    # torch 2.13 warns that torch.fbgemm_pack_gemm_matrix_fp16 / fbgemm_linear_fp16_weight_fp32_activation "will be
    # removed": the fp16gemm kinds run fbgemm through torch.ops.quantized's fp16 ops, which warn nothing.
    import warnings

    q, s, z = quantize_weight(_weight(32, 96), spec)
    x = torch.randn(3, 96)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind in supported_kinds(spec, 96):
            packed = pack_for_cpu(q, s, z, spec, 96, kind=kind)
            cpu_quant_matmul(x, packed)
            cpu_quant_matmul(x[:1], packed)
    deprecated = [str(w.message) for w in caught if "deprecat" in str(w.message).lower()]
    assert deprecated == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp16gemm_exact", "int4pack", "dequant"])
def test_cpu_quant_matmul_under_torch_compile(kind):
    # The CPU decode step is compiled (generation/compiled_cpu.py): the packed weight is a module attribute.
    if kind.startswith("fp16gemm") and not fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    spec = QuantSpec(4, 32, False)  # fp16gemm_exact: the block-expanded group path
    q, s, z = quantize_weight(_weight(32, 96), spec)
    packed = pack_for_cpu(q, s, z, spec, 96, kind=kind)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.packed = packed
            self.bias = torch.nn.Parameter(torch.randn(32))

        def forward(self, x):
            return cpu_quant_matmul(x, self.packed, self.bias)

    layer = Layer()
    x = torch.randn(2, 96)
    got = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(got, quant_matmul_reference(x, q, s, z, spec, 96, layer.bias.detach()), **EXACT)


# torch 2.13's torch._weight_int8pack_mm with bf16 activations at K not a multiple of 16 returned 1e7-1e38 at 1 and 3
# rows and crashed at 2 and 4+ rows (docs/quantization.md): these shapes would crash this process if it still ran.
BAD_INT8PACK_K = (8, 72, 100, 136)


@pytest.mark.parametrize("k", BAD_INT8PACK_K)
def test_int8pack_bf16_bad_k_is_never_used(k, monkeypatch, caplog):
    import logging

    monkeypatch.setattr(quant_cpu, "_checked", {})  # a fresh cache: the info line is logged once, here
    spec = QuantSpec(8, k, True)
    q, s, z = quantize_weight(_weight(40, k), spec)
    assert "int8pack" in supported_kinds(spec, k) and known_bad("int8pack", k, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="transformers.hf_dsinfer"):
        packed = [pack_for_cpu(q, s, z, spec, k, compute_dtype=torch.bfloat16) for _ in range(3)]  # default: int8pack
    assert all(p.kind == FALLBACK_KIND for p in packed)
    lines = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(lines) == 1 and "'int8pack'" in lines[0] and f"K={k}" in lines[0] and "'dequant'" in lines[0], lines
    for m in (1, 2, 3, 4, 8):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        want = quant_matmul_reference(x.bfloat16().float(), q, s, z, spec, k)
        torch.testing.assert_close(cpu_quant_matmul(x, packed[0]), want, **BF16_COMPUTE)
    # fp32 activations were right at every K measured: int8pack stays, and its probe passed
    assert pack_for_cpu(q, s, z, spec, k, kind="int8pack").kind == "int8pack"


@pytest.mark.parametrize("k", (16, 48, 64, 144))
def test_int8pack_bf16_good_k_is_used(k):
    spec = QuantSpec(8, k, True)
    q, s, z = quantize_weight(_weight(40, k), spec)
    assert known_bad("int8pack", k, torch.bfloat16) is None
    packed = pack_for_cpu(q, s, z, spec, k, compute_dtype=torch.bfloat16)
    assert packed.kind == "int8pack"
    for m in (1, 2, 3, 4, 8):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        want = quant_matmul_reference(x.bfloat16().float(), q, s, z, spec, k)
        torch.testing.assert_close(cpu_quant_matmul(x, packed), want, **BF16_COMPUTE)


@pytest.mark.parametrize("failure", ["garbage", "raises"])
def test_kind_failing_its_probe_falls_back(failure, monkeypatch, caplog):
    """A kind whose op goes wrong on a shape no rule names is caught by the probe: packed as dequant, one info line."""
    import logging

    monkeypatch.setattr(quant_cpu, "_checked", {})
    real = torch._weight_int8pack_mm

    def broken(x, w, scales):
        if failure == "raises":
            raise RuntimeError("unsupported shape")
        return real(x, w, scales) * 1e20

    monkeypatch.setattr(torch, "_weight_int8pack_mm", broken)
    spec = QuantSpec(8, 64, True)
    q, s, z = quantize_weight(_weight(24, 64), spec)
    with caplog.at_level(logging.INFO, logger="transformers.hf_dsinfer"):
        packed = pack_for_cpu(q, s, z, spec, 64, kind="int8pack")
        again = pack_for_cpu(q, s, z, spec, 64, kind="int8pack")  # cached: no second probe, no second line
    assert packed.kind == again.kind == FALLBACK_KIND
    why = check_kind("int8pack", spec, 64, 24)
    assert ("differed from the dequantized reference" if failure == "garbage" else "raised RuntimeError") in why
    assert len([r for r in caplog.records if "not used" in r.getMessage()]) == 1
    x = torch.randn(3, 64)
    torch.testing.assert_close(cpu_quant_matmul(x, packed), quant_matmul_reference(x, q, s, z, spec, 64), **EXACT)


def test_onednn_packed_linear_probe_rejects_wrong_values(monkeypatch, caplog):
    """modules/cpu_packed.py's one-off probe: an op computing wrong values is not used, with one info line."""
    import logging

    from hf_dsinfer.modules import cpu_packed

    monkeypatch.setattr(cpu_packed, "_available", None)
    monkeypatch.setattr(cpu_packed.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, b: w)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, w, *rest: x @ w.t() + 1.0)  # off by one
    with caplog.at_level(logging.INFO, logger="transformers.hf_dsinfer"):
        assert cpu_packed.available() is False
        assert cpu_packed.available() is False  # probed once
    lines = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(lines) == 1 and "_linear_pointwise" in lines[0] and "F.linear" in lines[0], lines
    monkeypatch.undo()
    cpu_packed._available = None  # the real probe again for later tests


def test_kind_benchmark_times_every_kind_against_fp32():
    from hf_dsinfer.kernels.quant_cpu_bench import benchmark, format_benchmark

    rows = benchmark([(48, 64)], rows=(1,), repeats=1, fp32_bytes=1)  # two weight copies, one call row
    assert len(rows) == 1 and rows[0]["shape"] == "48x64" and rows[0]["copies"] == 2
    kinds = [k for k in supported_kinds(QuantSpec(8, 64, True), 64) if k != "fp16gemm_exact"]  # per channel: fp16gemm
    for kind in kinds:
        assert any(kind in name for name in rows[0]), (kind, list(rows[0]))
    table = format_benchmark(rows)
    assert table.count("\n") == 2 and "fp32 F.linear" in table and "x)" in table
