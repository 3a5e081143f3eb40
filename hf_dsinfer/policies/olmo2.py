"""OLMo-2 policy: norms after each block instead of before (``x + norm(attn(x))``, ``x + norm(mlp(x))``) and q/k
RMSNorms over the full projection width (all heads together), before rotary.

The fused layer's ``post_block`` residual style and ``AttentionSpec.qk_norm_full_width`` reproduce both; everything
else (separate q/k/v, gated MLP, rotate-half rotary, final RMSNorm) is llama's. OLMo-2's RMSNorm multiplies the
weight in fp32 before rounding (llama rounds first): identical in fp32, one rounding apart in half precision.

Under tensor parallelism AutoTP splits q/k by heads and gives each q/k norm this rank's slice of the weight, as a
norm whose statistics are summed over the ranks (it exposes ``full_width`` and ``share``). The fused layer then does
the same (``AttentionSpec.qk_norm_split``): both norms' sums of squares go through one all-reduce of ``[tokens, 2]``
per layer, and each rank scales its slice (``modules.norms.SplitRMSNorm``, OLMo-2's rounding in every dtype).
"""

from __future__ import annotations

from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec
from .base import Cat, Source, register
from .llama import LlamaPolicy, _activation


@register
class Olmo2Policy(LlamaPolicy):
    """olmo2 (``Olmo2ForCausalLM``, ``Olmo2Model``) decoder layers on fused kernels."""

    model_types = ("olmo2",)
    hf_classes = ("Olmo2ForCausalLM", "Olmo2Model")

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        cfg, attn = model.config, layer.self_attn
        return LayerSpec(
            attention=AttentionSpec(
                num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=attn.head_dim,
                scale=float(attn.scaling),
                qk_norm=self.norm_spec(attn.q_norm),
                qk_norm_full_width=True,  # weights [Hq * D] / [Hk * D]: one norm over all heads
                qk_norm_split=_split_widths(attn.q_norm, attn.k_norm),
            ),
            mlp=MLPSpec(gated=True, activation=_activation(model)),
            norm=self.norm_spec(layer.post_attention_layernorm),
            residual="post_block",
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        attn = layer.self_attn
        bias = attn.q_proj.bias is not None
        return {
            "attn_out_norm.weight": "post_attention_layernorm.weight",
            "mlp_out_norm.weight": "post_feedforward_layernorm.weight",
            "attn.qkv.weight": Cat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            "attn.qkv.bias": (
                Cat("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias") if bias else None
            ),
            "attn.o.weight": "self_attn.o_proj.weight",
            "attn.o.bias": "self_attn.o_proj.bias" if attn.o_proj.bias is not None else None,
            "attn.q_norm.weight": "self_attn.q_norm.weight",
            "attn.k_norm.weight": "self_attn.k_norm.weight",
            "mlp.up.weight": Cat("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            "mlp.down.weight": "mlp.down_proj.weight",
        }


def _split_widths(q_norm: nn.Module, k_norm: nn.Module) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """``((q width, q share), (k width, k share))`` when tensor parallelism split the q/k norms (their modules carry
    ``full_width`` and ``share``: the whole projection's width, ``1 / copies`` of each element), else None."""
    if getattr(q_norm, "full_width", None) is None and getattr(k_norm, "full_width", None) is None:
        return None
    return tuple(
        (int(getattr(n, "full_width", n.weight.shape[0])), float(getattr(n, "share", 1.0))) for n in (q_norm, k_norm)
    )
