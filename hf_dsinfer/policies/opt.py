"""OPT policy: LayerNorm (with bias) decoder with learned positions, separate q/k/v with bias, plain ReLU MLP.

* Positions: OPT's learned table is indexed with ``position + 2`` and, when the caller gives no ``position_ids``,
  positions come from the attention mask (``cumsum(mask) - 1``), so a left-padded row starts at 0 like a single
  prompt. :meth:`OPTPolicy.default_position_ids` reproduces that rule; the offset stays inside HF's own
  ``embed_positions`` module, which :meth:`OPTPolicy.embed_inputs` calls with explicit positions.
* ``do_layer_norm_before=False`` (opt-350m) is the post-norm layer (``ln(x + attn(x))``, ``ln(x + mlp(x))``) with no
  final norm; True is pre-norm with ``decoder.final_layer_norm``.
* ``word_embed_proj_dim != hidden_size`` (opt-350m): ``project_in`` after the token embedding and ``project_out``
  after the final norm, both HF modules called as they are.
* HF multiplies q by ``head_dim ** -0.5`` (rounded to the model dtype) before the dot product; the kernels scale
  the fp32 scores instead: the same in fp32, one rounding of q apart in half precision (none when the scale is a
  power of two, e.g. head_dim 16 or 64), well inside the bf16 tolerance.

Kept on HF's modules (one warning): ``layer_norm_elementwise_affine=False`` (norms without weights) and
activations without an exact fused equivalent.
"""

from __future__ import annotations

import torch
from torch import nn

from ..modules import AttentionSpec, LayerSpec, MLPSpec
from .base import Cat, Policy, Source, register
from .gpt_neox import plain_activation


@register
class OPTPolicy(Policy):
    """opt (``OPTForCausalLM`` and the bare ``OPTModel``) on fused layers."""

    model_types = ("opt",)
    hf_classes = ("OPTForCausalLM", "OPTModel")
    layers_attr = "decoder.layers"
    embed_attr = "decoder.embed_tokens"
    final_norm_attr = "decoder.final_layer_norm"  # None in post-norm models: injection then skips it
    rotary_attr = None

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        cfg = model.config
        if not getattr(cfg, "layer_norm_elementwise_affine", True):
            return "layer_norm_elementwise_affine=False (LayerNorms without weights) has no fused norm"
        if plain_activation(cfg.activation_function) is None:
            return f"activation_function={cfg.activation_function!r} has no fused MLP equivalent"
        return None

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        attn = layer.self_attn
        return LayerSpec(
            attention=AttentionSpec(attn.num_heads, attn.num_heads, attn.head_dim, float(attn.scaling), rotary=False),
            mlp=MLPSpec(gated=False, activation=plain_activation(model.config.activation_function)),
            norm=self.norm_spec(layer.self_attn_layer_norm),
            residual="pre" if layer.do_layer_norm_before else "post",
        )

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        bias = layer.self_attn.q_proj.bias is not None  # config.enable_bias: every projection alike
        return {
            "attn_norm.weight": "self_attn_layer_norm.weight",
            "attn_norm.bias": "self_attn_layer_norm.bias",
            "mlp_norm.weight": "final_layer_norm.weight",
            "mlp_norm.bias": "final_layer_norm.bias",
            "attn.qkv.weight": Cat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            "attn.qkv.bias": (
                Cat("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias") if bias else None
            ),
            "attn.o.weight": "self_attn.out_proj.weight",
            "attn.o.bias": "self_attn.out_proj.bias" if bias else None,
            "mlp.up.weight": "fc1.weight",
            "mlp.up.bias": "fc1.bias" if bias else None,
            "mlp.down.weight": "fc2.weight",
            "mlp.down.bias": "fc2.bias" if bias else None,
        }

    def default_position_ids(
        self, attention_mask: torch.Tensor | None, past: int, batch: int, width: int, device: torch.device
    ) -> torch.Tensor:
        """OPT's rule: the position of a token is the number of real tokens before it (``cumsum(mask) - 1``)."""
        if attention_mask is None:
            return super().default_position_ids(attention_mask, past, batch, width, device)
        mask = attention_mask.to(device).long()  # [B, past + T]
        pos = (mask.cumsum(-1) - 1)[:, past:]  # [B, T]
        # Padding tokens get -1 from HF's rule; they never reach attention, so any in-range value will do.
        return pos.clamp_min(0)

    def embed(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_inputs(model, model.base_model.decoder.embed_tokens(input_ids), position_ids)

    def embed_inputs(self, model: nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        decoder = model.base_model.decoder
        # HF's module adds its offset of 2 itself when given explicit positions (the mask argument is then unused).
        pos = decoder.embed_positions(None, 0, position_ids=position_ids)  # [B, T, C]
        if decoder.project_in is not None:  # word_embed_proj_dim -> hidden_size
            inputs_embeds = decoder.project_in(inputs_embeds)
        return inputs_embeds + pos.to(inputs_embeds.device)

    def finalize_hidden(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        project_out = model.base_model.decoder.project_out
        return hidden if project_out is None else project_out(hidden)  # hidden_size -> word_embed_proj_dim
