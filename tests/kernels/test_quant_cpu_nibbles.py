"""int4 ``dequant`` packs stored as nibbles (kernels/quant_cpu_fused.py): two codes per byte, split per group so the
compiled decode reduction reads each byte once. The eager and compiled matmuls must compute the reference's
``x @ dequant(w).T`` (up to fp32 rounding order) on awkward shapes, and the pack must hold half a byte per code."""

from __future__ import annotations

import pytest
import torch
from hf_dsinfer.kernels import quant_cpu
from hf_dsinfer.kernels.quant_cpu import cpu_quant_matmul, pack_for_cpu
from hf_dsinfer.kernels.quant_cpu_fused import pack_nibbles, unpack_nibbles
from hf_dsinfer.kernels.quant_format import QuantSpec, quant_matmul_reference, quantize_weight, unpack_int4
from quant_layer import QuantMatmulLayer

# u * s - z * s against (u - z) * s: one more rounding per weight than the reference, still fp32 rounding order
CLOSE = dict(rtol=1e-5, atol=2e-5)

SPECS = {
    "q4_1-grid": QuantSpec(4, 32, False, float_zero=True),
    "g32-integer-zero": QuantSpec(4, 32, False),
    "g64-symmetric": QuantSpec(4, 64, True),
    "per-channel-symmetric": QuantSpec(4, 4096, True),
}


def _weight(n: int, k: int, spec: QuantSpec, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + torch.rand(n, 1, generator=g) * 0.02  # rows with an offset
    return (*quantize_weight(w, spec), g)


def test_pack_nibbles_round_trips_and_splits_each_group():
    g = torch.Generator().manual_seed(0)
    u = torch.randint(0, 16, (5, 96), generator=g, dtype=torch.uint8)  # [N, K_pad]: 3 groups of 32
    b = pack_nibbles(u, 32)
    assert b.shape == (5, 48) and b.dtype == torch.uint8
    torch.testing.assert_close(unpack_nibbles(b, 32), u)
    # byte j of group 1 holds codes j (low) and j + 16 (high) of that group
    torch.testing.assert_close(b[:, 16:32] & 15, u[:, 32:48])
    torch.testing.assert_close(b[:, 16:32] >> 4, u[:, 48:64])
    with pytest.raises(ValueError, match="group_size"):
        pack_nibbles(u[:, :93], 31)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("k", [100, 64])  # 100: not a multiple of the group (padded columns meet zero activations)
def test_eager_nibble_pack_matches_reference(name, k):
    spec, n = SPECS[name], 37  # odd N
    q, s, z, g = _weight(n, k, spec, seed=k)
    packed = pack_for_cpu(q, s, z, spec, k, kind="dequant")
    assert packed.nibbles and packed.weight.dtype == torch.uint8
    assert packed.weight.numel() == n * packed.k_padded // 2  # half a byte per code
    for rows in (1, 2, 3, 4, 7):
        x = torch.randn(rows, k, generator=g)
        torch.testing.assert_close(cpu_quant_matmul(x, packed), quant_matmul_reference(x, q, s, z, spec, k), **CLOSE)


def test_odd_group_keeps_one_byte_per_code():
    spec, k, n = QuantSpec(4, 4096, True), 33, 9  # per channel at an odd K: no whole byte pairs
    q, s, z, g = _weight(n, k, spec, seed=1)
    packed = pack_for_cpu(q, s, z, spec, k, kind="dequant")
    assert not packed.nibbles and packed.weight.dtype == torch.int8
    x = torch.randn(2, k, generator=g)
    torch.testing.assert_close(cpu_quant_matmul(x, packed), quant_matmul_reference(x, q, s, z, spec, k), **CLOSE)


def test_nibble_pack_holds_the_same_codes():
    spec, k, n = SPECS["q4_1-grid"], 100, 11
    q, s, z, _ = _weight(n, k, spec, seed=2)
    packed = pack_for_cpu(q, s, z, spec, k, kind="dequant")
    codes = unpack_nibbles(packed.weight, 32)[:, :k]  # [N, K]
    torch.testing.assert_close(codes, unpack_int4(q, k))
    torch.testing.assert_close(packed.zeros, (z.float() * s.float()).reshape(n, -1))  # z * s per group


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("rows", [1, 4, 6])  # 6: beyond FUSED_DEQUANT_MAX_ROWS, the unpack-then-linear path
def test_compiled_nibble_matmul_matches_reference(name, rows, monkeypatch):
    spec, k, n = SPECS[name], 100, 37
    q, s, z, g = _weight(n, k, spec, seed=rows)
    packed = pack_for_cpu(q, s, z, spec, k, kind="dequant")
    assert packed.nibbles
    bias = torch.randn(n, generator=g)
    calls = []
    real = quant_cpu.fused_nibble_matmul
    monkeypatch.setattr(quant_cpu, "fused_nibble_matmul", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(rows, k, generator=g)
    torch._dynamo.reset()
    got = torch.compile(QuantMatmulLayer(packed, bias), fullgraph=True)(x)
    torch.testing.assert_close(got, quant_matmul_reference(x, q, s, z, spec, k, bias), **CLOSE)
    assert len(calls) == (rows <= quant_cpu.FUSED_DEQUANT_MAX_ROWS)  # the fused reduction only for a few rows
