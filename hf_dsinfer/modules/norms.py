"""Norm modules over the fused norm kernels (RMSNorm and LayerNorm, each optionally fused with a residual add)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_dsinfer.kernels import layer_norm, rms_norm


@dataclass(frozen=True)
class NormSpec:
    """What a norm computes: ``kind`` is ``"rms"`` or ``"layer"``; ``weight_offset=1.0`` is Gemma's ``(1 + w)``."""

    kind: str = "rms"
    eps: float = 1e-6
    weight_offset: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("rms", "layer"):
            raise ValueError(f"NormSpec.kind must be 'rms' or 'layer', got {self.kind!r}")


class FusedNorm(nn.Module):
    """RMSNorm or LayerNorm holding the HF module's own parameters (``weight``, optional ``bias``).

    ``forward(x, residual)`` with a residual returns ``(norm(x + residual), x + residual)`` in one kernel, which is
    how the decoder layers hand the residual stream from one block to the next without a separate add.
    """

    def __init__(self, spec: NormSpec, weight: nn.Parameter, bias: nn.Parameter | None = None):
        super().__init__()
        self.spec = spec
        self.weight = weight  # [C]
        if bias is not None and spec.kind == "rms":
            raise ValueError("an RMSNorm has no bias; use NormSpec(kind='layer') for a LayerNorm with bias")
        self.bias = bias  # [C] or None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.spec.kind == "rms":
            return rms_norm(x, self.weight, self.spec.eps, residual=residual, weight_offset=self.spec.weight_offset)
        return layer_norm(x, self.weight, self.bias, self.spec.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.spec.kind}, {tuple(self.weight.shape)}, eps={self.spec.eps}, offset={self.spec.weight_offset}"
