"""GLM-4 policy: sandwich RMSNorms (``input_layernorm`` / ``post_self_attn_layernorm`` around attention,
``post_attention_layernorm`` / ``post_mlp_layernorm`` around the MLP), q/k/v biases, a packed ``gate_up_proj``
(``[gate; up]`` rows, shared without a copy) and partial interleaved rotary: the first
``partial_rotary_factor * head_dim`` dims of each head rotate in adjacent pairs ``(2i, 2i + 1)`` with frequency ``i``
(the table's ``R = 2 * len(inv_freq)`` already covers only those dims).
"""

from __future__ import annotations

from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec
from .base import Cat, Source, register
from .llama import LlamaPolicy, _activation


@register
class Glm4Policy(LlamaPolicy):
    """glm4 (``Glm4ForCausalLM``, ``Glm4Model``) decoder layers on fused kernels."""

    model_types = ("glm4",)
    hf_classes = ("Glm4ForCausalLM", "Glm4Model")
    rotary_interleaved = True

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        cfg, attn = model.config, layer.self_attn
        return LayerSpec(
            attention=AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim, attn.scaling),
            mlp=MLPSpec(gated=True, activation=_activation(model)),
            norm=self.norm_spec(layer.input_layernorm),
            residual="sandwich",
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        attn = layer.self_attn
        bias = attn.q_proj.bias is not None
        return {
            "attn_norm.weight": "input_layernorm.weight",
            "attn_out_norm.weight": "post_self_attn_layernorm.weight",
            "mlp_norm.weight": "post_attention_layernorm.weight",  # despite its name: the norm before the MLP
            "mlp_out_norm.weight": "post_mlp_layernorm.weight",
            "attn.qkv.weight": Cat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            "attn.qkv.bias": (
                Cat("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias") if bias else None
            ),
            "attn.o.weight": "self_attn.o_proj.weight",
            "attn.o.bias": "self_attn.o_proj.bias" if attn.o_proj.bias is not None else None,
            "mlp.up.weight": "mlp.gate_up_proj.weight",  # [gate; up] rows already
            "mlp.down.weight": "mlp.down_proj.weight",
        }
