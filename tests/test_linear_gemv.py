"""The row-streaming GEMV of CPU fp32 decoding (modules/linear.py): same values as ``F.linear``, eager and compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from hf_dsinfer.modules import linear as linear_mod
from hf_dsinfer.modules.linear import GEMV_BLOCK, GEMV_MAX_ROWS, Linear, linear_layout

# Output widths: below one block, whole blocks, and whole blocks plus a remainder (the F.linear tail).
WIDTHS = (40, 2 * GEMV_BLOCK, 2 * GEMV_BLOCK + 24)


def _linear(out_f: int, in_f: int, bias: bool, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(out_f, in_f, generator=g) / in_f**0.5, requires_grad=False)
    b = torch.nn.Parameter(torch.randn(out_f, generator=g), requires_grad=False) if bias else None
    return Linear(w, b)


@pytest.mark.parametrize("out_f", WIDTHS)
@pytest.mark.parametrize("rows", range(1, GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_eager_gemv_matches_f_linear(one_thread, out_f, rows, bias):
    lin = _linear(out_f, 96, bias)
    x = torch.randn(rows, 1, 96, generator=torch.Generator().manual_seed(1))  # [B, 1, K]: B one-token rows
    assert linear_mod._row_gemv_applies(x, lin.weight)
    got = lin(x)
    assert got.shape == (rows, 1, out_f)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_eager_gemv_with_two_threads_matches_f_linear(one_thread):
    torch.set_num_threads(2)  # MKL splits the blocked bmm over its threads: same values
    lin = _linear(2 * GEMV_BLOCK + 24, 96, True)
    x = torch.randn(GEMV_MAX_ROWS, 1, 96, generator=torch.Generator().manual_seed(2))
    assert linear_mod._row_gemv_applies(x, lin.weight)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_gemv_is_skipped_where_it_does_not_apply(one_thread):
    lin = _linear(64, 32, False)
    x = torch.randn(GEMV_MAX_ROWS + 1, 32)  # the packed GEMM's rows
    assert not linear_mod._row_gemv_applies(x, lin.weight)
    k_major = lin.weight.t().contiguous().t()  # the layout gemm_layout gives an F.linear weight
    assert not linear_mod._row_gemv_applies(x[:1], k_major)
    assert not linear_mod._row_gemv_applies(x[:1].double(), lin.weight.double())
    torch.set_num_threads(2)
    assert linear_mod._row_gemv_applies(x[:1], lin.weight)  # any thread count: the blocked bmm (measured faster)


def test_linear_layout_is_row_major_for_fp32_cpu():
    w = torch.randn(48, 16)
    assert linear_layout(w) is w
    k_major = w.t().contiguous().t()
    laid = linear_layout(k_major)
    assert laid.is_contiguous() and torch.equal(laid, w)
    half = k_major.half()
    assert linear_layout(half) is half  # only fp32 CPU weights are re-laid


@torch.no_grad()
def test_compiled_gemv_matches_f_linear():
    """Inside torch.compile the product is an inductor reduction (one loop over the weight rows)."""
    lins = [_linear(out_f, 80, bias, seed=i) for i, (out_f, bias) in enumerate([(40, True), (2 * GEMV_BLOCK, False)])]

    def step(x: torch.Tensor) -> list[torch.Tensor]:
        h = torch.nn.functional.silu(x)  # a producer the materialize barrier keeps out of the GEMV loop
        return [lin(h) for lin in lins]

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    for rows in range(1, GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(rows))
        outs, code = run_and_get_code(compiled, x)
        source = "\n".join(code)
        assert "materialize" in source and "bmm" not in source  # the reduction, not the eager blocked GEMM
        for lin, got in zip(lins, outs):
            want = F.linear(F.silu(x), lin.weight, lin.bias)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_lowered_materialize_is_a_buffer_not_a_call():
    """With kernels/quant_cpu.lower_materialize (the compiled CPU decode step registers it) the barrier is a buffer of
    the generated code: no call back into the op, same values as F.linear over the producer's output."""
    from hf_dsinfer.kernels.quant_cpu import lower_materialize

    if not lower_materialize():
        pytest.skip("this torch's inductor has no lowering hook: the opaque op stays")
    lin = _linear(2 * GEMV_BLOCK + 8, 80, True, seed=3)

    def step(x: torch.Tensor) -> torch.Tensor:
        return lin(torch.nn.functional.silu(x) * 2.0)  # a producer to compute once, not per weight row

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):  # a graph cached before the lowering would call the op
        for rows in range(1, GEMV_MAX_ROWS + 1):
            x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(rows))
            got, code = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=False), x)
            assert "torch.ops.hf_dsinfer.materialize" not in "\n".join(code)
            torch.testing.assert_close(got, F.linear(F.silu(x) * 2.0, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_switch_keeps_the_k_major_layout(monkeypatch):
    """``HF_DSINFER_CPU_GEMV=0``: the previous layout (K-major, multiplied by F.linear)."""
    monkeypatch.setenv(linear_mod.ENV_VAR, "0")
    laid = linear_layout(torch.randn(48, 16))
    assert laid.stride() == (1, 48)
    assert not linear_mod._row_gemv_applies(torch.randn(1, 16), laid)


def _head(bias: bool = False) -> torch.nn.Linear:
    """An LM-head-like ``nn.Linear [640, 512]`` (above cpu_packed.MIN_ELEMENTS), row-major as HF stores it."""
    torch.manual_seed(5)
    return torch.nn.Linear(512, 640, bias=bias).requires_grad_(False)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("shape", "path"),
    [((1, 1), "gemv"), ((3, 1), "gemv"), ((8, 1), "packed"), ((2, 40), "onednn"), ((1, 2), "gemv"),
     ((1, 6), "f_linear")],  # fmt: skip
)
@torch.no_grad()
def test_head_forward_takes_the_row_count_s_path(one_thread, monkeypatch, shape, path, bias):
    """``head_forward`` over HF's row-major fp32 head: row GEMV at 1-3 rows, prepacked at 4-32 one-token rows, oneDNN
    from cpu_gemm.MIN_ROWS rows (a prefill), F.linear for a few-token prefill; ``F.linear``'s values on each path."""
    from hf_dsinfer.modules import cpu_gemm, cpu_packed

    if path == "packed" and not cpu_packed.available():
        pytest.skip("oneDNN's prepacked linear is not available in this torch")
    if path == "onednn" and not cpu_gemm.available():
        pytest.skip("oneDNN's linear is not available in this torch")
    taken = []
    for mod, name, tag in ((linear_mod, "_row_gemv", "gemv"), (cpu_packed, "linear", "packed"),
                           (cpu_gemm, "linear", "onednn")):  # fmt: skip
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _tag=tag, **k: taken.append(_tag) or _real(*a, **k))
    head = _head(bias)
    x = torch.randn(*shape, 512, generator=torch.Generator().manual_seed(6))  # [B, T, C]
    got = linear_mod.head_forward(head, x)
    assert taken == ([] if path == "f_linear" else [path])
    assert got.shape == (*shape, 640)
    torch.testing.assert_close(got, F.linear(x, head.weight, head.bias), rtol=1e-5, atol=1e-5)


def test_head_forward_leaves_hooks_and_autograd_to_the_module(one_thread):
    """A head with a forward hook is called as a module (the hook runs); with autograd the result has a gradient."""
    head = _head()
    seen = []
    head.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    x = torch.randn(2, 40, 512)
    with torch.no_grad():
        linear_mod.head_forward(head, x)
    assert seen == [(2, 40, 640)]
    trained = _head().requires_grad_(True)
    y = linear_mod.head_forward(trained, x)  # many rows with a gradient: not the oneDNN op (no backward)
    y.sum().backward()
    torch.testing.assert_close(trained.weight.grad, x.reshape(-1, 512).sum(0).expand(640, 512), rtol=1e-4, atol=1e-3)
