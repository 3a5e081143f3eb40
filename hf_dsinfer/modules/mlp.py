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


def _plain_activation(x: torch.Tensor, name: str) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "relu":
        return F.relu(x)
    if name == "gelu":
        return F.gelu(x)
    # gelu_tanh and gelu_new are the same function (HF's NewGELU is the tanh approximation)
    return F.gelu(x, approximate="tanh")


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
            h = _plain_activation(h, self.spec.activation)
        return self.down(h, defer_reduce)  # [B, T, C]

    def extra_repr(self) -> str:
        return f"gated={self.spec.gated}, activation={self.spec.activation}"
