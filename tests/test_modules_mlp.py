"""FusedMLP's split gated path and cpu_gemm's oneDNN GEMM (the CPU prefill paths) against the plain formulas."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hf_dsinfer.kernels import act_and_mul
from tolerances import KERNEL_TOL
from torch import nn

from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.modules import cpu_gemm
from hf_dsinfer.modules.linear import Linear
from hf_dsinfer.modules.lora import LoRASlots, MultiLoRALinear
from hf_dsinfer.modules.mlp import SPLIT_MIN_ROWS, FusedMLP, MLPSpec

C, INTER = 40, 56


def _mlp(activation: str = "silu", bias: bool = False, dtype=torch.float32, up_cls=Linear) -> FusedMLP:
    g = torch.Generator().manual_seed(0)

    def p(*shape):
        return nn.Parameter((torch.randn(*shape, generator=g) * 0.2).to(dtype), requires_grad=False)

    up = Linear(p(2 * INTER, C), p(2 * INTER) if bias else None)
    if up_cls is not Linear:
        up = up_cls(up)
    return FusedMLP(MLPSpec(gated=True, activation=activation), up, Linear(p(C, INTER)))


def _reference(mlp: FusedMLP, x: torch.Tensor) -> torch.Tensor:
    """The path below the split threshold: one [.., 2I] product, act_and_mul, down (all F.linear)."""
    h = F.linear(x, mlp.up.weight, mlp.up.bias)
    return F.linear(act_and_mul(h, mlp.spec.activation), mlp.down.weight)


def _hf_formula(mlp: FusedMLP, x: torch.Tensor) -> torch.Tensor:
    """HF's LlamaMLP: ``down(act(gate_proj(x)) * up_proj(x))``, gate and up as separate weights and products."""
    w, b = mlp.up.weight, mlp.up.bias
    gate_w, up_w = w[:INTER].clone(), w[INTER:].clone()  # separate contiguous tensors, as HF holds them
    gate_b, up_b = (None, None) if b is None else (b[:INTER].clone(), b[INTER:].clone())
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[mlp.spec.activation]
    return F.linear(act(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b), mlp.down.weight)


def _x(rows: int, dtype=torch.float32, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, rows, C, generator=torch.Generator().manual_seed(1)).to(dtype)


def _count_splits(monkeypatch) -> list[int]:
    calls = []
    original = FusedMLP._split_gated

    def spy(self, x):
        calls.append(x.shape[-2])
        return original(self, x)

    monkeypatch.setattr(FusedMLP, "_split_gated", spy)
    return calls


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_gated_is_hf_formula_bit_for_bit(activation, bias, dtype, monkeypatch):
    """With oneDNN off, the split path (two GEMMs over views of the weight's halves, activation and product in place)
    runs HF's own products and roundings: bit for bit. The one-GEMM path may differ from it in the last bit (a GEMM
    library may sum in another order for another output width)."""
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "0")
    calls = _count_splits(monkeypatch)
    mlp = _mlp(activation, bias, dtype)
    x = _x(SPLIT_MIN_ROWS, dtype)
    with torch.no_grad():
        got = mlp(x)
    assert calls == [SPLIT_MIN_ROWS]
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, _hf_formula(mlp, x))
    torch.testing.assert_close(got, _reference(mlp, x), **KERNEL_TOL[dtype])


@pytest.mark.parametrize("bias", [False, True])
def test_split_gated_on_onednn_matches(bias, monkeypatch):
    calls = _count_splits(monkeypatch)
    mlp = _mlp("silu", bias)
    x = _x(3 * SPLIT_MIN_ROWS)
    with torch.no_grad():
        got = mlp(x)
    assert calls == [3 * SPLIT_MIN_ROWS]
    torch.testing.assert_close(got, _reference(mlp, x), **KERNEL_TOL[torch.float32])


def test_split_threshold_and_fallbacks(monkeypatch):
    """Fewer rows, autograd, a hooked or LoRA-carrying ``up`` keep ``self.up(x)``; results equal either way."""
    calls = _count_splits(monkeypatch)
    mlp = _mlp()
    with torch.no_grad():
        mlp(torch.randn(1, SPLIT_MIN_ROWS - 1, C))  # decode-sized: one product
    assert calls == []

    seen = []
    handle = mlp.up.register_forward_hook(lambda m, args, out: seen.append(out.shape[-1]))
    with torch.no_grad():
        mlp(_x(SPLIT_MIN_ROWS))
    handle.remove()
    assert calls == [] and seen == [2 * INTER]  # the hook saw the call

    lora = _mlp(up_cls=lambda base: MultiLoRALinear(base, LoRASlots(), max_loras=1, max_rank=2, parts=[INTER, INTER]))
    with torch.no_grad():
        lora(_x(SPLIT_MIN_ROWS))
    assert calls == []

    # autograd: the in-place activation would break the backward, so the plain path runs and gradients are right
    x = _x(SPLIT_MIN_ROWS).requires_grad_()
    mlp(x).sum().backward()
    assert calls == []
    x_ref = x.detach().clone().requires_grad_()
    _reference(mlp, x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **KERNEL_TOL[torch.float32])


def test_cpu_gemm_applies_only_where_measured(monkeypatch):
    w = torch.randn(24, C)
    rows = cpu_gemm.MIN_ROWS
    if not cpu_gemm.available():
        pytest.skip("oneDNN's _linear_pointwise is not available in this torch build")
    assert cpu_gemm.applies(torch.randn(1, rows, C), w)
    assert cpu_gemm.applies(torch.randn(rows, C), w)
    assert not cpu_gemm.applies(torch.randn(1, rows - 1, C), w)  # decode sizes stay on linear.py / cpu_packed
    assert not cpu_gemm.applies(torch.randn(rows, C, dtype=torch.bfloat16), w.bfloat16())
    assert not cpu_gemm.applies(torch.randn(rows, C, requires_grad=True), w)
    with torch.no_grad():
        assert cpu_gemm.applies(torch.randn(rows, C, requires_grad=True), w)
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "off")
    assert not cpu_gemm.applies(torch.randn(rows, C), w)


@pytest.mark.parametrize("layout", ["row-major", "k-major", "half-view"])
def test_cpu_gemm_linear_matches_f_linear(layout):
    g = torch.Generator().manual_seed(2)
    full = torch.randn(2 * 48, C, generator=g)
    w = {"row-major": full[:48], "k-major": full[:48].t().contiguous().t(), "half-view": full[48:]}[layout]
    b = torch.randn(2 * 48, generator=g)[48:]
    x = torch.randn(3, cpu_gemm.MIN_ROWS + 5, C, generator=g)
    got = cpu_gemm.linear(x, w, b)
    assert got.shape == (3, cpu_gemm.MIN_ROWS + 5, 48)
    torch.testing.assert_close(got, F.linear(x, w, b), **KERNEL_TOL[torch.float32])


def test_linear_row_parallel_reduces_the_onednn_product():
    """A row-parallel Linear on the oneDNN path: product, reduce, then the bias once (as on F.linear)."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(24, C, generator=g), torch.randn(24, generator=g)
    x = torch.randn(1, cpu_gemm.MIN_ROWS, C, generator=g)
    lin = Linear(nn.Parameter(w, requires_grad=False), nn.Parameter(b, requires_grad=False), reduce=lambda t: t.mul_(2))
    with torch.no_grad():
        got = lin(x)
        partial = lin(x, defer_reduce=True)
    torch.testing.assert_close(got, 2 * F.linear(x, w) + b, **KERNEL_TOL[torch.float32])
    torch.testing.assert_close(partial, F.linear(x, w), **KERNEL_TOL[torch.float32])


def test_cpu_gemm_probe_failure_falls_back_with_one_line(monkeypatch, caplog):
    monkeypatch.setattr(cpu_gemm, "_available", None)
    monkeypatch.setattr(cpu_gemm, "_probe", lambda: (False, "the probe differed from F.linear"))
    x, w = torch.randn(cpu_gemm.MIN_ROWS, C), torch.randn(24, C)
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        assert not cpu_gemm.applies(x, w)
        assert not cpu_gemm.applies(x, w)
        assert torch.equal(cpu_gemm.linear(x, w), F.linear(x, w))
    lines = [r for r in caplog.records if "_linear_pointwise" in r.getMessage()]
    assert len(lines) == 1 and "F.linear" in lines[0].getMessage()
