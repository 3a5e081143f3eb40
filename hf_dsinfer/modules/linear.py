"""A linear layer that adopts existing parameters (no allocation, no re-initialization)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_packed


def wants_k_major(weight: torch.Tensor) -> bool:
    """Whether :func:`gemm_layout` stores ``weight`` K-major: fp32 on CPU."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def gemm_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` in the memory layout the device's GEMM reads fastest; same shape and values.

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
    On CPU in fp32 with at least ``cpu_packed.MIN_ROWS`` rows the product runs over a oneDNN-prepacked copy of the
    weight, a cache rebuilt when the weight changes (see :mod:`.cpu_packed`); the parameter itself is unchanged.
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
        if cpu_packed.applies(x, self.weight, self):  # fp32 CPU, >= 4 rows: the prepacked oneDNN GEMM
            if self.reduce is None:
                return cpu_packed.linear(x, self.weight, self.bias, self)
            y = cpu_packed.linear(x, self.weight, None, self)
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
