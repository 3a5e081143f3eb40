"""GPT-Neo policy: GPT-2's shape with ``nn.Linear`` projections (no Conv1D), q/k/v without bias, learned positions,
no attention scaling (scores are plain ``q k^T``, computed in fp32 like HF), and alternating layer types from
``config.attention_layers``: ``global`` layers attend everything, ``local`` ones the last ``window_size`` positions.

HF's local mask counts cache slots, so left padding shifts its window in HF's own batched runs; the fused layers
count real tokens, which is what a single unpadded run does (padded batches equal single runs).
"""

from __future__ import annotations

import torch
from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec
from .base import Cat, Policy, Source, register
from .gpt_neox import plain_activation


@register
class GPTNeoPolicy(Policy):
    """gpt_neo (``GPTNeoForCausalLM``, ``GPTNeoModel``) decoder layers on fused kernels."""

    model_types = ("gpt_neo",)
    hf_classes = ("GPTNeoForCausalLM", "GPTNeoModel")
    layers_attr = "h"
    embed_attr = "wte"
    final_norm_attr = "ln_f"
    rotary_attr = None  # learned absolute positions, added in embed()

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        if plain_activation(model.config.activation_function) is None:
            return f"activation_function={model.config.activation_function!r} has no fused MLP equivalent"
        return None

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        cfg, attn = model.config, layer.attn.attention
        local = layer.attn.attention_type == "local"
        return LayerSpec(
            attention=AttentionSpec(
                attn.num_heads, attn.num_heads, attn.head_dim, 1.0,  # GPT-Neo does not scale its scores
                rotary=False, sliding_window=int(cfg.window_size) if local else None,
            ),
            mlp=MLPSpec(gated=False, activation=plain_activation(cfg.activation_function)),
            norm=self.norm_spec(layer.ln_1),
            residual="pre",
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        return {
            "attn_norm.weight": "ln_1.weight",
            "attn_norm.bias": "ln_1.bias",
            "mlp_norm.weight": "ln_2.weight",
            "mlp_norm.bias": "ln_2.bias",
            "attn.qkv.weight": Cat(
                "attn.attention.q_proj.weight", "attn.attention.k_proj.weight", "attn.attention.v_proj.weight"
            ),
            "attn.o.weight": "attn.attention.out_proj.weight",
            "attn.o.bias": "attn.attention.out_proj.bias",
            "mlp.up.weight": "mlp.c_fc.weight",
            "mlp.up.bias": "mlp.c_fc.bias",
            "mlp.down.weight": "mlp.c_proj.weight",
            "mlp.down.bias": "mlp.c_proj.bias",
        }

    def embed(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_inputs(model, model.base_model.wte(input_ids), position_ids)

    def embed_inputs(self, model: nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # HF adds the learned positions to caller-given inputs_embeds as well.
        return inputs_embeds + model.base_model.wpe(position_ids).to(inputs_embeds.device)  # [B, T, C]
