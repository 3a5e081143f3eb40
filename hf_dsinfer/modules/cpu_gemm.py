"""oneDNN's GEMM over the plain fp32 weight for many-row CPU products (prefill, forward-only scoring).

Why: for the products of a long prompt (``x [M, K] @ W^T`` with ``M`` in the hundreds or thousands) torch's
``F.linear`` runs MKL's ``sgemm``; oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the op inductor's CPU
freezing pass emits) over the same row-major weight, with no packed copy of it, took 4-11% less thread CPU time on
SmolLM2's shapes from 33 to 4096 rows (1 thread, this project's 2-core EPYC, torch 2.13; 8-13% at 2048-4096 rows,
also for the ``[49152, 576]`` LM head shape) and less wall time at 2 threads. Its first call at a new row count builds
a oneDNN primitive (about 0.3-2 ms, then cached by oneDNN). The products differ from MKL's in the order of the
fp32 additions only (relative differences around 1e-6), as any two GEMM libraries do.

:func:`applies` keeps it to what it was measured on: fp32 on CPU, at least :data:`MIN_ROWS` rows (fewer rows are
decode steps, served by ``linear.py``'s row GEMV and ``cpu_packed``'s prepacked GEMM), no autograd (the op has no
backward here), outside ``torch.compile`` graphs, and only where a one-off probe showed that the op exists and
computes ``F.linear``. ``HF_DSINFER_CPU_ONEDNN=0`` (read on every call) keeps ``F.linear`` everywhere.
"""

from __future__ import annotations

import os
import platform

import torch
import torch.nn.functional as F

from . import cpu_packed

#: ``HF_DSINFER_CPU_ONEDNN=0`` (or false/off/no): many-row fp32 CPU products stay on ``F.linear`` (MKL).
ENV_VAR = "HF_DSINFER_CPU_ONEDNN"
#: Fewest rows (``x.numel() // in_features``) that take oneDNN: the first row count above ``cpu_packed``'s window.
MIN_ROWS = cpu_packed.MAX_ROWS + 1
_OFF = ("0", "false", "off", "no")
_available: bool | None = None


def _probe() -> tuple[bool, str | None]:
    """Whether ``_linear_pointwise`` over a plain weight exists here and computes ``F.linear`` (a 40x24 product
    with bias on a strided weight view; milliseconds), and why not when it runs but computes wrong values."""
    if platform.machine().lower() not in ("x86_64", "amd64", "x86", "i686"):
        return False, None  # measured on x86 only
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False, None
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2 * 40, 24, generator=g)[40:]  # [out, in], a view with an offset like a gate/up half
    b = torch.randn(40, generator=g)
    x = torch.randn(3, MIN_ROWS, 24, generator=g)  # [B, T, in]
    try:
        y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")  # [B, T, out]
    except Exception:  # noqa: BLE001 - missing op, unsupported build: this is only an optimization
        return False, None
    want = F.linear(x, w, b)
    if y.shape != want.shape or not torch.allclose(y, want, atol=1e-4, rtol=1e-4):
        return False, f"the probe differed from F.linear (shape {tuple(y.shape)}, values up to {_diff(y, want):.3g})"
    return True, None


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.shape == b.shape else float("nan")


def available() -> bool:
    """Whether the oneDNN GEMM works in this process (probed once; one info line when it computes wrong values)."""
    global _available
    if _available is None:
        _available, why = _probe()
        if why is not None:
            from ..log import logger  # late: the logger imports transformers

            logger.info("hf_dsinfer: oneDNN linear (mkldnn._linear_pointwise) not used for many-row CPU products: "
                        "%s; they use F.linear", why)  # fmt: skip
    return _available


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` runs ``x [..., K] @ weight[N, K]^T`` on oneDNN (see the module docstring)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.ndim != 2:
        return False
    if weight.device.type != "cpu" or x.shape[-1] != weight.shape[1] or x.numel() < MIN_ROWS * max(x.shape[-1], 1):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if torch.compiler.is_dynamo_compiling():  # graphs keep F.linear (inductor lowers it its own way)
        return False
    if os.environ.get(ENV_VAR, "1").strip().lower() in _OFF:
        return False
    return available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x [..., K]``, ``weight [N, K]`` -> ``[..., N]``, on oneDNN when
    :func:`applies`, else on ``F.linear``."""
    if applies(x, weight) and (bias is None or bias.dtype == torch.float32):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
