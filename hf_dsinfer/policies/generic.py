"""The generic path: hf_dsinfer's static KV cache and decode loop for architectures that have no policy.

A decoder whose attention modules call transformers' ``AttentionInterface`` (``_supports_attention_backend``) keeps
all of HF's own modules (embeddings, norms, rotary, MLPs, q/k projections) and gets one thing swapped: the attention
function. hf_dsinfer registers ``"hf_dsinfer_static"`` with transformers' ``AttentionInterface`` (and the matching
``AttentionMaskInterface`` entry: without one, transformers builds no mask and padded batches would attend padding on
HF's own paths). While hf_dsinfer runs a step, the function receives the step's :class:`~hf_dsinfer.modules.
StepContext` through the keyword arguments HF forwards to attention, writes the new keys and values into the static
cache and attends with hf_dsinfer's prefill / decode attention (left padding from the context, no mask needed).
Called without a context (e.g. a direct call of a module), it is transformers' SDPA attention with HF's mask.

So the model gets the static cache, the fast generate loop, the compiled CPU decode step and (on CUDA) graph
capture of the decode step, with HF's modules doing everything but attention. Logits post-processing in the causal
LM's forward is redone for the fast loop: final soft-capping (gemma), ``logits_scaling`` (granite), ``logit_scale``
(cohere); a forward that does anything else to the logits keeps HF's path.

Under tensor parallelism (:func:`install_generic` with a :class:`~.tp_layout.TPLayout`) the HF modules are the ones
AutoTP split: each rank's attention modules hold its heads (their ``num_heads`` / ``num_key_value_groups`` already
local, row-parallel output projections all-reducing, full-width q/k norms summing their statistics over the ranks),
so the attention function receives this rank's q and kv heads and needs nothing else: it reads the head counts from
the tensors, and the sliding window and scaling from HF's module, neither of which depends on the split. The static
cache is sized with the rank's kv heads (``TPLayout.config``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_dsinfer.kernels import decode_attention, prefill_attention, store_kv

from .. import hf_compat
from ..modules import StaticKVCache, StepContext
from ..modules.attention import AttentionSpec, _sync_free_attend
from .base import Policy
from .runtime import Runtime, install_causal_lm_forward

IMPLEMENTATION = "hf_dsinfer_static"
STEP_KWARG = "dsinfer_step"  # how the step context reaches the attention function (HF forwards **kwargs to it)
GENERIC_ATTR = "_dsinfer_generic"

_PROBE: list[int] | None = None  # layer indices seen by the attention function during the install-time check


def static_cache_attention(
    module: nn.Module,
    query: torch.Tensor,  # [B, Hq, T, D], rotary applied by HF's module
    key: torch.Tensor,  # [B, Hk, T, D]
    value: torch.Tensor,  # [B, Hk, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: ``[B, T, Hq, D]`` attention output (and no weights)."""
    ctx: StepContext | None = kwargs.pop(STEP_KWARG, None)
    if ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if _PROBE is not None:
        _PROBE.append(module.layer_idx)
    B, Hq, T, D = query.shape
    Hk = key.shape[1]
    scale = scaling if scaling is not None else D**-0.5
    spec = AttentionSpec(Hq, Hk, D, scale, sliding_window=sliding_window, softcap=softcap)
    q = query.transpose(1, 2)  # [B, T, Hq, D]
    k = key.transpose(1, 2).contiguous()  # [B, T, Hk, D]
    v = value.transpose(1, 2).contiguous()
    k_cache, v_cache = ctx.cache.layer(module.layer_idx)  # [Bmax, Hk, S, D]
    if ctx.attend_len is not None:  # compiled CPU step: store and attend without host syncs
        return _sync_free_attend(q, k, v, k_cache, v_cache, ctx, spec), None  # [B, T, Hq, D]
    store_kv(k, v, k_cache, v_cache, ctx.cache_lens, ctx.start)
    if ctx.decode:
        out = decode_attention(
            q[:, 0].contiguous(), k_cache, v_cache, ctx.seq_lens, scale, sliding_window=sliding_window, softcap=softcap
        )  # [B, Hq, D]
        return out[:, None], None
    out = prefill_attention(
        q.contiguous(), k_cache, v_cache, ctx.cache_lens, ctx.start, scale, sliding_window=sliding_window,
        softcap=softcap,
    )  # fmt: skip
    return out, None  # [B, T, Hq, D]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, static_cache_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # HF's own paths (no step context) need the mask


_register()


@dataclass
class GenericRecord:
    """What the generic path installed on a model (``runtime`` is what the generate loop needs)."""

    runtime: Runtime
    previous_attn_implementation: str


class GenericPolicy:
    """The few policy hooks :class:`~.runtime.Runtime` and the decode step call, for a model on HF's modules."""

    def __init__(self, model: nn.Module):
        config = model.config.get_text_config()
        src = _forward_source(model)
        self.softcap = getattr(config, "final_logit_softcapping", None) if "softcapping" in src else None
        self.divide = getattr(config, "logits_scaling", None) if "logits_scaling" in src else None
        self.multiply = getattr(config, "logit_scale", None) if "logit_scale" in src else None

    def embed(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[B, T, C]`` from HF's embedding module (scaled embeddings scale themselves)."""
        return model.get_input_embeddings()(input_ids)

    def embed_inputs(self, model: nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return inputs_embeds

    def finalize_hidden(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # HF's base forward applied the final norm already

    default_position_ids = Policy.default_position_ids  # HF's decoder default: past + arange(T)

    def finalize_logits(self, model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        """What the causal LM's forward does to ``logits [..., V]`` after the LM head."""
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class GenericRuntime(Runtime):
    """A :class:`~.runtime.Runtime` whose "layers" are HF's base model forward, attention through the static cache."""

    def __init__(self, policy: GenericPolicy, layers: nn.ModuleList, cache: StaticKVCache, base_forward: Any):
        super().__init__(policy, layers, None, None, cache)
        self.base_forward = base_forward  # the base model class's own forward (the instance's is replaced)

    def run_layers(self, model: nn.Module, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """HF's base forward on ``hidden [B, T, C]`` at ``ctx.positions``, attention on the static cache."""
        base = model.base_model
        B, T = hidden.shape[:2]
        out = self.base_forward(
            base, inputs_embeds=hidden, position_ids=ctx.positions.view(B, T), attention_mask=None, use_cache=False,
            **{STEP_KWARG: ctx},
        )  # fmt: skip
        return out[0]  # [B, T, C] after HF's final norm


def _forward_source(model: nn.Module) -> str:
    try:
        return inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return ""


# Lines of a causal LM forward that change the logits and that GenericPolicy.finalize_logits repeats.
_KNOWN_LOGIT_STEPS = ("softcapping", "logits_scaling", "logit_scale", "torch.tanh(logits)", "logits.float()")


def generic_path_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the generic path (None: it can)."""
    config = getattr(model, "config", None)
    if config is None or not hf_compat.supports_attention_backend(type(model)):
        return "its attention modules do not call transformers' AttentionInterface"
    if getattr(config, "is_encoder_decoder", False) or not model.can_generate():
        return "it is not a decoder-only generative model"
    if model.get_output_embeddings() is None:
        return "it has no LM head"
    text = config.get_text_config()
    if text is not config or getattr(model, "base_model", model) is model:
        return "it is not a plain *ForCausalLM with a text config"
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "its attention soft-caps scores (HF's SDPA fallback would not)"
    chosen = hf_compat.attn_implementation(config) or "sdpa"
    if chosen not in ("sdpa", "eager"):
        return f"attn_implementation={chosen!r} was chosen"
    if any(getattr(text, key, None) is None for key in ("num_hidden_layers", "num_attention_heads")):
        return "its config does not give the layer and head counts"
    for line in _forward_source(model).splitlines():
        line = line.strip()
        if line.startswith("logits =") and "lm_head" not in line and not any(k in line for k in _KNOWN_LOGIT_STEPS):
            return f"its forward post-processes the logits in a way the fast loop does not repeat ({line})"
    return None


def _cache_for(model: nn.Module, max_tokens: int, max_batch: int, local: Any = None) -> StaticKVCache:
    """The static cache: one layer per hidden layer, ``local`` (a config with this rank's head counts under tensor
    parallelism) giving the kv heads; the head dim is the model's own (the split keeps it)."""
    text = model.config.get_text_config()
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    counts = (local if local is not None else model.config).get_text_config()
    kv = getattr(counts, "num_key_value_heads", None) or counts.num_attention_heads
    return StaticKVCache([kv] * layers, [head_dim] * layers, max_tokens, max_batch)


def _module_configs(model: nn.Module) -> list[Any]:
    """Configs that single modules hold apart from the model's (AutoTP's copies with this rank's head counts, for
    attention forwards that read ``config.num_attention_heads``): they need the attention implementation too."""
    own = {id(model.config), id(model.config.get_text_config())}
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in own and hf_compat.has_attn_implementation(config):
            found[id(config)] = config
    return list(found.values())


def install_generic(model: nn.Module, cfg: Any, tp: Any = None) -> str | None:
    """Put ``model`` on the generic path (in place). Returns None when installed, else why not (nothing changed).

    ``tp``: the model's :class:`~.tp_layout.TPLayout` when tensor parallelism split it (every rank calls this at the
    same point: the trial step below all-reduces).
    """
    global _PROBE
    reason = generic_path_reason(model)
    if reason:
        return reason
    if tp is not None and tp.config is None:
        return "its layers keep different head counts on this rank (the static cache needs one count)"
    base = model.base_model
    layers = next((m for m in base.modules() if isinstance(m, nn.ModuleList)), None)
    if layers is None:
        return "it has no layer list"
    previous = hf_compat.attn_implementation(model.config)
    cache = _cache_for(model, int(cfg.max_out_tokens), int(cfg.max_batch_size), tp.config if tp is not None else None)
    runtime = GenericRuntime(GenericPolicy(model), layers, cache, type(base).forward)
    copies = [(c, hf_compat.attn_implementation(c)) for c in _module_configs(model)]
    model.set_attn_implementation(IMPLEMENTATION)
    for config, _ in copies:
        hf_compat.set_config_attn_implementation(config, IMPLEMENTATION)
    # One 2-token forward proves every layer's attention reached the function with the step context (a model that
    # does not forward HF's **kwargs to attention would silently attend without the cache).
    _PROBE = []
    try:
        ids = torch.tensor([[1, 2]], device=model.get_input_embeddings().weight.device)
        with torch.no_grad():
            runtime.run(base, ids, None, None, None, None, {})
        seen = sorted(set(_PROBE))
    except Exception as e:  # noqa: BLE001 - any failure: this model keeps HF's path
        seen = None
        reason = f"a trial step failed ({type(e).__name__}: {e})"
    finally:
        _PROBE = None
        runtime.cache.release()
    if seen is not None and seen != list(range(len(runtime.cache.kv_heads))):
        reason = f"its attention modules did not all receive hf_dsinfer's step (layer indices seen: {seen})"
    if reason:
        model.set_attn_implementation(previous)
        for config, implementation in copies:
            hf_compat.set_config_attn_implementation(config, implementation)
        return reason
    install_causal_lm_forward(model, runtime)
    setattr(model, GENERIC_ATTR, GenericRecord(runtime, previous))
    return None


def get_generic(model: nn.Module) -> GenericRecord | None:
    """The generic-path record of ``model``, or None."""
    return getattr(model, GENERIC_ATTR, None)


def inference_path(model_type: str) -> str:
    """The path a causal LM of ``model_type`` takes by default, for docs tables: ``"fused"`` (a kernel-injection
    policy), ``"generic"`` (HF's modules, static-cache attention; still checked per model at load) or ``"hf"``."""
    from . import POLICIES

    if model_type in POLICIES:
        return "fused"
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return "generic" if cls is not None and hf_compat.supports_attention_backend(cls) else "hf"
