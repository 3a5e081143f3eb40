"""RoBERTa and DistilBERT encoders on the BERT path (``bert.py``): post-norm layers, non-causal
``encoder_attention``, any 2D padding mask, no KV cache; HF's embeddings, pooler and task heads are called as they are.

* RoBERTa's model, layers and heads are BERT's under other class names (its embeddings derive positions from the
  padding index, which HF's own embedding module does), so :class:`RobertaPolicy` is :class:`BertPolicy` retargeted.
* DistilBERT names its layer parts differently (``q_lin``/``k_lin``/``v_lin``/``out_lin``, ``sa_layer_norm``,
  ``ffn.lin1``/``lin2``, ``output_layer_norm``), has no token types and no pooler, and its model returns a
  ``BaseModelOutput``: its own weight map and forward, the same fused layers.
"""

from __future__ import annotations

from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from ..modules import AttentionSpec, LayerSpec, MLPSpec
from .base import Cat, Policy, Source, register
from .bert import BertPolicy, real_tokens, run_encoder_layers
from .gpt_neox import plain_activation

if TYPE_CHECKING:
    from .runtime import Runtime


@register
class RobertaPolicy(BertPolicy):
    """roberta encoders (``RobertaModel`` and its encoder-only heads) on fused layers."""

    model_types = ("roberta",)
    hf_classes = (
        "RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification", "RobertaForTokenClassification",
        "RobertaForQuestionAnswering", "RobertaForMultipleChoice",
    )  # fmt: skip


def install_distilbert_forward(model: nn.Module, runtime: Runtime) -> None:
    """Bind the fused forward on ``model.base_model`` (a ``DistilBertModel``); heads keep their own forward."""
    base = model.base_model

    def distilbert_forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutput | tuple:
        """Fused replacement of ``DistilBertModel.forward``: HF embeddings, fused layers."""
        for key, value in kwargs.items():
            if value is None or value is False:
                continue
            raise ValueError(f"{key}={value!r} is not supported by the fused encoder layers.")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        hidden = self.embeddings(input_ids, inputs_embeds, position_ids)  # [B, T, C]
        B, T, _ = hidden.shape
        real = real_tokens(attention_mask, B, T, hidden.device)  # [B, T] bool or None
        out = BaseModelOutput(last_hidden_state=run_encoder_layers(runtime, hidden, real))
        return out if return_dict is not False else out.to_tuple()

    base.forward = MethodType(distilbert_forward, base)


@register
class DistilBertPolicy(Policy):
    """distilbert encoders (``DistilBertModel`` and its heads) on fused layers."""

    model_types = ("distilbert",)
    hf_classes = (
        "DistilBertModel", "DistilBertForMaskedLM", "DistilBertForSequenceClassification",
        "DistilBertForTokenClassification", "DistilBertForQuestionAnswering", "DistilBertForMultipleChoice",
    )  # fmt: skip
    layers_attr = "transformer.layer"
    embed_attr = "embeddings.word_embeddings"
    final_norm_attr = None  # post-norm: every layer ends in its own LayerNorm
    rotary_attr = None

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        act = model.config.activation
        if not isinstance(act, str) or plain_activation(act) is None:
            return f"activation={act!r} has no fused MLP equivalent"
        return None

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        attn = layer.attention
        return LayerSpec(
            attention=AttentionSpec(
                attn.n_heads, attn.n_heads, attn.attention_head_size, float(attn.scaling), rotary=False, causal=False
            ),
            mlp=MLPSpec(gated=False, activation=plain_activation(model.config.activation)),
            norm=self.norm_spec(layer.sa_layer_norm),
            residual="post",
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        return {
            "attn_norm.weight": "sa_layer_norm.weight",
            "attn_norm.bias": "sa_layer_norm.bias",
            "mlp_norm.weight": "output_layer_norm.weight",
            "mlp_norm.bias": "output_layer_norm.bias",
            "attn.qkv.weight": Cat("attention.q_lin.weight", "attention.k_lin.weight", "attention.v_lin.weight"),
            "attn.qkv.bias": Cat("attention.q_lin.bias", "attention.k_lin.bias", "attention.v_lin.bias"),
            "attn.o.weight": "attention.out_lin.weight",
            "attn.o.bias": "attention.out_lin.bias",
            "mlp.up.weight": "ffn.lin1.weight",
            "mlp.up.bias": "ffn.lin1.bias",
            "mlp.down.weight": "ffn.lin2.weight",
            "mlp.down.bias": "ffn.lin2.bias",
        }

    def install_forward(self, model: nn.Module, runtime: Runtime) -> None:
        install_distilbert_forward(model, runtime)
