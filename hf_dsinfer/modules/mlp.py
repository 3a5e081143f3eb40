"""Feed-forward blocks: gated (``down(act(gate) * up)`` with one packed gate_up GEMM) and plain (``fc2(act(fc1))``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hf_dsinfer.kernels import act_and_mul

from . import cpu_gemm, cpu_packed
from .linear import Linear

GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
PLAIN_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "gelu_new")
#: Fewest rows (tokens) at which a gated MLP on CPU runs gate and up as two GEMMs over the halves of the packed
#: weight (views, no copy) with the activation and the product in place, instead of one ``[rows, 2I]`` GEMM, then
#: ``act(gate) * up`` into two new buffers. Below it (decode: the row GEMV, the oneDNN-packed GEMM) one call is
#: cheaper. Measured (SmolLM2's 576 -> 2 x 1536 -> 576 MLP, 1 thread, thread CPU time): the split was 3-10% faster
#: at every row count from 33 to 4096, bit-identical, and it allocates half the bytes: a ``[4096, 3072]`` fp32
#: output (50 MB) is above glibc's largest mmap threshold (32 MB), so every layer page-faulted it in afresh.
SPLIT_MIN_ROWS = cpu_packed.MAX_ROWS + 1


@dataclass(frozen=True)
class MLPSpec:
    """``gated=True``: ``up`` holds ``[gate; up]`` rows ``[2I, C]`` and the block is ``down(act(gate) * up)``.
    ``gated=False``: ``up`` is ``fc1 [I, C]`` and the block is ``down(act(fc1(x)))``. ``activation`` names the
    function (``silu``, ``gelu`` (erf), ``gelu_tanh``; plain MLPs also take ``relu`` and ``gelu_new``)."""

    gated: bool = True
    activation: str = "silu"

    def __post_init__(self) -> None:
        allowed = GATED_ACTIVATIONS if self.gated else PLAIN_ACTIVATIONS
        if self.activation not in allowed:
            kind = "gated" if self.gated else "plain"
            raise ValueError(f"activation {self.activation!r} is not supported in a {kind} MLP; use one of {allowed}")


def _plain_activation(x: torch.Tensor, name: str, inplace: bool = False) -> torch.Tensor:
    if name == "silu":
        return F.silu(x, inplace=inplace)
    if name == "relu":
        return F.relu(x, inplace=inplace)
    # gelu_tanh and gelu_new are the same function (HF's NewGELU is the tanh approximation)
    approximate = "none" if name == "gelu" else "tanh"
    return torch.ops.aten.gelu_(x, approximate=approximate) if inplace else F.gelu(x, approximate=approximate)


class FusedMLP(nn.Module):
    """Gated or plain MLP over adopted ``up`` and ``down`` linears (see :class:`MLPSpec`)."""

    def __init__(self, spec: MLPSpec, up: Linear, down: Linear):
        super().__init__()
        if spec.gated and up.out_features % 2:
            raise ValueError(f"a gated MLP needs [gate; up] rows (an even count), got {up.out_features}")
        self.spec = spec
        self.up = up
        self.down = down

    def forward(self, x: torch.Tensor, defer_reduce: bool = False) -> torch.Tensor:
        """``x [B, T, C] -> [B, T, C]``; ``defer_reduce``: see :meth:`Linear.forward` (``down``)."""
        if self.spec.gated and self._split_applies(x):
            return self.down(self._split_gated(x), defer_reduce)  # [B, T, C]
        h = self.up(x)  # [B, T, 2I] gated, [B, T, I] plain
        if self.spec.gated:
            h = act_and_mul(h, self.spec.activation)  # [B, T, I]
        else:
            # h is this call's own new buffer: activating it in place spares a second [B, T, I] one. On CPU a fresh
            # buffer of several MB costs page faults: 8-12% of an all-MiniLM-L6-v2 forward at batch 64 (1 thread,
            # docs/performance.md). Not under autograd, where the activation's backward needs its input.
            inplace = not (torch.is_grad_enabled() and h.requires_grad)
            h = _plain_activation(h, self.spec.activation, inplace)
        return self.down(h, defer_reduce)  # [B, T, C]

    def _split_applies(self, x: torch.Tensor) -> bool:
        """Whether :meth:`_split_gated` computes this call: CPU, at least :data:`SPLIT_MIN_ROWS` rows, no autograd,
        and ``up`` a plain :class:`Linear` with no hooks (a LoRA or quantized subclass, or a hook that must see the
        call, keeps ``self.up(x)``)."""
        up = self.up
        if x.device.type != "cpu" or x.numel() < SPLIT_MIN_ROWS * x.shape[-1]:
            return False
        if type(up) is not Linear or up.reduce is not None or up._forward_hooks or up._forward_pre_hooks:
            return False
        return not (torch.is_grad_enabled() and (x.requires_grad or up.weight.requires_grad))

    def _split_gated(self, x: torch.Tensor) -> torch.Tensor:
        """``act(x @ W_gate^T + b_gate) * (x @ W_up^T + b_up)`` with the two products as separate GEMMs; ``[B, T, I]``.

        The same per-element math as ``act_and_mul(self.up(x))`` (HF's own gate_proj and up_proj are separate GEMMs
        too), in two buffers of ``[B, T, I]`` instead of four.
        """
        w, b = self.up.weight, self.up.bias  # [2I, C], [2I] or None
        inter = w.shape[0] // 2
        gate = cpu_gemm.linear(x, w[:inter], None if b is None else b[:inter])  # [B, T, I]
        up = cpu_gemm.linear(x, w[inter:], None if b is None else b[inter:])  # [B, T, I]
        return _plain_activation(gate, self.spec.activation, inplace=True).mul_(up)

    def extra_repr(self) -> str:
        return f"gated={self.spec.gated}, activation={self.spec.activation}"
