"""Norm modules over the fused norm kernels (RMSNorm and LayerNorm, each optionally fused with a residual add)."""

from __future__ import annotations

from collections.abc import Callable
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


class SplitRMSNorm(nn.Module):
    """An RMSNorm over a width that tensor parallelism split across ranks (OLMo-2's q/k norm over all heads).

    ``weight [width_local]`` is this rank's slice of the norm weight (the slice of its heads). The statistics must be
    those of the full width, so :meth:`squares` sums this rank's squares, the caller sums that over the ranks with
    ``reduce`` (in place; a callable like :attr:`Linear.reduce`, so this module knows nothing of process groups), and
    :meth:`scale` normalizes with the total. ``share`` (``1 / copies``) makes an element held by several ranks (a kv
    head replicated because there are fewer kv heads than ranks) count once. Arithmetic in fp32 with the weight
    applied before the cast back, as OLMo-2's RMSNorm does. :func:`split_rms_norm_pair` normalizes q and k with one
    all-reduce of a ``[..., 2]`` tensor. Plain torch ops on every device: the sum must leave the rank between the
    statistics and the scaling, which one norm kernel launch cannot do.
    """

    def __init__(
        self,
        spec: NormSpec,
        weight: nn.Parameter,
        full_width: int,
        reduce: Callable[[torch.Tensor], torch.Tensor],
        share: float = 1.0,
    ):
        super().__init__()
        if spec.kind != "rms":
            raise ValueError(f"SplitRMSNorm is an RMSNorm; got NormSpec(kind={spec.kind!r})")
        self.spec = spec
        self.weight = weight  # [width_local]
        self.full_width = full_width
        self.share = share
        self.reduce = reduce

    def squares(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the sum of squares of ``x [..., width_local]``: ``[..., 1]`` fp32."""
        s = x.float().pow(2).sum(-1, keepdim=True)
        return s * self.share if self.share != 1.0 else s

    def scale(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """``x [..., width_local]`` normalized by the full width's sum of squares ``total [..., 1]`` (fp32)."""
        w = self.weight.float() + self.spec.weight_offset if self.spec.weight_offset else self.weight.float()
        return (w * (x.float() * torch.rsqrt(total / self.full_width + self.spec.eps))).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., width_local] -> [..., width_local]`` (one all-reduce of ``[..., 1]``)."""
        return self.scale(x, self.reduce(self.squares(x)))

    def extra_repr(self) -> str:
        return f"rms, width={self.weight.shape[0]} (of {self.full_width}), eps={self.spec.eps}, share={self.share}"


def split_rms_norm_pair(
    q_norm: SplitRMSNorm, k_norm: SplitRMSNorm, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [..., Wq_local]`` and ``k [..., Wk_local]`` normalized over their full widths with one all-reduce."""
    sums = q_norm.reduce(torch.cat((q_norm.squares(q), k_norm.squares(k)), dim=-1))  # [..., 2] summed over ranks
    return q_norm.scale(q, sums[..., :1]), k_norm.scale(k, sums[..., 1:])
