"""Mixture-of-experts policies: mixtral, qwen2_moe (shared expert with a sigmoid gate), qwen3_moe (qk-norm).

Their attention is the llama family's (GQA; qwen2_moe adds a qkv bias, qwen3_moe a qk-norm), so these policies extend
:class:`~hf_dsinfer.policies.llama.LlamaPolicy` and only add the MoE block. transformers 5.x holds each layer's
experts fused in one ``*Experts`` module (``gate_up_proj [E, 2I, C]`` with rows ``[gate; up]``, ``down_proj
[E, C, I]``), whatever layout the checkpoint had (per-expert ``w1/w2/w3`` or ``gate_proj/up_proj/down_proj`` tensors
are converted at load), so the fused block adopts those tensors as they are. Qwen's dense layers
(``mlp_only_layers``, ``decoder_sparse_step``) keep the dense fused MLP.

Routing follows each family's router exactly (see :class:`~hf_dsinfer.modules.moe.MoESpec`): Mixtral renormalises
the top-k probabilities and keeps them in fp32; Qwen renormalises only with ``norm_topk_prob`` and rounds them to the
model dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from .. import hf_compat
from ..modules import LayerSpec
from ..modules.moe import MoESpec
from .base import Cat, Source, register
from .llama import LlamaPolicy, _activation

# Set by hf_dsinfer.parallel.moe on an HF experts module that holds only this rank's experts (expert parallelism,
# whole or split by features inside an expert group: the local feature count comes from the weights' shapes).
_EXPERT_BEGIN_ATTR = "_dsinfer_expert_begin"


def _is_moe_block(mlp: nn.Module) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


class _MoEPolicy(LlamaPolicy):
    """Shared logic: a llama-style layer whose ``mlp`` is a sparse MoE block (``gate`` router + fused ``experts``)."""

    #: Mixtral keeps the routing weights in fp32; Qwen rounds them to the model dtype.
    fp32_routing_weights = False

    def renormalize(self, model: nn.Module) -> bool:
        """Whether the top-k probabilities are divided by their sum."""
        return bool(getattr(model.config, "norm_topk_prob", False))

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        for layer in model.base_model.get_submodule(self.layers_attr):
            mlp = layer.mlp
            if not _is_moe_block(mlp):
                continue
            experts = mlp.experts
            for flag in ("has_bias", "has_post_expert_norm", "is_transposed"):
                if getattr(experts, flag, False):
                    return f"its experts have {flag}=True, which the fused MoE block does not compute"
            if getattr(experts, "has_gate", True) is False or getattr(experts, "is_concatenated", True) is False:
                return "its experts are not gated [gate; up] MLPs"
            if hf_compat.is_expert_parallel(experts) and not hasattr(experts, _EXPERT_BEGIN_ATTR):
                return "its experts were split by transformers' own expert parallelism"
            break
        return super().unsupported(model, max_out_tokens)

    def moe_spec(self, model: nn.Module, idx: int, mlp: nn.Module) -> MoESpec:
        return MoESpec(
            num_experts=int(mlp.gate.num_experts),
            top_k=int(mlp.gate.top_k),
            renormalize=self.renormalize(model),
            fp32_routing_weights=self.fp32_routing_weights,
            activation=_activation(model),
            shared_expert=getattr(mlp, "shared_expert", None) is not None,
            shared_expert_gate=getattr(mlp, "shared_expert_gate", None) is not None,
            expert_begin=int(getattr(mlp.experts, _EXPERT_BEGIN_ATTR, 0)),
        )

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        spec = super().layer_spec(model, idx, layer)
        if not _is_moe_block(layer.mlp):
            return spec  # a dense layer (mlp_only_layers / decoder_sparse_step)
        return dataclasses.replace(spec, moe=self.moe_spec(model, idx, layer.mlp))

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        mlp = layer.mlp
        if not _is_moe_block(mlp):
            return super().weight_map(model, idx, layer)
        attn = layer.self_attn
        has_qkv_bias = attn.q_proj.bias is not None
        wmap: dict[str, Source | str | None] = {
            "attn_norm.weight": "input_layernorm.weight",
            "mlp_norm.weight": "post_attention_layernorm.weight",
            "attn.qkv.weight": Cat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            "attn.qkv.bias": (
                Cat("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias") if has_qkv_bias else None
            ),
            "attn.o.weight": "self_attn.o_proj.weight",
            "attn.o.bias": "self_attn.o_proj.bias" if attn.o_proj.bias is not None else None,
            "attn.q_norm.weight": "self_attn.q_norm.weight" if hasattr(attn, "q_norm") else None,
            "attn.k_norm.weight": "self_attn.k_norm.weight" if hasattr(attn, "k_norm") else None,
            "mlp.router.weight": "mlp.gate.weight",
            "mlp.experts.gate_up": "mlp.experts.gate_up_proj",
            "mlp.experts.down": "mlp.experts.down_proj",
        }
        if getattr(mlp, "shared_expert", None) is not None:
            wmap["mlp.shared.up.weight"] = Cat("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")
            wmap["mlp.shared.down.weight"] = "mlp.shared_expert.down_proj.weight"
        if getattr(mlp, "shared_expert_gate", None) is not None:
            wmap["mlp.shared_gate.weight"] = "mlp.shared_expert_gate.weight"
        return wmap

    def tp_plan(self, model: nn.Module, spec: LayerSpec) -> dict[str, Any]:
        plan = super().tp_plan(model, spec)
        # Experts split like dense MLPs along their intermediate features, or (moe.ep_size > 1) into expert groups
        # first and by features inside each group (see parallel/moe.py); router replicated.
        plan["experts"] = {"column": "mlp.experts.gate_up", "row": "mlp.experts.down", "sections": ("gate", "up")}
        plan["column"] = plan["column"] + ["mlp.shared.up.weight"]
        plan["row"] = plan["row"] + ["mlp.shared.down.weight"]
        plan["replicated"] = plan["replicated"] + ["mlp.router.weight", "mlp.shared_gate.weight"]
        return plan


@register
class MixtralPolicy(_MoEPolicy):
    """mixtral: every layer sparse, top-k renormalised, fp32 routing weights; sliding window from the config."""

    model_types = ("mixtral",)
    hf_classes = ("MixtralForCausalLM", "MixtralModel")
    fp32_routing_weights = True

    def renormalize(self, model: nn.Module) -> bool:
        return True


@register
class Qwen2MoePolicy(_MoEPolicy):
    """qwen2_moe: qkv bias, a shared expert with a sigmoid gate, optional dense layers, per-layer sliding window."""

    model_types = ("qwen2_moe",)
    hf_classes = ("Qwen2MoeForCausalLM", "Qwen2MoeModel")

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        spec = super().layer_spec(model, idx, layer)
        # The window is set on the attention module of sliding layers only; the others attend fully (the llama
        # fallback to config.sliding_window would be wrong for them).
        cfg = model.config
        layer_types = getattr(cfg, "layer_types", None)
        window = getattr(layer.self_attn, "sliding_window", None)
        if layer_types is not None and layer_types[idx] != "sliding_attention":
            window = None
        attention = dataclasses.replace(spec.attention, sliding_window=int(window) if window else None)
        return dataclasses.replace(spec, attention=attention)


@register
class Qwen3MoePolicy(_MoEPolicy):
    """qwen3_moe: qk-norm, no shared expert, optional dense layers."""

    model_types = ("qwen3_moe",)
    hf_classes = ("Qwen3MoeForCausalLM", "Qwen3MoeModel")
