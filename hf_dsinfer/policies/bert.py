"""BERT policy: a post-norm encoder (``ln(x + attn(x))``, ``ln(x + mlp(x))``) with non-causal attention.

Only the encoder layers are fused. Embeddings (word + absolute position + token type, then LayerNorm) stay HF's own
module and are called as they are, so position and token-type rules are HF's by construction; the pooler and every
task head stay HF's too. The fused forward replaces ``BertModel.forward`` only, which is what each head
(``BertForMaskedLM``, sequence/token classification, ...) calls, so they all run on fused layers unchanged.

Encoders keep no KV cache: attention is :func:`~hf_dsinfer.kernels.encoder_attention` over the whole sequence.
Any 2D 0/1 ``attention_mask`` is accepted, as HF does: right padding (BERT tokenizers' default), left padding, holes.
Every real position is computed exactly as HF computes it (attention over the row's real tokens). When a batch holds
enough padding the layers skip it (see :func:`run_encoder_layers`): padding positions come out as zeros, except each
row's first position, which heads read (pooler, ``[CLS]`` classifiers) and which is computed as HF computes it even
when it is padding; ``HF_DSINFER_ENCODER_UNPAD=0`` computes every padding position too, as HF does.

Kept on HF's modules (one warning): ``is_decoder`` / ``add_cross_attention`` (BERT as a causal decoder or with
cross-attention) and activations without an exact fused equivalent.
"""

from __future__ import annotations

import os
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from ..modules import AttentionSpec, LayerSpec, MLPSpec, StepContext
from .base import Cat, Policy, Source, register
from .gpt_neox import plain_activation

if TYPE_CHECKING:
    from .runtime import Runtime

# Keyword arguments of BertModel.forward (and of what heads pass on) that the fused forward cannot honour unless
# they are None or False.
_MUST_BE_UNSET = ("encoder_hidden_states", "encoder_attention_mask", "past_key_values")


def real_tokens(mask: torch.Tensor | None, batch: int, width: int, device: torch.device) -> torch.Tensor | None:
    """Which tokens are real, ``[B, T]`` bool (``attention_mask != 0``), from a 2D padding mask; None: all are.

    Any 0/1 pattern is accepted (right or left padding, holes), as HF's own encoders accept it.
    """
    if mask is None:
        return None
    if mask.ndim != 2 or tuple(mask.shape) != (batch, width):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}; the fused encoder layers take the 2D padding mask "
            f"[batch, tokens] = ({batch}, {width}) (custom or 4D masks need HF's own modules)."
        )
    return (mask != 0).to(device)


#: ``HF_DSINFER_ENCODER_UNPAD=0`` computes padding positions too (HF's values there) instead of skipping them.
UNPAD_ENV = "HF_DSINFER_ENCODER_UNPAD"
#: Skip padding when at least this fraction of the ``[B, T]`` grid is padding (below it the gathers cost more).
UNPAD_MIN_FRACTION = 1 / 16


def _capturing(hidden: torch.Tensor) -> bool:
    return hidden.is_cuda and torch.cuda.is_current_stream_capturing()


def _skip_padding(hidden: torch.Tensor, lens: torch.Tensor) -> bool:
    """Whether to run the layers on the real tokens only (see :func:`run_encoder_layers`)."""
    if os.environ.get(UNPAD_ENV, "1").strip() == "0":
        return False
    if _capturing(hidden):
        return False  # a CUDA graph cannot hold a data-dependent token count: captured forwards keep the padding
    B, T, _ = hidden.shape
    return B * T - int(lens.sum()) >= UNPAD_MIN_FRACTION * B * T  # one host sync


def _real_first_columns(real: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` long: each row's columns reordered so its real tokens come first (in order), then its padding.

    Attention (:func:`~hf_dsinfer.kernels.encoder_attention`) reads a row's real keys as its first ``lens[b]``
    slots; the other layers act per token, so running them on the reordered rows changes nothing.
    """
    B, T = real.shape
    columns = torch.arange(T, device=real.device)
    order_key = (~real).long() * T + columns  # [B, T]: real tokens sort before padding, each group in column order
    return order_key.argsort(dim=1)


def _run(runtime: Runtime, hidden: torch.Tensor, lens: torch.Tensor, packed: tuple | None = None) -> torch.Tensor:
    """The layers over ``hidden`` (``[B, T, C]`` rows with their real tokens first, or ``[1, N, C]`` packed)."""
    zeros = torch.zeros(lens.shape[0], dtype=torch.int32, device=hidden.device)
    positions = torch.zeros(hidden.shape[0] * hidden.shape[1], dtype=torch.long, device=hidden.device)  # unused
    ctx = StepContext(None, zeros, zeros, positions, None, key_lens=lens)
    if packed is not None:
        ctx.token_index, ctx.padded_shape = packed
    residual = None
    for layer in runtime.layers:
        hidden, residual = layer(hidden, residual, ctx)
    return hidden if residual is None else hidden + residual


def run_encoder_layers(runtime: Runtime, hidden: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """The fused encoder layers over ``hidden [B, T, C]``; ``real [B, T]`` bool marks real tokens (None: all).

    Attention of every position covers the real tokens of its row only, as HF's key-padding mask does, for any mask
    pattern. With enough padding the layers run on the real tokens only, packed as ``[1, N, C]``: projections, MLPs
    and norms act per token, so padding is pure waste there (about half of a sorted sentence-transformers batch);
    attention puts the tokens back in rows. Each row's first position is kept in the pack even when it is padding
    (left padding): the pooler and the ``[CLS]`` classification heads read it, and HF computes it (a padding query
    attends the row's real keys). Other padding positions come out as zeros: HF's values there depend on its
    attention implementation too (its flash-attention path zeroes them) and carry no meaning. Without skipping
    (little padding, ``HF_DSINFER_ENCODER_UNPAD=0``, CUDA-graph capture) every position is computed as HF does.
    A row without any real token has no real keys: its attention output is zeros (HF's values there depend on its
    attention implementation).
    """
    B, T, C = hidden.shape
    if real is None:
        return _run(runtime, hidden, torch.full((B,), T, dtype=torch.int32, device=hidden.device))
    lens = real.sum(-1, dtype=torch.int32)  # [B] real tokens per row
    rows = torch.arange(B, device=hidden.device)[:, None]  # [B, 1]
    if _skip_padding(hidden, lens):
        computed = real.clone()
        computed[:, 0] = True  # heads read each row's first position
        counts = computed.sum(-1)  # [B]
        width = int(counts.max())  # one host sync: the attention grid is [B, width]
        columns = _real_first_columns(real)[:, :width]  # [B, width]: real tokens, then the first padding column
        slots = torch.arange(width, device=hidden.device)[None, :]  # [1, width]
        in_row = slots < counts[:, None]  # [B, width]
        source = (rows * T + columns)[in_row]  # [N] tokens of the [B * T] grid, rows' real tokens first
        packed = hidden.reshape(B * T, C).index_select(0, source)[None]  # [1, N, C]
        out = _run(runtime, packed, lens, ((rows * width + slots)[in_row], (B, width)))  # [1, N, C]
        return out.new_zeros(B * T, C).index_copy_(0, source, out[0]).view(B, T, C)
    if not _capturing(hidden) and not bool((real[:, 1:] & ~real[:, :-1]).any()):  # one host sync
        return _run(runtime, hidden, lens)  # right padding: real tokens are already first in every row
    columns = _real_first_columns(real)  # [B, T]: a permutation of each row (the identity for right padding)
    index = (rows * T + columns).flatten()  # [B * T]
    out = _run(runtime, hidden.reshape(B * T, C).index_select(0, index).view(B, T, C), lens)  # [B, T, C]
    return out.new_empty(B * T, C).index_copy_(0, index, out.reshape(B * T, C)).view(B, T, C)


def install_encoder_forward(model: nn.Module, runtime: Runtime) -> None:
    """Bind the fused forward on ``model.base_model`` (a ``BertModel``); HF heads keep their own forward around it."""
    base = model.base_model

    def encoder_forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPoolingAndCrossAttentions | tuple:
        """Fused replacement of ``BertModel.forward``: HF embeddings, fused layers, HF pooler."""
        for key, value in kwargs.items():
            if value is None or value is False:
                continue
            hint = " (encoder-decoder use needs HF's modules)" if key in _MUST_BE_UNSET else ""
            raise ValueError(f"{key}={value!r} is not supported by the fused encoder layers{hint}.")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        hidden = self.embeddings(
            input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds
        )  # [B, T, C]
        B, T, _ = hidden.shape
        real = real_tokens(attention_mask, B, T, hidden.device)  # [B, T] bool or None
        hidden = run_encoder_layers(runtime, hidden, real)
        pooled = self.pooler(hidden) if getattr(self, "pooler", None) is not None else None  # [B, C]
        out = BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=hidden, pooler_output=pooled)
        return out if return_dict is not False else out.to_tuple()

    base.forward = MethodType(encoder_forward, base)


@register
class BertPolicy(Policy):
    """bert encoders (``BertModel`` and the encoder-only heads) on fused layers."""

    model_types = ("bert",)
    hf_classes = (
        "BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification",
        "BertForQuestionAnswering", "BertForMultipleChoice", "BertForNextSentencePrediction", "BertForPreTraining",
    )  # fmt: skip
    layers_attr = "encoder.layer"
    embed_attr = "embeddings.word_embeddings"
    final_norm_attr = None  # post-norm: every layer ends in its own LayerNorm
    rotary_attr = None

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        cfg = model.config
        if cfg.is_decoder or cfg.add_cross_attention:
            return "is_decoder/add_cross_attention (BERT as a decoder) has no fused encoder path"
        if not isinstance(cfg.hidden_act, str) or plain_activation(cfg.hidden_act) is None:
            return f"hidden_act={cfg.hidden_act!r} has no fused MLP equivalent"
        return None

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        attn = layer.attention.self
        heads = attn.num_attention_heads
        return LayerSpec(
            attention=AttentionSpec(
                heads, heads, attn.attention_head_size, float(attn.scaling), rotary=False, causal=False
            ),
            mlp=MLPSpec(gated=False, activation=plain_activation(model.config.hidden_act)),
            norm=self.norm_spec(layer.attention.output.LayerNorm),
            residual="post",
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        return {
            "attn_norm.weight": "attention.output.LayerNorm.weight",
            "attn_norm.bias": "attention.output.LayerNorm.bias",
            "mlp_norm.weight": "output.LayerNorm.weight",
            "mlp_norm.bias": "output.LayerNorm.bias",
            "attn.qkv.weight": Cat(
                "attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight"
            ),
            "attn.qkv.bias": Cat("attention.self.query.bias", "attention.self.key.bias", "attention.self.value.bias"),
            "attn.o.weight": "attention.output.dense.weight",
            "attn.o.bias": "attention.output.dense.bias",
            "mlp.up.weight": "intermediate.dense.weight",
            "mlp.up.bias": "intermediate.dense.bias",
            "mlp.down.weight": "output.dense.weight",
            "mlp.down.bias": "output.dense.bias",
        }

    def install_forward(self, model: nn.Module, runtime: Runtime) -> None:
        install_encoder_forward(model, runtime)
