"""GPT-J policy: one shared LayerNorm feeding attention and MLP in parallel (``x + attn(ln(x)) + mlp(ln(x))``),
interleaved ("rotate every two") rotary over the first ``rotary_dim`` dims of each head, no q/k/v/out biases, a plain
MLP with biases and an LM head with a bias.

HF keeps its sin/cos in a per-attention buffer computed from ``10000 ** (-2i / rotary_dim)`` rather than in a rotary
module, so :meth:`GPTJPolicy.rotary_table` computes the same frequencies the same way. HF's eager attention scores
in fp32 (``q k^T / sqrt(D)``), as the fused kernels do.

Kept on HF's modules: activations without a plain fused equivalent.
"""

from __future__ import annotations

import torch
from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec, RotaryTable
from .base import Cat, Policy, Source, register
from .gpt_neox import plain_activation


@register
class GPTJPolicy(Policy):
    """gptj (``GPTJForCausalLM``, ``GPTJModel``) decoder layers on fused kernels."""

    model_types = ("gptj",)
    hf_classes = ("GPTJForCausalLM", "GPTJModel")
    layers_attr = "h"
    embed_attr = "wte"
    final_norm_attr = "ln_f"
    rotary_attr = None  # no rotary module: see rotary_table
    rotary_interleaved = True

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        cfg = model.config
        head_dim = cfg.n_embd // cfg.n_head
        dim = cfg.rotary_dim
        if not 0 < dim <= head_dim or dim % 2:
            return f"rotary_dim={cfg.rotary_dim!r} (the fused layers need an even rotary_dim <= head_dim {head_dim})"
        if plain_activation(cfg.activation_function) is None:
            return f"activation_function={cfg.activation_function!r} has no fused MLP equivalent"
        return None

    def rotary_table(self, model: nn.Module, max_positions: int, dtype: torch.dtype) -> RotaryTable:
        dim = model.config.rotary_dim
        # HF's create_sinusoidal_positions, op for op: integer exponents divided in fp32.
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))  # [R/2]
        return RotaryTable.from_inv_freq(inv_freq, max_positions, round_to=dtype, interleaved=True)

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        cfg, attn = model.config, layer.attn
        return LayerSpec(
            attention=AttentionSpec(
                attn.num_attention_heads, attn.num_attention_heads, attn.head_dim, attn.head_dim**-0.5
            ),
            mlp=MLPSpec(gated=False, activation=plain_activation(cfg.activation_function)),
            norm=self.norm_spec(layer.ln_1),
            residual="parallel",  # no mlp_norm: ln_1 feeds both branches
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        return {
            "attn_norm.weight": "ln_1.weight",
            "attn_norm.bias": "ln_1.bias",
            "attn.qkv.weight": Cat("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"),
            "attn.o.weight": "attn.out_proj.weight",
            "mlp.up.weight": "mlp.fc_in.weight",
            "mlp.up.bias": "mlp.fc_in.bias",
            "mlp.down.weight": "mlp.fc_out.weight",
            "mlp.down.bias": "mlp.fc_out.bias",
        }
