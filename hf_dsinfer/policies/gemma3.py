"""Gemma-3 text policy (``gemma3_text``): gemma2's sandwich norms and ``(1 + w)`` weights, plus

* per-head q/k RMSNorms (``(1 + w)`` too) before rotary;
* interleaved layer types (``config.layer_types``): ``sliding_attention`` layers see a window of the last
  ``sliding_window`` positions and rotate with their own rope base (``rope_parameters["sliding_attention"]``),
  ``full_attention`` layers attend everything with the global base (and its scaling, e.g. linear);
* the attention scale ``query_pre_attn_scalar ** -0.5`` (read from ``attn.scaling``), optional final-logit
  soft-capping, embeddings scaled by ``sqrt(hidden)`` inside HF's embedding module. ``attn_logit_softcapping`` is
  stored by HF's attention module but not applied (transformers 5.x), so it is not applied here either.

The model's rotary table is the full-attention one; every layer of another type gets its type's table
(:meth:`Gemma3TextPolicy.install_forward`), one table per type shared by its layers.

Kept on HF's modules: ``use_bidirectional_attention`` (the embedding variant: not causal), rope types that change
their frequencies past the original length, and activations without a fused gated equivalent.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..modules import LayerSpec, RotaryTable
from .base import Source, register
from .gemma2 import Gemma2Policy

if TYPE_CHECKING:
    from .runtime import Runtime

_GLOBAL = "full_attention"


def _table(rotary: nn.Module, layer_type: str, max_positions: int, dtype: torch.dtype) -> RotaryTable:
    """The cos/sin table of one layer type, from the HF rotary module's pristine frequencies for that type."""
    inv_freq = getattr(rotary, f"{layer_type}_original_inv_freq", None)
    if inv_freq is None:
        inv_freq = getattr(rotary, f"{layer_type}_inv_freq")
    scaling = float(getattr(rotary, f"{layer_type}_attention_scaling", 1.0))
    return RotaryTable.from_inv_freq(inv_freq, max_positions, scaling, round_to=dtype)


def _base_type(model: nn.Module) -> str:
    """The layer type whose table is the model's own: full attention, or the only type a model without full-attention
    layers has (HF's rotary module then holds no full-attention frequencies)."""
    layer_types = list(model.config.layer_types)
    return _GLOBAL if _GLOBAL in layer_types else layer_types[0]


@register
class Gemma3TextPolicy(Gemma2Policy):
    """gemma3_text (``Gemma3ForCausalLM``, ``Gemma3TextModel``) decoder layers on fused kernels."""

    model_types = ("gemma3_text",)
    hf_classes = ("Gemma3ForCausalLM", "Gemma3TextModel")

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        cfg = model.config
        if getattr(cfg, "use_bidirectional_attention", False):
            return "use_bidirectional_attention=True (non-causal embedding model) has no fused decoder path"
        rope_types = getattr(model.base_model.rotary_emb, "rope_type", {})
        for layer_type, rope_type in rope_types.items():
            if rope_type in ("dynamic", "longrope"):
                return f"rope_type={rope_type!r} for {layer_type} layers changes its frequencies with the length"
        return super().unsupported(model, max_out_tokens)

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        spec = super().layer_spec(model, idx, layer)  # sandwich norms, window (None on full layers)
        # Gemma3Attention keeps config.attn_logit_softcapping but never passes it to its attention function: HF's
        # scores are not soft-capped, whatever the config says, so neither are the fused ones.
        attention = dataclasses.replace(
            spec.attention, qk_norm=self.norm_spec(layer.self_attn.q_norm), softcap=None
        )
        return dataclasses.replace(spec, attention=attention)

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        return {
            **super().weight_map(model, idx, layer),
            "attn.q_norm.weight": "self_attn.q_norm.weight",
            "attn.k_norm.weight": "self_attn.k_norm.weight",
        }

    def rotary_table(self, model: nn.Module, max_positions: int, dtype: torch.dtype) -> RotaryTable:
        return _table(model.base_model.rotary_emb, _base_type(model), max_positions, dtype)

    def install_forward(self, model: nn.Module, runtime: Runtime) -> None:
        # Layers of another type than the model's table rotate with their own base: one table per type.
        rotary, layer_types, base = model.base_model.rotary_emb, model.config.layer_types, _base_type(model)
        tables: dict[str, RotaryTable] = {}
        for layer, layer_type in zip(runtime.layers, layer_types):
            if layer_type != base:
                if layer_type not in tables:
                    tables[layer_type] = _table(
                        rotary, layer_type, runtime.rotary.max_positions, next(layer.parameters()).dtype
                    ).to(runtime.rotary.cos.device)
                layer.attn.rotary = tables[layer_type]
        super().install_forward(model, runtime)
