"""Kernel injection: swap an HF model's decoder layers for fused ones, and give plain HF weights back at save."""

from __future__ import annotations

import gc
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..log import logger, warn_once
from ..modules import LINEAR_WEIGHTS, FusedDecoderLayer, FusedNorm, StaticKVCache, gemm_layout, linear_layout
from ..modules.quant_linear import QUANT_SUFFIXES, is_quantized_weight, pack_quantized, release_quantized
from ..modules.weight_arena import drop_file_pages
from .base import Policy, Source, as_source, find_policy, get_submodule_or_none
from .runtime import Runtime
from .tp_layout import TPLayout

INJECTION_ATTR = "_dsinfer_injection"

@dataclass
class Injection:
    """What injection did to a model: its policy, where the layers are, and each layer's weight map."""

    policy: Policy
    layers_prefix: str  # state-dict prefix of the layer list, e.g. "model.layers"
    weight_maps: list[dict[str, Source]]
    runtime: Runtime
    tp_plan: dict[str, Any] = field(default_factory=dict)
    injection_policy: dict[str, list[str]] | None = None


def _unwrap(model: nn.Module) -> nn.Module:
    for m in (model, getattr(model, "module", None), getattr(getattr(model, "base_model", None), "model", None)):
        if m is not None and getattr(m, INJECTION_ATTR, None) is not None:
            return m
    return model


def is_injected(model: nn.Module) -> bool:
    """True when ``model`` (or the model inside an engine / peft wrapper) runs on fused policy layers."""
    return getattr(_unwrap(model), INJECTION_ATTR, None) is not None


def get_injection(model: nn.Module) -> Injection | None:
    """The :class:`Injection` record of ``model``, or None."""
    return getattr(_unwrap(model), INJECTION_ATTR, None)


def _class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def validate_injection_policy(model: nn.Module, injection_policy: dict[str, list[str]]) -> None:
    """Check DeepSpeed's ``injection_policy`` ({layer class: module names}) against ``model``.

    Each key must name a module class present in the model (dotted or bare class name) and every name must select a
    submodule of some instance of that class, by DeepSpeed's rule: its path in the layer is the name or ends with
    ``"." + name`` (T5's ``"SelfAttention.o"``); errors name the class or the missing module.
    """
    instances: dict[str, list[nn.Module]] = {}
    for module in model.modules():
        cls = type(module)
        instances.setdefault(_class_key(cls), []).append(module)
        instances.setdefault(cls.__name__, []).append(module)
    for key, names in injection_policy.items():
        found = instances.get(key)
        if not found:
            classes = sorted({type(m).__name__ for m in model.modules() if "Layer" in type(m).__name__})
            raise ValueError(
                f"injection_policy names the layer class {key!r}, which this {type(model).__name__} does not contain; "
                f"its layer classes are: {', '.join(classes) or '(none)'}."
            )
        layer = found[0]
        paths = {n for m in found for n, _ in m.named_modules() if n}
        for name in names:
            if not any(p == name or p.endswith("." + name) for p in paths):
                children = sorted(n for n, _ in layer.named_modules() if n)
                raise ValueError(
                    f"injection_policy[{key!r}] names module {name!r}, which {type(layer).__name__} does not have; "
                    f"its modules are: {', '.join(children)}."
                )


def _layers_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    for name, module in model.named_modules():
        if module is layers:
            return name
    raise RuntimeError("the decoder layer list is not a submodule of the model")


def _release(layer: nn.Module, names: set[str]) -> None:
    """Free the storage of HF parameters that were copied into packed tensors (the HF layer is dropped anyway)."""
    _free([layer.get_parameter(name) for name in names])


def _free(params: list[nn.Parameter]) -> None:
    """Empty ``params`` (their values live on in copies) and give their file-backed pages back."""
    spans = []
    for p in params:
        if p.device.type == "cpu":
            storage = p.untyped_storage()
            spans.append((storage.data_ptr(), storage.nbytes()))
            del storage
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    drop_file_pages(spans)


def relayout_output_embeddings(
    model: nn.Module, layout: Any = linear_layout, requires_grad: bool | None = False
) -> nn.Parameter | None:
    """Give the LM head's weight the memory layout ``layout(weight)`` returns, tied embedding included.

    Every module holding the head's parameter gets the new one, so a tie holds. ``requires_grad``: the new parameter's
    flag (None: the old one's; a weight already in that layout gets the flag in place). Returns the replaced parameter
    (its storage is the caller's to free), or None when the model has no 2-D head weight or it already has that
    layout.

    Injection and the Hybrid Engine's copy (``hybrid.build.row_major_head``) pass ``linear_layout``: the head is then
    stored as the fused linears are (row-major for fp32 on CPU, HF's own layout, so usually nothing is copied) and
    ``modules.linear.head_forward`` runs it over their paths. ``HF_DSINFER_CPU_GEMV=0`` makes that layout K-major.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    old = getattr(head, "weight", None)
    if not isinstance(old, nn.Parameter) or old.ndim != 2:
        return None
    laid = layout(old)
    if laid is old:
        if requires_grad is not None:
            old.requires_grad_(requires_grad)  # as a replaced parameter would have it (inference: no gradient)
        return None
    new = nn.Parameter(laid, requires_grad=old.requires_grad if requires_grad is None else requires_grad)
    for module in model.modules():  # every name of the tied parameter
        for name, p in module._parameters.items():
            if p is old:
                module._parameters[name] = new
    return old


def inject(model: nn.Module, cfg: Any, tp: TPLayout | None = None) -> nn.Module:
    """Replace ``model``'s decoder layers with fused ones (in place) and return it.

    Models without a policy (or that their policy cannot serve exactly) keep HF's modules, with one warning.
    ``cfg`` is an :class:`~hf_dsinfer.InferenceConfig` (``max_out_tokens``, ``max_batch_size``, ``injection_policy``).
    ``tp``: the model was split by tensor parallelism first; the fused layers take this rank's slices, local head
    counts and all-reduces (see :mod:`.tp_layout`), or the split HF modules stay, with one warning.
    """
    if is_injected(model):
        return model
    injection_policy = getattr(cfg, "injection_policy", None)
    if injection_policy:
        validate_injection_policy(model, injection_policy)
    if getattr(model, "config", None) is None or not hasattr(model, "base_model"):
        # Not a transformers model (DeepSpeed's own tests pass a bare nn.Linear): nothing to fuse, HF-style or not.
        warn_once(
            f"kernel injection: {type(model).__name__} is not a transformers model (it has no config); running its "
            "own modules (output is the module's own)."
        )
        return model
    arch = f"{getattr(model.config, 'model_type', '?')} ({type(model).__name__})"
    policy = find_policy(model)
    if policy is None or not policy.serves(model):
        what = "no kernel-injection policy" if policy is None else f"{type(policy).__name__} has no fused path"
        if policy is None:  # HF's modules (split by AutoTP under TP), attention on the static cache (generic.py)
            from .generic import install_generic

            why_not = install_generic(model, cfg, tp)
            if why_not is None:
                logger.info(f"kernel injection: no policy for {arch}; HF's modules with hf_dsinfer's static-cache "
                            "attention (the generic path)")
                return model
            what += f" and no generic path ({why_not})"
        warn_once(
            f"kernel injection: {what} for architecture {arch}; running HF's own modules for it "
            "(output is HF's)."
        )
        return model
    max_tokens, max_batch = int(cfg.max_out_tokens), int(cfg.max_batch_size)
    reason = policy.unsupported(model, max_tokens)
    if reason:
        warn_once(f"kernel injection: {arch} keeps HF's own modules because {reason}.")
        return model

    base = model.base_model
    layers: nn.ModuleList = base.get_submodule(policy.layers_attr)
    # Read every spec and weight map first: a policy error must leave the model untouched.
    specs, maps = [], []
    with tp.local_config(model) if tp is not None else nullcontext():
        for i, hf_layer in enumerate(layers):
            specs.append(policy.layer_spec(model, i, hf_layer))
            maps.append({k: as_source(v) for k, v in policy.weight_map(model, i, hf_layer).items() if v is not None})
    for i, (hf_layer, wmap) in enumerate(zip(layers, maps)):
        for fused_name, src in wmap.items():
            for n in src.names():
                try:
                    hf_layer.get_parameter(n)
                except AttributeError as e:
                    if is_quantized_weight(hf_layer, n):
                        continue  # a QuantLinear's buffer (weight-only quantization)
                    raise ValueError(
                        f"{type(policy).__name__}.weight_map: {fused_name!r} reads {n!r}, which layer {i} "
                        f"({type(hf_layer).__name__}) does not have"
                    ) from e
    prefix = _layers_prefix(model, layers)
    if tp is not None:
        reason = tp.check(prefix, layers, specs, maps)
        if reason:
            warn_once(
                f"kernel injection with tensor parallelism: {arch} keeps HF's modules split by AutoTP "
                f"(output is HF's) because {reason}."
            )
            return model
    # Allocated before any layer is replaced: an absurd max_out_tokens must fail with the model untouched.
    dtype = next(p.dtype for p in layers[0].parameters() if p.is_floating_point())
    rotary = policy.rotary_table(model, max_tokens, dtype)

    for i, hf_layer in enumerate(layers):
        params: dict[str, nn.Parameter] = {}
        copied: set[str] = set()
        shared: set[str] = set()
        quantized: list[nn.Module] = []
        for fused_name, src in maps[i].items():
            if fused_name in LINEAR_WEIGHTS:
                qlinear = pack_quantized(src, hf_layer)  # None: float weights
                if qlinear is not None:
                    params[fused_name] = qlinear
                    if not src.shares():
                        quantized += [hf_layer.get_submodule(n.rpartition(".")[0]) for n in src.names()]
                    continue
            packed = src.pack(hf_layer.get_parameter)
            if fused_name in LINEAR_WEIGHTS:
                # Decoders: the layout of Linear's decode GEMV (row-major); encoders never decode, and their
                # many-row GEMMs read the K-major layout a few percent faster (docs/performance.md).
                tensor = linear_layout(packed) if specs[i].attention.causal else gemm_layout(packed)
            else:
                tensor = packed
            owned = tensor is not packed  # a copy (CPU fp32), so even a shared HF weight can be freed
            if isinstance(tensor, nn.Parameter):
                params[fused_name] = tensor
            else:
                params[fused_name] = nn.Parameter(tensor, requires_grad=False)
            (shared if src.shares() and not owned else copied).update(src.names())
        layers[i] = FusedDecoderLayer.from_params(specs[i], i, params, tp.reduce if tp is not None else None)
        _release(hf_layer, copied - shared)  # one layer at a time: peak memory grows by one layer, not a model
        release_quantized(quantized)
        del hf_layer, params

    final_norm = None
    hf_norm = get_submodule_or_none(base, policy.final_norm_attr)  # None too when the model has none (post-norm opt)
    if hf_norm is not None:
        final_norm = FusedNorm(policy.norm_spec(hf_norm), hf_norm.weight, getattr(hf_norm, "bias", None))
        parent, _, attr = policy.final_norm_attr.rpartition(".")
        # same parameter names: the state dict keeps its keys
        setattr(base.get_submodule(parent) if parent else base, attr, final_norm)

    # The head keeps the fused linears' layout (row-major for fp32 on CPU, as HF stores it: nothing to copy), so its
    # decode GEMV streams rows like theirs and a tied embedding gathers contiguous rows (modules/linear.py).
    replaced = relayout_output_embeddings(model)
    if replaced is not None:
        _free([replaced])
    cache = StaticKVCache(
        [s.attention.num_kv_heads for s in specs], [s.attention.head_dim for s in specs], max_tokens, max_batch
    )
    runtime = Runtime(policy, layers, final_norm, rotary, cache)
    record = Injection(policy, prefix, maps, runtime, injection_policy=injection_policy)
    record.tp_plan = policy.tp_plan(model, specs[0])
    setattr(model, INJECTION_ATTR, record)
    policy.install_forward(model, runtime)
    gc.collect()  # drop the replaced HF layers now, not at some later collection
    return model


def hf_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The state dict of an injected model in plain HF layout (packed tensors split back under HF names)."""
    target = _unwrap(model)
    record = get_injection(target)
    sd = dict(target.state_dict() if state_dict is None else state_dict)
    if record is None:
        return sd
    for i, wmap in enumerate(record.weight_maps):
        for fused_name, src in wmap.items():
            key = f"{record.layers_prefix}.{i}.{fused_name}"
            if key not in sd:
                raise KeyError(f"state dict of the injected model lacks {key!r}")
            for hf_name, tensor in src.unpack(sd.pop(key)).items():
                sd[f"{record.layers_prefix}.{i}.{hf_name}"] = tensor
            for suffix in QUANT_SUFFIXES:  # a quantized linear's scales/zeros split along the same rows
                if key + suffix in sd:
                    for hf_name, tensor in src.unpack(sd.pop(key + suffix)).items():
                        sd[f"{record.layers_prefix}.{i}.{hf_name}{suffix}"] = tensor
    return _row_major(sd)


def _row_major(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with every tensor in plain row-major layout, tied tensors still sharing one copy.

    The CPU K-major layout (``modules.gemm_layout``) is a transposed view; transformers' tied-weight detection
    (``remove_tied_weights_from_state_dict``) flattens shared tensors with ``view(-1)``, which such a view refuses,
    and safetensors writes row-major tensors anyway. Names that held the same tensor (a tied LM head and input
    embedding) get the same copy, so transformers still sees them as tied and writes the weight once.
    """
    copies: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, t in sd.items():
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if key not in copies:
                copies[key] = t.contiguous()
            t = copies[key]
        out[name] = t
    return out
