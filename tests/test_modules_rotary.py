"""RotaryTable's per-step rows (the CPU path) against the kernels' torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hf_dsinfer.kernels.rotary import apply_rotary_torch

from hf_dsinfer.modules import RotaryTable


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [24, 12])  # full head (D=24) and partial rotary
def test_rows_rotation_equals_reference(rotary_dim, interleaved, dtype):
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    table = RotaryTable.from_inv_freq(inv_freq, 50, attention_scaling=0.9, interleaved=interleaved)
    N, Hq, Hk, D = 7, 5, 3, 24  # odd token count, 5:3 heads side by side as in a fused qkv buffer
    qkv = torch.randn(N, Hq + 2 * Hk, D, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 49, 7, 7, 12, 1])
    expect = qkv.clone()
    apply_rotary_torch(expect[:, :Hq], expect[:, Hq : Hq + Hk], table.cos, table.sin, positions, interleaved)
    got = qkv.clone()
    table.rotate_rows_(got[:, : Hq + Hk], table.rows(positions))  # q and k in one call
    assert torch.equal(got, expect)  # same fp32 math, same rounding; v untouched
    assert torch.equal(got[:, Hq + Hk :], qkv[:, Hq + Hk :])
