"""BLOOM policy: ALiBi instead of positions, a fused ``query_key_value`` interleaved per head, LayerNorms with bias
(one more right after the word embeddings), and a plain MLP with BLOOM's tanh GELU.

* ALiBi: HF adds ``slope[h] * j`` to every score, ``j`` being the key's position among the row's real tokens
  (``cumsum(mask) - 1``). The compact KV cache stores row ``b``'s real tokens in slots ``0, 1, ...``, so the slot
  index is that position; the attention kernels add ``slope * slot`` (``AttentionSpec.alibi_slopes``).
  The slopes follow the ALiBi paper's geometric sequence (:func:`alibi_slopes`), computed in fp32 like HF.
* ``query_key_value`` rows are ``[H, 3, D]`` (per head q, k, v): regrouped by ``GroupedQKV`` (as GPT-NeoX).
* ``word_embeddings_layernorm`` is applied to the embeddings (caller-given ``inputs_embeds`` included), like HF.
* Tensor parallelism: a head's slope depends on its index among all heads. AutoTP keeps heads ``[first, stop)`` on a
  rank (uneven splits included) and records that range on the attention module (``tp_layout.alibi_head_range``); the
  rank's fused layer takes the slopes of exactly those heads.

Kept on HF's modules: ``apply_residual_connection_post_layernorm=True`` (the residual is the normed input) and
``pretraining_tp > 1`` with ``slow_but_exact=True`` (HF sums its linears in slices, another rounding order).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec
from .base import Policy, Source, register
from .gpt_neox import GroupedQKV
from .tp_layout import alibi_head_range


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """ALiBi slopes of ``num_heads`` heads: for the largest power of two ``n <= num_heads``, ``2^(-8i/n)`` for
    ``i = 1..n``; the remaining heads take every other slope of the ``2n`` sequence (odd ``i``). fp32 values."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.pow(torch.tensor(2.0 ** (-8.0 / n)), torch.arange(1, n + 1, dtype=torch.int32))
    if n != num_heads:
        extra = min(n, num_heads - n)
        odd = torch.arange(1, 2 * extra, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(torch.tensor(2.0 ** (-4.0 / n)), odd)])
    return tuple(float(s) for s in slopes)


@register
class BloomPolicy(Policy):
    """bloom (``BloomForCausalLM``, ``BloomModel``) decoder layers on fused kernels."""

    model_types = ("bloom",)
    hf_classes = ("BloomForCausalLM", "BloomModel")
    layers_attr = "h"
    embed_attr = "word_embeddings"
    final_norm_attr = "ln_f"
    rotary_attr = None  # ALiBi: no positions

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        cfg = model.config
        if cfg.apply_residual_connection_post_layernorm:
            return "apply_residual_connection_post_layernorm=True (residual taken after the norm) is not fused"
        if cfg.pretraining_tp > 1 and cfg.slow_but_exact:
            return f"pretraining_tp={cfg.pretraining_tp} with slow_but_exact=True (sliced linears) is not fused"
        return None

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        attn = layer.self_attention
        heads = attn.num_heads  # this rank's heads under tensor parallelism
        first, stop, total = alibi_head_range(attn) or (0, heads, heads)
        return LayerSpec(
            attention=AttentionSpec(
                heads,
                heads,
                attn.head_dim,
                float(attn.inv_norm_factor),
                rotary=False,
                alibi_slopes=alibi_slopes(total)[first:stop],
            ),
            mlp=MLPSpec(gated=False, activation="gelu_tanh"),  # BloomGelu: the tanh approximation
            norm=self.norm_spec(layer.input_layernorm),
            residual="pre",
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        attn = layer.self_attention
        H, D = attn.num_heads, attn.head_dim
        return {
            "attn_norm.weight": "input_layernorm.weight",
            "attn_norm.bias": "input_layernorm.bias",
            "mlp_norm.weight": "post_attention_layernorm.weight",
            "mlp_norm.bias": "post_attention_layernorm.bias",
            "attn.qkv.weight": GroupedQKV("self_attention.query_key_value.weight", H, 1, D),  # [H, 3, D] rows
            "attn.qkv.bias": GroupedQKV("self_attention.query_key_value.bias", H, 1, D),
            "attn.o.weight": "self_attention.dense.weight",
            "attn.o.bias": "self_attention.dense.bias",
            "mlp.up.weight": "mlp.dense_h_to_4h.weight",
            "mlp.up.bias": "mlp.dense_h_to_4h.bias",
            "mlp.down.weight": "mlp.dense_4h_to_h.weight",
            "mlp.down.bias": "mlp.dense_4h_to_h.bias",
        }

    def embed(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_inputs(model, model.base_model.word_embeddings(input_ids), position_ids)

    def embed_inputs(self, model: nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return model.base_model.word_embeddings_layernorm(inputs_embeds)  # [B, T, C], as BloomModel.forward
