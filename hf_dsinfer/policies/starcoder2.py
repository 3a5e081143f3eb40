"""StarCoder2 policy: pre-norm LayerNorms with bias, GQA with biases on every projection (``use_bias``), a plain
``c_fc -> act -> c_proj`` MLP, rotate-half rotary, and one ``sliding_window`` for every layer (None: full attention).

Dropouts (embedding, attention, residual) are inactive in eval, which is the only mode the fused forward serves.
"""

from __future__ import annotations

from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec
from .base import Cat, Policy, Source, register
from .gpt_neox import plain_activation


def _bias(module: nn.Linear, name: str) -> str | None:
    return name if module.bias is not None else None


@register
class Starcoder2Policy(Policy):
    """starcoder2 (``Starcoder2ForCausalLM``, ``Starcoder2Model``) decoder layers on fused kernels."""

    model_types = ("starcoder2",)
    hf_classes = ("Starcoder2ForCausalLM", "Starcoder2Model")

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        if plain_activation(model.config.hidden_act) is None:
            return f"hidden_act={model.config.hidden_act!r} has no fused MLP equivalent"
        return super().unsupported(model, max_out_tokens)

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        cfg, attn = model.config, layer.self_attn
        window = getattr(cfg, "sliding_window", None)
        return LayerSpec(
            attention=AttentionSpec(
                num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=attn.head_dim,
                scale=float(attn.scaling),
                sliding_window=int(window) if window else None,
            ),
            mlp=MLPSpec(gated=False, activation=plain_activation(cfg.hidden_act)),
            norm=self.norm_spec(layer.input_layernorm),
            residual="pre",
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        attn, mlp = layer.self_attn, layer.mlp
        bias = attn.q_proj.bias is not None
        return {
            "attn_norm.weight": "input_layernorm.weight",
            "attn_norm.bias": "input_layernorm.bias",
            "mlp_norm.weight": "post_attention_layernorm.weight",
            "mlp_norm.bias": "post_attention_layernorm.bias",
            "attn.qkv.weight": Cat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            "attn.qkv.bias": (
                Cat("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias") if bias else None
            ),
            "attn.o.weight": "self_attn.o_proj.weight",
            "attn.o.bias": _bias(attn.o_proj, "self_attn.o_proj.bias"),
            "mlp.up.weight": "mlp.c_fc.weight",
            "mlp.up.bias": _bias(mlp.c_fc, "mlp.c_fc.bias"),
            "mlp.down.weight": "mlp.c_proj.weight",
            "mlp.down.bias": _bias(mlp.c_proj, "mlp.c_proj.bias"),
        }
