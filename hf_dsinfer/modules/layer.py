"""The fused decoder layer: norms fused with residual adds, fused attention, fused MLP.

A layer is described by a :class:`LayerSpec` and built from a flat dict of parameters whose names are fixed here
(:data:`PARAM_NAMES`); policies map their HF layer's weights onto these names. Layers pass the residual stream as a
pair ``(hidden, residual)`` whose sum is the true stream, so each norm also performs the add before it in one kernel.

Residual styles (``LayerSpec.residual``):

* ``pre`` (llama):        ``x = x + attn(attn_norm(x)); x = x + mlp(mlp_norm(x))``
* ``sandwich`` (gemma2):  ``x = x + attn_out_norm(attn(attn_norm(x))); x = x + mlp_out_norm(mlp(mlp_norm(x)))``
* ``parallel`` (neox, falcon): ``x = x + attn(attn_norm(x)) + mlp(mlp_norm(x))`` (``mlp_norm`` absent: shared norm)
* ``post`` (bert, opt-350m):  ``x = attn_norm(x + attn(x)); x = mlp_norm(x + mlp(x))``
* ``post_block`` (olmo2):     ``x = x + attn_out_norm(attn(x)); x = x + mlp_out_norm(mlp(x))`` (no norm before a block)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .attention import AttentionSpec, FusedAttention, StepContext
from .linear import Linear
from .mlp import FusedMLP, MLPSpec
from .moe import MOE_PARAM_NAMES, FusedMoE, MoESpec
from .norms import FusedNorm, NormSpec, SplitRMSNorm
from .quant_linear import QuantLinear

RESIDUAL_STYLES = ("pre", "sandwich", "parallel", "post", "post_block")

# Every parameter name a fused layer knows, and which ones are required (per residual style for the norms).
PARAM_NAMES = (
    "attn_norm.weight", "attn_norm.bias",
    "mlp_norm.weight", "mlp_norm.bias",
    "attn_out_norm.weight", "attn_out_norm.bias",
    "mlp_out_norm.weight", "mlp_out_norm.bias",
    "attn.qkv.weight", "attn.qkv.bias", "attn.o.weight", "attn.o.bias",
    "attn.q_norm.weight", "attn.k_norm.weight",
    "mlp.up.weight", "mlp.up.bias", "mlp.down.weight", "mlp.down.bias",
)  # fmt: skip
PARAM_NAMES += MOE_PARAM_NAMES  # a mixture-of-experts layer's mlp (modules/moe.py)
_NORMS_BY_STYLE = {
    "pre": ("attn_norm", "mlp_norm"),
    "sandwich": ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm"),
    "parallel": ("attn_norm",),  # mlp_norm optional
    "post": ("attn_norm", "mlp_norm"),
    "post_block": ("attn_out_norm", "mlp_out_norm"),
}
#: The weights of the layer's linears (the ones worth a device-specific layout, see ``linear.gemm_layout``).
LINEAR_WEIGHTS = ("attn.qkv.weight", "attn.o.weight", "mlp.up.weight", "mlp.down.weight")
_REQUIRED = LINEAR_WEIGHTS


@dataclass(frozen=True)
class LayerSpec:
    """Everything a fused decoder layer computes, apart from its weights."""

    attention: AttentionSpec
    mlp: MLPSpec
    norm: NormSpec
    residual: str = "pre"
    #: Scale of each block's output before its residual add (granite's ``residual_multiplier``; pre style only).
    residual_scale: float = 1.0
    #: A mixture-of-experts layer: ``mlp`` is a :class:`~hf_dsinfer.modules.moe.FusedMoE` (``spec.mlp`` is unused).
    moe: MoESpec | None = None

    def __post_init__(self) -> None:
        if self.residual not in RESIDUAL_STYLES:
            raise ValueError(f"LayerSpec.residual must be one of {RESIDUAL_STYLES}, got {self.residual!r}")
        if self.residual_scale != 1.0 and self.residual != "pre":
            raise ValueError(f"LayerSpec.residual_scale is supported with the 'pre' style only, not {self.residual!r}")


class FusedDecoderLayer(nn.Module):
    """One decoder layer on fused kernels. Build it with :meth:`from_params`."""

    def __init__(
        self,
        spec: LayerSpec,
        attn: FusedAttention,
        mlp: FusedMLP,
        norms: dict[str, FusedNorm],
    ):
        super().__init__()
        self.spec = spec
        self.attn = attn
        self.mlp = mlp
        for name in ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm"):
            setattr(self, name, norms.get(name))

    @classmethod
    def from_params(
        cls,
        spec: LayerSpec,
        layer_idx: int,
        params: dict[str, nn.Parameter],
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> FusedDecoderLayer:
        """Build layer ``layer_idx`` from ``params`` keyed by :data:`PARAM_NAMES` (the tensors are adopted as is).

        ``reduce`` (tensor parallelism): the in-place sum over ranks that the row-parallel ``attn.o`` and ``mlp.down``
        apply before their bias; ``params`` and ``spec`` are then this rank's slices and head counts.
        """
        unknown = sorted(set(params) - set(PARAM_NAMES))
        if unknown:
            raise ValueError(f"unknown fused parameter names {unknown}; valid names: {', '.join(PARAM_NAMES)}")
        linears = [n for n in _REQUIRED if spec.moe is None or not n.startswith("mlp.")]  # MoE: FusedMoE checks its own
        required = linears + [f"{n}.weight" for n in _NORMS_BY_STYLE[spec.residual]]
        if spec.attention.qk_norm is not None:
            required += ["attn.q_norm.weight", "attn.k_norm.weight"]
        missing = [n for n in required if n not in params]
        if missing:
            raise ValueError(f"layer {layer_idx} ({spec.residual} residual) is missing fused parameters {missing}")

        def linear(prefix: str, row_parallel: bool = False) -> Linear | QuantLinear:
            weight, bias, r = params[f"{prefix}.weight"], params.get(f"{prefix}.bias"), reduce if row_parallel else None
            if isinstance(weight, QuantLinear):  # weight-only quantized: the packed module itself (no bias yet)
                weight.bias, weight.reduce = bias, r
                return weight
            return Linear(weight, bias, r)

        norms = {}
        for name in ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm"):
            if f"{name}.weight" in params:
                norms[name] = FusedNorm(spec.norm, params[f"{name}.weight"], params.get(f"{name}.bias"))
        q_norm = k_norm = None
        split = spec.attention.qk_norm_split
        if split is not None:  # tensor parallelism: a full-width q/k norm whose statistics are summed over ranks
            if reduce is None:
                raise ValueError(f"layer {layer_idx}: AttentionSpec.qk_norm_split needs the tensor-parallel reduce")
            (q_width, q_share), (k_width, k_share) = split
            q_norm = SplitRMSNorm(spec.attention.qk_norm, params["attn.q_norm.weight"], q_width, reduce, q_share)
            k_norm = SplitRMSNorm(spec.attention.qk_norm, params["attn.k_norm.weight"], k_width, reduce, k_share)
        elif spec.attention.qk_norm is not None:
            q_norm = FusedNorm(spec.attention.qk_norm, params["attn.q_norm.weight"])
            k_norm = FusedNorm(spec.attention.qk_norm, params["attn.k_norm.weight"])
        attn = FusedAttention(spec.attention, layer_idx, linear("attn.qkv"), linear("attn.o", True), q_norm, k_norm)
        if spec.moe is not None:
            mlp = FusedMoE.from_params(spec.moe, params, reduce)
        else:
            mlp = FusedMLP(spec.mlp, linear("mlp.up"), linear("mlp.down", True))
        return cls(spec, attn, mlp, norms)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden``/``residual [B, T, C]`` (true stream = hidden + residual; ``residual`` None: hidden alone)."""
        style = self.spec.residual
        if style == "post":
            x = hidden if residual is None else hidden + residual
            h, _ = self.attn_norm(self.attn(x, ctx), x)  # norm(x + attn(x))
            out, _ = self.mlp_norm(self.mlp(h), h)  # norm(h + mlp(h))
            return out, None
        if style == "post_block":
            x = hidden if residual is None else hidden + residual  # [B, T, C] the true stream
            x = x + self.attn_out_norm(self.attn(x, ctx))
            return self.mlp_out_norm(self.mlp(x)), x  # the next norm (or layer) adds the pair

        if residual is None:
            h, residual = self.attn_norm(hidden), hidden
        else:
            h, residual = self.attn_norm(hidden, residual)  # [B, T, C] each
        if style == "parallel":
            h_mlp = self.mlp_norm(residual) if self.mlp_norm is not None else h
            o, down = self.attn.o, self.mlp.down
            if o.reduce is not None and down.reduce is not None:
                # Tensor parallel: the branches' partial sums add before the reduce, so one all-reduce serves both;
                # the biases are added once, after it.
                out = o.reduce(self.attn(h, ctx, defer_reduce=True) + self.mlp(h_mlp, defer_reduce=True))
                for bias in (o.bias, down.bias):
                    if bias is not None:
                        out = out + bias
                return out, residual
            return self.attn(h, ctx) + self.mlp(h_mlp), residual

        a = self.attn(h, ctx)
        if style == "sandwich":
            a = self.attn_out_norm(a)
        scale = self.spec.residual_scale
        if scale != 1.0:
            a = a * scale  # in the model dtype, before the add, like granite
        h, residual = self.mlp_norm(a, residual)
        m = self.mlp(h)
        if style == "sandwich":
            m = self.mlp_out_norm(m)
        if scale != 1.0:
            m = m * scale
        return m, residual
