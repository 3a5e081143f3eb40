"""Feed-forward blocks: gated (``down(act(gate) * up)`` with one packed gate_up GEMM) and plain (``fc2(act(fc1))``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hf_dsinfer.kernels import act_and_mul

from .linear import Linear

GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
PLAIN_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "gelu_new")


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

    def extra_repr(self) -> str:
        return f"gated={self.spec.gated}, activation={self.spec.activation}"
