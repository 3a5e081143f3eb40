"""GPT-NeoX policy (pythia, gpt-neox-20b): fused per-head ``query_key_value``, partial rotary, LayerNorm with bias,
plain MLP, parallel residual (``x + attn(ln1(x)) + mlp(ln2(x))``) or, with ``use_parallel_residual=False``, the usual
pre-norm sequence.

HF's ``query_key_value`` interleaves the projections per head: its output rows are ``[H, 3, D]`` (head 0's q, k, v,
then head 1's ...). The fused layer wants ``[q | k | v]`` rows, so :class:`GroupedQKV` regroups them at injection and
restores the interleaved layout when saving. The same class describes Falcon's layouts (see ``falcon.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec
from ..modules.mlp import PLAIN_ACTIVATIONS
from .base import GetParam, Policy, Source, activation_name, register


class GroupedQKV(Source):
    """A packed projection whose rows are grouped per KV head: ``[Hk, G + 2, D]`` (G query heads, then that group's
    key head and value head). GPT-NeoX is ``Hk = H, G = 1`` (``[H, 3, D]``); Falcon's new decoder architecture is
    ``Hk`` groups of ``G = H / Hk``. Works for weights ``[rows, C]`` and biases ``[rows]`` alike (a copy).

    Query head ``g`` of group ``j`` becomes fused head ``j * G + g``, which keeps GQA's "q head h uses kv head h // G".
    """

    moves_rows_only = True  # a row permutation: quantized weights, scales and zeros regroup alike

    def __init__(self, name: str, num_kv_heads: int, q_per_kv: int, head_dim: int):
        self.name = name
        self.groups, self.q_per_kv, self.head_dim = num_kv_heads, q_per_kv, head_dim

    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def pack(self, get: GetParam) -> torch.Tensor:
        w = get(self.name).detach()
        Hk, G, D = self.groups, self.q_per_kv, self.head_dim
        grouped = w.reshape(Hk, G + 2, D, *w.shape[1:])  # [Hk, G + 2, D, (C)]
        q = grouped[:, :G].reshape(Hk * G * D, *w.shape[1:])
        k = grouped[:, G].reshape(Hk * D, *w.shape[1:])
        v = grouped[:, G + 1].reshape(Hk * D, *w.shape[1:])
        return torch.cat([q, k, v], dim=0)  # [(Hq + 2 Hk) * D, (C)]

    def unpack(self, fused: torch.Tensor) -> dict[str, torch.Tensor]:
        Hk, G, D = self.groups, self.q_per_kv, self.head_dim
        rest = fused.shape[1:]
        q, k, v = torch.split(fused, [Hk * G * D, Hk * D, Hk * D], dim=0)
        grouped = torch.cat(
            [q.reshape(Hk, G, D, *rest), k.reshape(Hk, 1, D, *rest), v.reshape(Hk, 1, D, *rest)], dim=1
        )  # [Hk, G + 2, D, (C)]
        return {self.name: grouped.reshape(Hk * (G + 2) * D, *rest).contiguous()}

    def __repr__(self) -> str:
        return f"GroupedQKV({self.name!r}, kv_heads={self.groups}, q_per_kv={self.q_per_kv}, head_dim={self.head_dim})"


def plain_activation(hf_name: str) -> str | None:
    """Kernel name of a plain (non-gated) MLP activation, or None without an exact equivalent."""
    name = activation_name(hf_name)
    return name if name in PLAIN_ACTIVATIONS else None


@register
class GPTNeoXPolicy(Policy):
    """gpt_neox (``GPTNeoXForCausalLM`` and the bare ``GPTNeoXModel``) on fused layers."""

    model_types = ("gpt_neox",)
    hf_classes = ("GPTNeoXForCausalLM", "GPTNeoXModel")
    embed_attr = "embed_in"
    final_norm_attr = "final_layer_norm"

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        if plain_activation(model.config.hidden_act) is None:
            return f"hidden_act={model.config.hidden_act!r} has no fused MLP equivalent"
        return super().unsupported(model, max_out_tokens)

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        cfg, attn = model.config, layer.attention
        heads = cfg.num_attention_heads
        return LayerSpec(
            # Partial rotary needs nothing here: the table only covers the rotary dims (R = 2 * len(inv_freq)).
            attention=AttentionSpec(heads, heads, attn.head_size, float(attn.scaling)),
            mlp=MLPSpec(gated=False, activation=plain_activation(cfg.hidden_act)),
            norm=self.norm_spec(layer.input_layernorm),
            # parallel: x + attn(ln1(x)) + mlp(ln2(x)); sequential: x1 = x + attn(ln1(x)); x1 + mlp(ln2(x1))
            residual="parallel" if layer.use_parallel_residual else "pre",
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        attn, mlp = layer.attention, layer.mlp
        heads = model.config.num_attention_heads
        has_bias = attn.query_key_value.bias is not None
        return {
            "attn_norm.weight": "input_layernorm.weight",
            "attn_norm.bias": "input_layernorm.bias",
            "mlp_norm.weight": "post_attention_layernorm.weight",
            "mlp_norm.bias": "post_attention_layernorm.bias",
            "attn.qkv.weight": GroupedQKV("attention.query_key_value.weight", heads, 1, attn.head_size),
            "attn.qkv.bias": (
                GroupedQKV("attention.query_key_value.bias", heads, 1, attn.head_size) if has_bias else None
            ),
            "attn.o.weight": "attention.dense.weight",
            "attn.o.bias": "attention.dense.bias" if attn.dense.bias is not None else None,
            "mlp.up.weight": "mlp.dense_h_to_4h.weight",
            "mlp.up.bias": "mlp.dense_h_to_4h.bias" if mlp.dense_h_to_4h.bias is not None else None,
            "mlp.down.weight": "mlp.dense_4h_to_h.weight",
            "mlp.down.bias": "mlp.dense_4h_to_h.bias" if mlp.dense_4h_to_h.bias is not None else None,
        }
