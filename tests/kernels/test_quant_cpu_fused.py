"""The compiled decode path of the ``dequant`` kind (kernels/quant_cpu.py, ``_fuse_dequant``): under torch.compile a
matmul of a few rows dequantizes as it reduces instead of writing an fp32 weight; it must compute the reference's
``x @ dequant(w).T`` (up to fp32 summation order) for every grid it serves, the Q4_1 grid first."""

from __future__ import annotations

import pytest
import torch
from hf_dsinfer.kernels import quant_cpu
from hf_dsinfer.kernels.quant_cpu import cpu_quant_matmul, pack_for_cpu
from hf_dsinfer.kernels.quant_format import QuantSpec, quant_matmul_reference, quantize_weight

EXACT = dict(rtol=1e-5, atol=1e-5)  # fp32 summation order only

SPECS = {
    "int4-g32-float-zero": QuantSpec(4, 32, False, float_zero=True),  # GGUF Q4_1's grid
    "int4-g32-integer-zero": QuantSpec(4, 32, False),
    "int4-g64-symmetric": QuantSpec(4, 64, True),
    "int8-g32-float-zero": QuantSpec(8, 32, False, float_zero=True),
}


class _Layer(torch.nn.Module):
    def __init__(self, packed, bias):
        super().__init__()
        self.packed, self.bias = packed, bias

    def forward(self, x):
        return cpu_quant_matmul(x, self.packed, self.bias)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("rows", [1, 3, 6])  # 6 rows: beyond FUSED_DEQUANT_MAX_ROWS, the dequantize-then-linear path
def test_compiled_fused_dequant_matches_reference(name, rows, monkeypatch):
    spec, k, n = SPECS[name], 100, 48  # K not a multiple of the group: padded columns meet zero activations
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(n, k, generator=g) * 0.05 + torch.rand(n, 1, generator=g) * 0.02  # rows with an offset (zero)
    q, s, z = quantize_weight(w, spec)
    packed = pack_for_cpu(q, s, z, spec, k, kind="dequant")
    bias = torch.randn(n, generator=g)
    calls = []
    real = quant_cpu._fuse_dequant
    monkeypatch.setattr(quant_cpu, "_fuse_dequant", lambda p, r: calls.append(real(p, r)) or calls[-1])
    x = torch.randn(rows, k, generator=g)
    torch._dynamo.reset()
    got = torch.compile(_Layer(packed, bias), fullgraph=True)(x)
    want = quant_matmul_reference(x, q, s, z, spec, k, bias)
    torch.testing.assert_close(got, want, **EXACT)
    assert calls == [rows <= quant_cpu.FUSED_DEQUANT_MAX_ROWS]  # traced once; the fused branch only for few rows
    assert not quant_cpu._fuse_dequant(packed, 1)  # eager: never (it would materialize [M, N, K])
