"""Gemma2 policy: sandwich norms (extra post-attention / post-feedforward RMSNorms), ``(1 + w)`` norm weights,
sliding window on every other layer, attention-logit and final-logit soft-capping, embeddings scaled by
``sqrt(hidden)`` (done by HF's own embedding module, which the fused forward calls)."""

from __future__ import annotations

import torch
from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec
from .base import Cat, Policy, Source, activation_name, register


@register
class Gemma2Policy(Policy):
    """gemma2 decoder layers on fused kernels."""

    model_types = ("gemma2",)
    hf_classes = ("Gemma2ForCausalLM", "Gemma2Model")
    norm_weight_offset = 1.0  # Gemma2RMSNorm scales by (1 + weight)

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        act = model.config.hidden_activation
        if activation_name(act) not in ("silu", "gelu", "gelu_tanh"):
            return f"hidden_activation={act!r} has no fused gated-MLP equivalent"
        return super().unsupported(model, max_out_tokens)

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        cfg, attn = model.config, layer.self_attn
        return LayerSpec(
            attention=AttentionSpec(
                num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=attn.head_dim,
                scale=float(attn.scaling),  # query_pre_attn_scalar ** -0.5
                sliding_window=attn.sliding_window or None,  # None on full-attention layers
                softcap=attn.attn_logit_softcapping or None,
            ),
            mlp=MLPSpec(gated=True, activation=activation_name(cfg.hidden_activation)),
            norm=self.norm_spec(layer.input_layernorm),
            residual="sandwich",
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        attn = layer.self_attn
        bias = attn.q_proj.bias is not None
        return {
            "attn_norm.weight": "input_layernorm.weight",
            "attn_out_norm.weight": "post_attention_layernorm.weight",
            "mlp_norm.weight": "pre_feedforward_layernorm.weight",
            "mlp_out_norm.weight": "post_feedforward_layernorm.weight",
            "attn.qkv.weight": Cat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            "attn.qkv.bias": (
                Cat("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias") if bias else None
            ),
            "attn.o.weight": "self_attn.o_proj.weight",
            "attn.o.bias": "self_attn.o_proj.bias" if attn.o_proj.bias is not None else None,
            "mlp.up.weight": Cat("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            "mlp.down.weight": "mlp.down_proj.weight",
        }

    def finalize_logits(self, model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        cap = model.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
