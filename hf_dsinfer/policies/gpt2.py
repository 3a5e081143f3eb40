"""GPT-2 policy: pre-norm LayerNorm (with bias) decoder, learned absolute positions (``wpe``), plain MLP.

GPT-2 keeps its projections in transformers' ``Conv1D``, whose weight is ``[in, out]``; the fused layer wants
``[out, in]``, so every projection is a :class:`Transposed` copy (inverted again when saving). ``c_attn`` already packs
``[q | k | v]`` along its output columns, which is exactly the fused qkv row order once transposed.

Attention scale: read from the HF module (``attn.scaling``), which already folds in ``scale_attn_weights`` (False:
no ``1/sqrt(D)``) and ``scale_attn_by_inverse_layer_idx`` (an extra ``1/(layer + 1)``), so both flags are exact.
``reorder_and_upcast_attn`` changes HF's eager rounding order (fp32 scores via baddbmm): the fused path keeps HF's
modules for it, as it does for cross-attention blocks and heads other than the LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec
from ..modules.mlp import PLAIN_ACTIVATIONS
from .base import Policy, Source, Transposed, activation_name, register


@register
class GPT2Policy(Policy):
    """gpt2 (``GPT2LMHeadModel`` and the bare ``GPT2Model``) on fused layers."""

    model_types = ("gpt2",)
    hf_classes = ("GPT2LMHeadModel", "GPT2Model")
    layers_attr = "h"
    embed_attr = "wte"
    final_norm_attr = "ln_f"
    rotary_attr = None  # learned absolute positions, added in embed()

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        cfg = model.config
        if getattr(cfg, "reorder_and_upcast_attn", False):
            return "reorder_and_upcast_attn=True (HF's upcast eager attention order) is not reproduced by fused layers"
        if getattr(cfg, "add_cross_attention", False):
            return "add_cross_attention=True (cross-attention blocks) has no fused path"
        if activation_name(cfg.activation_function) not in PLAIN_ACTIVATIONS:
            return f"activation_function={cfg.activation_function!r} has no fused MLP equivalent"
        return None

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        cfg, attn = model.config, layer.attn
        return LayerSpec(
            attention=AttentionSpec(
                num_heads=attn.num_heads,
                num_kv_heads=attn.num_heads,
                head_dim=attn.head_dim,
                scale=float(attn.scaling),  # 1/sqrt(D), or 1, then / (idx + 1) per the config flags
                rotary=False,
            ),
            mlp=MLPSpec(gated=False, activation=activation_name(cfg.activation_function)),
            norm=self.norm_spec(layer.ln_1),
            residual="pre",
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        # Conv1D computes x @ W + b with W [in, out]; the fused Linear wants [out, in]. Biases are [out] already.
        return {
            "attn_norm.weight": "ln_1.weight",
            "attn_norm.bias": "ln_1.bias",
            "mlp_norm.weight": "ln_2.weight",
            "mlp_norm.bias": "ln_2.bias",
            "attn.qkv.weight": Transposed("attn.c_attn.weight"),  # [C, 3C] -> [3C, C], rows q | k | v
            "attn.qkv.bias": "attn.c_attn.bias",
            "attn.o.weight": Transposed("attn.c_proj.weight"),
            "attn.o.bias": "attn.c_proj.bias",
            "mlp.up.weight": Transposed("mlp.c_fc.weight"),  # [C, I] -> [I, C]
            "mlp.up.bias": "mlp.c_fc.bias",
            "mlp.down.weight": Transposed("mlp.c_proj.weight"),  # [I, C] -> [C, I]
            "mlp.down.bias": "mlp.c_proj.bias",
        }

    def embed(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_inputs(model, model.base_model.wte(input_ids), position_ids)

    def embed_inputs(self, model: nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # HF adds the learned positions to caller-given inputs_embeds as well.
        return inputs_embeds + model.base_model.wpe(position_ids).to(inputs_embeds.device)  # [B, T, C]
