"""A linear layer that adopts existing parameters (no allocation, no re-initialization)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` over a given ``weight [out, in]`` and optional ``bias [out]``.

    Unlike ``nn.Linear`` it takes the parameters it computes with, so re-packed or shared HF weights are used in place.
    Tensor-parallel and quantized linears replace this class later.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None):
        super().__init__()
        if weight.ndim != 2:
            raise ValueError(f"Linear weight must be 2-d [out, in], got shape {tuple(weight.shape)}")
        if bias is not None and bias.shape != weight.shape[:1]:
            raise ValueError(f"Linear bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
        self.weight = weight
        self.bias = bias

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, bias={self.bias is not None}"
