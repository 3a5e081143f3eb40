"""Gemma (v1) policy: a llama-shaped decoder with ``(1 + w)`` RMSNorm weights and a gated ``gelu_tanh`` MLP.

The ``sqrt(hidden)`` embedding scale lives inside HF's ``GemmaTextScaledWordEmbedding`` (rounded to the weight
dtype there), which the fused forward calls as is, so it needs nothing here. A legacy ``hidden_act="gelu"`` is
rewritten by ``GemmaConfig`` to the tanh approximation before the model is built.
"""

from __future__ import annotations

from .base import register
from .llama import LlamaPolicy


@register
class GemmaPolicy(LlamaPolicy):
    """gemma decoder layers on fused kernels (same weight names and layer math as llama, Gemma's norm offset)."""

    model_types = ("gemma",)
    hf_classes = ("GemmaForCausalLM", "GemmaModel")
    norm_weight_offset = 1.0  # GemmaRMSNorm scales by (1 + weight), computed in fp32
