"""A linear layer that adopts existing parameters (no allocation, no re-initialization).

CPU fp32 decoding (1-3 rows) is a matrix-vector product bound by the bytes of the weight. torch's ``F.linear`` runs
MKL's ``sgemm`` there, which streams a row-major weight at about 11 GB/s on this project's 2-core EPYC (1 thread),
a K-major one at 12-20 GB/s. Two faster ways over the *row-major* weight (the layout HF stores) exist in plain torch:

* inside ``torch.compile`` (the compiled CPU decode step): the product written as a reduction,
  ``(x * w).sum(-1)``, which inductor turns into one vectorized C++ loop that streams the weight once, row after
  row (17-27 GB/s per shape);
* eagerly (any thread count): a batched GEMM over blocks of :data:`GEMV_BLOCK` weight rows (``torch.bmm``), which MKL
  runs on its small-matrix path without packing the weight first (faster than ``F.linear`` over either layout).

So the fused layers' fp32 CPU weights stay row-major (:func:`linear_layout`) and :meth:`Linear.forward` takes those
paths up to :data:`GEMV_MAX_ROWS` rows; docs/performance.md has the measurements. The LM head is HF's own
``nn.Linear`` and keeps HF's row-major layout too (the embedding's natural one when tied); the injected forward
calls it through :func:`head_forward` and the decode step through ``cpu_packed.module_forward``, which give it the
same paths as :class:`Linear`.
``HF_DSINFER_CPU_GEMV=0`` (read when a model is injected) stores the fused linears and the head K-major for
``F.linear`` instead, as before this path existed.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import hf_dsinfer.kernels.quant_cpu  # noqa: F401 - registers torch.ops.hf_dsinfer.materialize

from . import cpu_gemm, cpu_packed

#: Most rows (``x.numel() // in_features``) that take the row-streaming GEMV; from ``cpu_packed.MIN_ROWS`` rows on,
#: a oneDNN-prepacked GEMM (or ``F.linear``) reads the weight once for all rows anyway.
GEMV_MAX_ROWS = cpu_packed.MIN_ROWS - 1
#: Weight rows per batch item of the eager blocked GEMV (swept 16 / 64 / 192 on SmolLM2's shapes: 192 was best).
GEMV_BLOCK = 192
#: ``HF_DSINFER_CPU_GEMV=0`` (or false/off/no): fused fp32 CPU linears stored K-major and multiplied by ``F.linear``.
ENV_VAR = "HF_DSINFER_CPU_GEMV"


def wants_k_major(weight: torch.Tensor) -> bool:
    """Whether :func:`gemm_layout` stores ``weight`` K-major: fp32 on CPU."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def linear_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` in the layout :class:`Linear` reads fastest: row-major (contiguous) for fp32 on CPU
    (the row-streaming GEMV of decoding needs it; a K-major or sliced tensor is copied), as is elsewhere.
    With ``HF_DSINFER_CPU_GEMV=0``: :func:`gemm_layout` (K-major for fp32 on CPU)."""
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "off", "no"):
        return gemm_layout(weight)
    if not wants_k_major(weight) or weight.ndim != 2 or weight.is_contiguous():
        return weight
    return weight.detach().contiguous()


def gemm_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` in the memory layout the device's GEMM (``F.linear``) reads fastest; same shape and values.

    Used for weights that are multiplied through ``F.linear`` (HF's LM head); :class:`Linear`'s weights take
    :func:`linear_layout` instead.

    On CPU that is K-major storage (a ``[in, out]`` buffer seen through ``.t()``, strides ``(1, out)``): ``F.linear``
    then runs ``x @ w_t`` over a contiguous ``w_t``, which oneDNN/MKL stream at about twice the bandwidth of the
    row-major ``[out, in]`` layout for the skinny ``M = batch`` GEMMs of decoding (measured on the 2-core EPYC dev
    machine, torch 2.13: 12.7 -> 19 GB/s over a small llama's weights at batch 1, 1 thread). Everything that reads
    the weight logically (``state_dict``, TP slicing, the Hybrid Engine's in-place ``copy_``) is unaffected. GPUs
    keep the row-major layout (cuBLAS and the Triton kernels are tuned for it), so elsewhere the tensor is returned
    as is. So do bf16 and fp16 weights on CPU: torch's half-precision CPU GEMM has no fast path for a transposed
    weight (60-80x slower than row-major at 1-64 rows on the same machine: 163 vs 2.7 ms for a bf16 11264 x 2048
    weight at one row). A tensor already in the right layout is returned as is too.
    """
    if not wants_k_major(weight) or weight.ndim != 2 or weight.stride() == (1, weight.shape[0]):
        return weight
    out = torch.empty(weight.shape[1], weight.shape[0], dtype=weight.dtype, device=weight.device).t()  # [out, in]
    out.copy_(weight.detach())
    return out


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` over a given ``weight [out, in]`` and optional ``bias [out]``.

    Unlike ``nn.Linear`` it takes the parameters it computes with, so re-packed or shared HF weights are used in place.
    On CPU in fp32 (and bf16 where the CPU has AMX) with ``cpu_packed.MIN_ROWS`` to ``MAX_ROWS`` rows the product runs
    over a oneDNN-prepacked copy of the weight, a cache rebuilt when the weight changes (see :mod:`.cpu_packed`); the
    parameter itself is unchanged.
    ``reduce``: for a row-parallel linear (tensor parallelism: ``in`` is this rank's slice of the input features), an
    in-place sum over the ranks applied to ``x @ weight.T`` before the bias, so the bias counts once. It is a callable
    (``t -> t``) so this layer does not depend on ``hf_dsinfer.parallel``; inside a captured CUDA graph the collective
    is captured with it.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__()
        if weight.ndim != 2:
            raise ValueError(f"Linear weight must be 2-d [out, in], got shape {tuple(weight.shape)}")
        if bias is not None and bias.shape != weight.shape[:1]:
            raise ValueError(f"Linear bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
        self.weight = weight
        self.bias = bias
        self.reduce = reduce
        cpu_packed.ensure_slot(self)  # a cache slot for the weight's oneDNN-packed copy (CPU, batch >= 4)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor, defer_reduce: bool = False) -> torch.Tensor:
        """``x [..., in] -> [..., out]``. ``defer_reduce`` (row-parallel only): return this rank's partial product
        without reducing and without the bias; the caller sums partials of several linears, reduces once and adds
        each bias (a parallel-residual block does this)."""
        if _row_gemv_applies(x, self.weight):  # fp32 CPU, 1-3 rows, row-major weight: decoding
            y = _row_gemv(x, self.weight)  # [..., out]
            if self.reduce is None:
                return y if self.bias is None else y + self.bias
        elif cpu_packed.applies(x, self.weight, self):  # fp32 (bf16 + AMX) CPU, 4-32 rows: prepacked oneDNN
            if self.reduce is None:
                return cpu_packed.linear(x, self.weight, self.bias, self)
            y = cpu_packed.linear(x, self.weight, None, self)
        elif cpu_gemm.applies(x, self.weight):  # fp32 CPU, > cpu_packed.MAX_ROWS rows (prefill): oneDNN, see cpu_gemm
            y = cpu_gemm.linear(x, self.weight, self.bias if self.reduce is None else None)
            if self.reduce is None:
                return y
        elif self.reduce is None:
            return F.linear(x, self.weight, self.bias)
        else:
            y = F.linear(x, self.weight)  # this rank's partial sums [..., out]
        if defer_reduce:
            return y
        y = self.reduce(y)  # full sums on every rank
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        tp = ", row_parallel=True" if self.reduce is not None else ""
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, bias={self.bias is not None}{tp}"


def _row_gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """fp32 on CPU, a row-major weight, at most :data:`GEMV_MAX_ROWS` rows. Any thread count: on a quiet 2-core
    machine the eager blocked ``bmm`` decoded SmolLM2 at 26.7-29.9 tok/s with 2 threads against 19.6-20.4 for
    ``F.linear`` over the K-major layout (docs/performance.md)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.ndim != 2:
        return False
    if not weight.is_contiguous() or x.shape[-1] != weight.shape[1]:
        return False
    if x.numel() > GEMV_MAX_ROWS * weight.shape[1] or x.numel() == 0:
        return False
    return True


def _row_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight.T`` for a few rows over a row-major ``weight [N, K]``, reading it once; ``[..., N]``."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)  # [M, K], M <= GEMV_MAX_ROWS
    if torch.compiler.is_dynamo_compiling():  # not is_compiling(): a background compile sets that process-wide
        # An opaque copy first: otherwise inductor fuses x's producer (the RMSNorm, the SiLU-and-mul) into the loop
        # below and recomputes it for every weight row. Then [N, M, K] products summed over K: inductor emits one
        # loop over the N weight rows, each row read once from memory and reused from L1 for the M activation rows.
        x2 = torch.ops.hf_dsinfer.materialize(x2)
        y = (weight[:, None, :] * x2[None, :, :]).sum(-1).t()  # [M, N]
        return y.reshape(*x.shape[:-1], n)
    blocks = n // GEMV_BLOCK
    head = blocks * GEMV_BLOCK  # rows in whole blocks; the rest (< GEMV_BLOCK) through F.linear
    xt = x2.t()  # [K, M]
    parts = []
    if blocks:
        w = weight[:head].view(blocks, GEMV_BLOCK, k)  # [nb, B, K]
        parts.append(torch.bmm(w, xt.expand(blocks, k, x2.shape[0])).permute(2, 0, 1).reshape(-1, head))  # [M, nb*B]
    if head < n:
        parts.append(F.linear(x2, weight[head:]))  # [M, N - head]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [M, N]
    return y.view(*x.shape[:-1], n)


def head_forward(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``head(x)`` for the LM head (HF's ``nn.Linear``, ``x [..., C] -> [..., V]``) over the fused linears' CPU paths.

    fp32 on CPU over a row-major weight: the row GEMV at 1-3 rows and the prepacked GEMM at 4-32 one-token rows
    (``cpu_packed.module_forward``), oneDNN's GEMM from ``cpu_gemm.MIN_ROWS`` rows (prefill, forward-only scoring).
    Anything else (another device or dtype, a quantized, peft or TP head, a head with hooks, autograd) is simply
    ``head(x)``, so HF's own module computes it.
    """
    if cpu_packed.is_plain_linear(head):
        if cpu_gemm.applies(x, head.weight) and (head.bias is None or head.bias.dtype == torch.float32):
            return cpu_gemm.linear(x, head.weight, head.bias)  # [..., V]
    return cpu_packed.module_forward(head, x)  # [..., V]
