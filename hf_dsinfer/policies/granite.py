"""Granite policy: llama's layers plus four scalar multipliers from the config.

* ``attention_multiplier`` is the attention scale (read from ``attn.scaling``, which HF sets to it);
* ``residual_multiplier`` scales each block's output before its residual add (``LayerSpec.residual_scale``);
* ``embedding_multiplier`` scales the token embeddings (HF does it in ``GraniteModel.forward``, so :meth:`embed` and
  :meth:`embed_inputs` do it here, caller-given ``inputs_embeds`` included);
* ``logits_scaling`` divides the logits (:meth:`finalize_logits`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..modules import LayerSpec
from .base import register
from .llama import LlamaPolicy


@register
class GranitePolicy(LlamaPolicy):
    """granite (``GraniteForCausalLM``, ``GraniteModel``) decoder layers on fused kernels."""

    model_types = ("granite",)
    hf_classes = ("GraniteForCausalLM", "GraniteModel")

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        spec = super().layer_spec(model, idx, layer)  # the scale is attn.scaling = attention_multiplier
        return dataclasses.replace(spec, residual_scale=float(model.config.residual_multiplier))

    def embed(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_inputs(model, model.base_model.embed_tokens(input_ids), position_ids)

    def embed_inputs(self, model: nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return inputs_embeds * model.config.embedding_multiplier  # [B, T, C], as GraniteModel.forward

    def finalize_logits(self, model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        return logits / model.config.logits_scaling
