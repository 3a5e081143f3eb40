"""Cohere (Command-R) policy: attention and the gated MLP in parallel off one LayerNorm without bias
(``x + attn(ln(x)) + mlp(ln(x))``), interleaved rotary (pairs ``(2i, 2i + 1)``, rotated in fp32 like HF), and the
logits multiplied by ``logit_scale``.

``CohereLayerNorm`` is a mean-and-variance norm without bias, computed in fp32: the fused LayerNorm with no bias.
Kept on HF's modules: ``use_qk_norm=True`` (Command-R+: its q/k norms hold one weight row per head, the fused qk-norm
one row shared by all heads) and activations without a fused gated equivalent.
"""

from __future__ import annotations

import torch
from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec, NormSpec
from .base import Cat, Source, register
from .llama import LlamaPolicy, _activation


@register
class CoherePolicy(LlamaPolicy):
    """cohere (``CohereForCausalLM``, ``CohereModel``) decoder layers on fused kernels."""

    model_types = ("cohere",)
    hf_classes = ("CohereForCausalLM", "CohereModel")
    rotary_interleaved = True

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        if getattr(model.config, "use_qk_norm", False):
            return "use_qk_norm=True (per-head q/k LayerNorm weights) has no fused equivalent"
        return super().unsupported(model, max_out_tokens)

    def norm_spec(self, module: nn.Module) -> NormSpec:
        return NormSpec("layer", float(module.variance_epsilon))  # CohereLayerNorm: LayerNorm without bias

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        cfg, attn = model.config, layer.self_attn
        return LayerSpec(
            attention=AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim, attn.scaling),
            mlp=MLPSpec(gated=True, activation=_activation(model)),
            norm=self.norm_spec(layer.input_layernorm),
            residual="parallel",  # no mlp_norm: input_layernorm feeds both branches
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        attn = layer.self_attn
        bias = attn.q_proj.bias is not None
        return {
            "attn_norm.weight": "input_layernorm.weight",
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
        return logits * model.config.logit_scale
