"""Falcon policy: fused ``query_key_value`` in three layouts, rotary, LayerNorm with bias, plain GELU MLP.

Layouts of ``query_key_value`` rows (``D`` = head dim, ``H`` query heads):

* ``multi_query`` (falcon-7b): ``[H + 2, D]``, i.e. all q heads, one k head, one v head: already the fused
  ``[q | k | v]`` order, shared without a copy;
* ``new_decoder_architecture`` (falcon-40b/180b): ``num_kv_heads`` groups of ``[G q heads, k, v]`` with
  ``G = H / num_kv_heads``, HF's way of writing GQA (it broadcasts each group's k/v over its q heads);
* neither: per-head interleaved ``[H, 3, D]``, GPT-NeoX's layout.

The last two are :class:`~hf_dsinfer.policies.gpt_neox.GroupedQKV` regroupings. Residual: the new architecture with
``ln_attn``/``ln_mlp`` is ``x + attn(ln_attn(x)) + mlp(ln_mlp(x))``; ``parallel_attn`` with one ``input_layernorm``
shares it between both branches; otherwise pre-norm with ``post_attention_layernorm``.

Kept on HF's modules (one warning): ``alibi=True`` (ALiBi position biases have no fused kernel; the rotary path is
the only one), and activations without an exact fused equivalent.
"""

from __future__ import annotations

from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec
from .base import Policy, Source, register
from .gpt_neox import GroupedQKV, plain_activation


def _layout(model: nn.Module) -> tuple[int, int]:
    """``(num_kv_heads, q heads per kv head)`` of the fused attention, from the config's layout flags."""
    cfg = model.config
    heads = cfg.num_attention_heads
    if cfg.new_decoder_architecture:
        kv = cfg.num_kv_heads or heads
    elif cfg.multi_query:
        kv = 1
    else:
        kv = heads
    return kv, heads // kv


@register
class FalconPolicy(Policy):
    """falcon (``FalconForCausalLM`` and the bare ``FalconModel``) on fused layers."""

    model_types = ("falcon",)
    hf_classes = ("FalconForCausalLM", "FalconModel")
    layers_attr = "h"
    embed_attr = "word_embeddings"
    final_norm_attr = "ln_f"

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        cfg = model.config
        if cfg.alibi:
            return "alibi=True (ALiBi attention biases) has no fused kernel"
        if plain_activation(cfg.activation) is None:
            return f"activation={cfg.activation!r} has no fused MLP equivalent"
        return super().unsupported(model, max_out_tokens)

    def _norms(self, model: nn.Module, layer: nn.Module) -> tuple[str, str | None, str]:
        """``(attention-branch norm, MLP-branch norm or None, residual style)`` as HF's layer forward picks them."""
        cfg = model.config
        if cfg.new_decoder_architecture and cfg.num_ln_in_parallel_attn == 2:
            return "ln_attn", "ln_mlp", "parallel"
        if cfg.new_decoder_architecture or cfg.parallel_attn:
            return "input_layernorm", None, "parallel"  # one norm feeds both branches
        return "input_layernorm", "post_attention_layernorm", "pre"

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        attn = layer.self_attention
        kv, _ = _layout(model)
        attn_norm, _, residual = self._norms(model, layer)
        return LayerSpec(
            attention=AttentionSpec(attn.num_heads, kv, attn.head_dim, float(attn.inv_norm_factor)),
            mlp=MLPSpec(gated=False, activation=plain_activation(model.config.activation)),
            norm=self.norm_spec(layer.get_submodule(attn_norm)),
            residual=residual,
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        attn, mlp = layer.self_attention, layer.mlp
        kv, per_kv = _layout(model)
        attn_norm, mlp_norm, _ = self._norms(model, layer)

        def qkv(name: str) -> Source | str:
            # One kv head: rows are [q heads | k | v] already, so the HF tensor is shared as is.
            return name if kv == 1 else GroupedQKV(name, kv, per_kv, attn.head_dim)

        has_bias = attn.query_key_value.bias is not None
        return {
            "attn_norm.weight": f"{attn_norm}.weight",
            "attn_norm.bias": f"{attn_norm}.bias",
            "mlp_norm.weight": f"{mlp_norm}.weight" if mlp_norm else None,
            "mlp_norm.bias": f"{mlp_norm}.bias" if mlp_norm else None,
            "attn.qkv.weight": qkv("self_attention.query_key_value.weight"),
            "attn.qkv.bias": qkv("self_attention.query_key_value.bias") if has_bias else None,
            "attn.o.weight": "self_attention.dense.weight",
            "attn.o.bias": "self_attention.dense.bias" if attn.dense.bias is not None else None,
            "mlp.up.weight": "mlp.dense_h_to_4h.weight",
            "mlp.up.bias": "mlp.dense_h_to_4h.bias" if mlp.dense_h_to_4h.bias is not None else None,
            "mlp.down.weight": "mlp.dense_4h_to_h.weight",
            "mlp.down.bias": "mlp.dense_4h_to_h.bias" if mlp.dense_4h_to_h.bias is not None else None,
        }
