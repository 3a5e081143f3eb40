"""Llama-family policies: llama, mistral, qwen2 (qkv bias), qwen3 (qk-norm), phi3 (fused qkv_proj / gate_up_proj).

All are pre-norm decoders with RMSNorm, rotate-half rotary from ``model.rotary_emb`` and a gated MLP; they differ
only in where the weights live and in a few attention details read from the HF modules themselves.
"""

from __future__ import annotations

from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec
from .base import Cat, Policy, Source, activation_name, register

_MISSING = object()


def _sliding_window(model: nn.Module, attn: nn.Module) -> int | None:
    """The window of one attention module: qwen2/qwen3 set it per layer on the module (None on full-attention
    layers); mistral/phi3 apply ``config.sliding_window`` to every layer."""
    window = getattr(attn, "sliding_window", _MISSING)
    if window is _MISSING:
        window = getattr(model.config, "sliding_window", None)
    return int(window) if window else None


def _activation(model: nn.Module) -> str | None:
    """Kernel name of the gated MLP's activation, or None when the kernel has no exact equivalent."""
    name = activation_name(model.config.hidden_act)
    return name if name in ("silu", "gelu", "gelu_tanh") else None


@register
class LlamaPolicy(Policy):
    """llama, mistral, qwen2, qwen3: separate q/k/v (packed here into one GEMM) and gate/up (packed likewise)."""

    model_types = ("llama", "mistral", "qwen2", "qwen3")
    hf_classes = (
        "LlamaForCausalLM", "LlamaModel", "MistralForCausalLM", "MistralModel",
        "Qwen2ForCausalLM", "Qwen2Model", "Qwen3ForCausalLM", "Qwen3Model",
    )  # fmt: skip

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        if _activation(model) is None:
            return f"hidden_act={model.config.hidden_act!r} has no fused gated-MLP equivalent"
        return super().unsupported(model, max_out_tokens)

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        cfg, attn = model.config, layer.self_attn
        q_norm = getattr(attn, "q_norm", None)
        return LayerSpec(
            attention=AttentionSpec(
                num_heads=cfg.num_attention_heads,
                num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                head_dim=attn.head_dim,
                scale=float(attn.scaling),
                sliding_window=_sliding_window(model, attn),
                qk_norm=self.norm_spec(q_norm) if q_norm is not None else None,
            ),
            mlp=MLPSpec(gated=True, activation=_activation(model)),
            norm=self.norm_spec(layer.input_layernorm),
            residual="pre",
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        attn, mlp = layer.self_attn, layer.mlp
        has_qkv_bias = attn.q_proj.bias is not None
        return {
            "attn_norm.weight": "input_layernorm.weight",
            "mlp_norm.weight": "post_attention_layernorm.weight",
            "attn.qkv.weight": Cat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            "attn.qkv.bias": (
                Cat("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias") if has_qkv_bias else None
            ),
            "attn.o.weight": "self_attn.o_proj.weight",
            "attn.o.bias": "self_attn.o_proj.bias" if attn.o_proj.bias is not None else None,
            "attn.q_norm.weight": "self_attn.q_norm.weight" if hasattr(attn, "q_norm") else None,
            "attn.k_norm.weight": "self_attn.k_norm.weight" if hasattr(attn, "k_norm") else None,
            "mlp.up.weight": Cat("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            "mlp.up.bias": Cat("mlp.gate_proj.bias", "mlp.up_proj.bias") if mlp.gate_proj.bias is not None else None,
            "mlp.down.weight": "mlp.down_proj.weight",
            "mlp.down.bias": "mlp.down_proj.bias" if mlp.down_proj.bias is not None else None,
        }


@register
class Phi3Policy(LlamaPolicy):
    """phi3: the checkpoint already packs ``qkv_proj`` ([q; k; v] rows) and ``gate_up_proj`` ([gate; up]), so the
    fused layer shares them without a copy; partial rotary comes from the rotary module's frequencies."""

    model_types = ("phi3",)
    hf_classes = ("Phi3ForCausalLM", "Phi3Model")

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        attn = layer.self_attn
        return {
            "attn_norm.weight": "input_layernorm.weight",
            "mlp_norm.weight": "post_attention_layernorm.weight",
            "attn.qkv.weight": "self_attn.qkv_proj.weight",
            "attn.qkv.bias": "self_attn.qkv_proj.bias" if attn.qkv_proj.bias is not None else None,
            "attn.o.weight": "self_attn.o_proj.weight",
            "attn.o.bias": "self_attn.o_proj.bias" if attn.o_proj.bias is not None else None,
            "mlp.up.weight": "mlp.gate_up_proj.weight",
            "mlp.down.weight": "mlp.down_proj.weight",
        }
