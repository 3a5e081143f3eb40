"""DeepSpeed's ``quant`` inference section (weight-only int8 / int4), parsed and checked.

Accepted forms (DeepSpeed's names)::

    quant={"enabled": True, "weight": {"num_bits": 8 | 4, "q_groups": G, "q_type": "symmetric" | "asymmetric",
                                       "lm_head": False}}
    dtype="int8"          # the same as quant={"enabled": True, "weight": {"num_bits": 8}}

DeepSpeed's ``activation`` and ``qkv`` sections load at DeepSpeed's defaults (which enable them, unread by DeepSpeed's
engine) or disabled; activation quantization asked for beyond those defaults is refused by name.

``q_groups`` is DeepSpeed's "groups per output row" (each row of ``K`` inputs is cut into ``G`` groups of
``ceil(K / G)`` columns); ``group_size`` (ours) gives the columns per group directly. Defaults: int8 per channel
(one group per row), int4 groups of 128 columns (clamped to the row length). ``lm_head``: also quantize the LM head
(default False: the head and the embeddings stay in the activation dtype; a head tied to the input embedding is
quantized once and the embedding gathers rows of the same integers); ``lm_head_bits=8`` under ``num_bits=4``: the
head in int8 per channel (llama.cpp's Q4 files keep it at 8 bits too). The parsed section is a plain,
JSON-serializable dict (it is written to config.json with the rest of the inference config).

The second half applies it: :func:`swap_placeholders` (before transformers loads the weights: quantized placeholders
on the meta device), :class:`QuantizeOnLoad` (transformers' per-tensor quantize op: each checkpoint tensor is
quantized as soon as it is read, so no float copy of the model exists), :func:`quantize_model_` (a built model, or
a tensor-parallel slice right after it is read) and :func:`finalize_quantized` (after loading).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..log import warn_once
from .quant_calibration import calibrate, damp_of, refuse_calibration
from .quant_head import head_is_tied, is_head, quantize_tied_head

if TYPE_CHECKING:  # the config half stays light (imported with InferenceConfig); the model half imports lazily
    import torch
    from torch import nn

    from hf_dsinfer.kernels.quant_format import QuantSpec

    from ..modules.quant_linear import QuantLinear

INT4_DEFAULT_GROUP = 128
_TOP_KEYS = ("enabled", "weight", "activation", "qkv")
_WEIGHT_KEYS = ("enabled", "num_bits", "q_groups", "group_size", "q_type", "zero_point", "lm_head", "lm_head_bits",
                "calibration", "quantized_initialization", "post_init_quant")  # fmt: skip
_ZERO_POINTS = ("integer", "float")
_Q_TYPES = {"symmetric": True, "asymmetric": False}
# DeepSpeed's ``quant.activation`` / ``quant.qkv`` sections and their defaults (DeepSpeed 0.16.5). DeepSpeed fills them
# in (enabled=True) but its engine never reads them; a section holding only these values is accepted with one info
# line, any other value asks for activation quantization, which is refused by name.
_DS_ACTIVATION_DEFAULTS = {"enabled": True, "num_bits": 8, "q_type": "symmetric", "q_groups": 1}
_DS_QKV_DEFAULTS = {"enabled": True}


def _check_keys(section: Mapping[str, Any], valid: tuple[str, ...], where: str) -> None:
    for key in section:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"Unknown {where} key {key!r}.{hint} Valid keys: {', '.join(valid)}.")


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be an integer >= 1, got {value!r}.")
    return value


@dataclass(frozen=True)
class QuantSettings:
    """The parsed ``quant`` section: how every quantized linear is stored.

    Exactly one of ``group_size`` / ``q_groups`` is set (per-channel int8 is ``q_groups=1``). ``calibration``: the
    normalized ``quant.weight.calibration`` (GPTQ, see ``quant_calibration.py``), None for round to nearest.
    """

    num_bits: int
    symmetric: bool = True
    group_size: int | None = None
    q_groups: int | None = None
    lm_head: bool = False
    calibration: dict[str, Any] | None = None
    float_zero: bool = False  # quant.weight.zero_point="float" (asymmetric only)
    lm_head_bits: int | None = None  # quant.weight.lm_head_bits: 8 under num_bits=4 (None: the body's num_bits)

    def spec_for(self, in_features: int, head: bool = False) -> QuantSpec:
        """The :class:`QuantSpec` of a linear with ``in_features`` inputs (group size clamped to the row); ``head``:
        the LM head's (int8 symmetric per channel when ``lm_head_bits=8`` under an int4 body)."""
        from hf_dsinfer.kernels.quant_format import QuantSpec

        if head and self.lm_head_bits is not None and self.lm_head_bits != self.num_bits:
            return QuantSpec(self.lm_head_bits, in_features, True)
        if self.group_size is not None:
            group = min(self.group_size, in_features)
        else:
            group = -(-in_features // self.q_groups)  # ceil: G groups per row, the last may be shorter
        return QuantSpec(self.num_bits, max(group, 1), self.symmetric, self.float_zero)

    def to_dict(self) -> dict[str, Any]:
        """The normalized ``quant`` section (JSON-serializable, DeepSpeed's layout)."""
        weight: dict[str, Any] = {
            "num_bits": self.num_bits,
            "q_type": "symmetric" if self.symmetric else "asymmetric",
            "lm_head": self.lm_head,
        }
        if self.float_zero:
            weight["zero_point"] = "float"
        if self.lm_head_bits is not None:
            weight["lm_head_bits"] = self.lm_head_bits
        if self.group_size is not None:
            weight["group_size"] = self.group_size
        else:
            weight["q_groups"] = self.q_groups
        if self.calibration is not None:
            weight["calibration"] = dict(self.calibration)
        return {"enabled": True, "weight": weight}

    def describe(self) -> str:
        """Short human description, e.g. ``int4 asymmetric, groups of 128``."""
        kind = "symmetric" if self.symmetric else "asymmetric" + (" (float zero point)" if self.float_zero else "")
        groups = (
            f"groups of {self.group_size}"
            if self.group_size is not None
            else ("per channel" if self.q_groups == 1 else f"{self.q_groups} groups per row")
        )
        method = ", GPTQ-calibrated" if self.calibration is not None else ""
        return f"int{self.num_bits} {kind}, {groups}{method}"


def parse_quant(value: Any) -> QuantSettings | None:
    """Parse DeepSpeed's ``quant`` section; ``None``, ``False``, ``{}`` or ``enabled=False`` mean no quantization.

    Errors name the key and the fix.
    """
    if value in (None, False) or (isinstance(value, Mapping) and not value):
        return None
    if isinstance(value, QuantSettings):
        return value
    if value is True:
        value = {"enabled": True}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"quant must be a dict such as {{'enabled': True, 'weight': {{'num_bits': 8}}}}, got {value!r}."
        )
    _check_keys(value, _TOP_KEYS, "quant")
    enabled = value.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ValueError(f"quant.enabled must be True or False, got {enabled!r}.")
    if not enabled:
        return None
    _check_unread_section(value.get("activation"), "activation", _DS_ACTIVATION_DEFAULTS)
    _check_unread_section(value.get("qkv"), "qkv", _DS_QKV_DEFAULTS)
    weight = value.get("weight") or {}
    if not isinstance(weight, Mapping):
        raise ValueError(f"quant.weight must be a dict such as {{'num_bits': 4, 'q_groups': 1}}, got {weight!r}.")
    _check_keys(weight, _WEIGHT_KEYS, "quant.weight")
    if weight.get("enabled", True) is False:
        return None
    bits = weight.get("num_bits", 8)
    if bits not in (4, 8) or isinstance(bits, bool):
        raise ValueError(f"quant.weight.num_bits must be 8 or 4, got {bits!r}.")
    q_type = weight.get("q_type", "symmetric")
    if q_type not in _Q_TYPES:
        raise ValueError(f"quant.weight.q_type must be 'symmetric' or 'asymmetric', got {q_type!r}.")
    zero_point = weight.get("zero_point", "integer")
    if zero_point not in _ZERO_POINTS:
        raise ValueError(f"quant.weight.zero_point must be 'integer' or 'float', got {zero_point!r}.")
    if zero_point == "float" and q_type != "asymmetric":
        raise ValueError(
            "quant.weight.zero_point='float' needs quant.weight.q_type='asymmetric' (a symmetric grid has no zero "
            "point); set q_type='asymmetric' or drop zero_point."
        )
    lm_head = weight.get("lm_head", False)
    if not isinstance(lm_head, bool):
        raise ValueError(f"quant.weight.lm_head must be True or False, got {lm_head!r}.")
    lm_head_bits = weight.get("lm_head_bits")
    if lm_head_bits is not None and (lm_head_bits not in (bits, 8) or isinstance(lm_head_bits, bool) or not lm_head):
        raise ValueError(
            f"quant.weight.lm_head_bits={lm_head_bits!r}: it takes 8 (an int8 per-channel head under an int4 body) "
            "or num_bits, and needs quant.weight.lm_head=True; set lm_head=True, or drop lm_head_bits."
        )
    for key in ("quantized_initialization", "post_init_quant"):
        if weight.get(key) not in (None, {}):
            raise ValueError(
                f"quant.weight.{key} is DeepSpeed's ZeRO-time quantization, not supported here; remove it (weights are "
                "quantized while the checkpoint loads)."
            )
    group_size, q_groups = weight.get("group_size"), weight.get("q_groups")
    if group_size is not None and q_groups is not None:
        raise ValueError(
            f"quant.weight.group_size={group_size!r} and quant.weight.q_groups={q_groups!r} both set the grouping "
            "(columns per group vs groups per row); pass only one of them."
        )
    if group_size is not None:
        group_size = _positive_int(group_size, "quant.weight.group_size")
    elif q_groups is not None:
        q_groups = _positive_int(q_groups, "quant.weight.q_groups")
    elif bits == 4:
        group_size = INT4_DEFAULT_GROUP
    else:
        q_groups = 1  # int8: per channel
    from .quant_calibration import parse_calibration

    calibration = parse_calibration(weight.get("calibration"))
    return QuantSettings(bits, _Q_TYPES[q_type], group_size, q_groups, lm_head, calibration, zero_point == "float",
                         lm_head_bits)  # fmt: skip


def _check_unread_section(sub: Any, key: str, defaults: dict[str, Any]) -> None:
    """Accept DeepSpeed's ``quant.<key>`` section at its defaults (or disabled): DeepSpeed's engine never reads it
    either. Refuse any other value by name: activation quantization is not implemented (weights only)."""
    from .config_compat import log_no_effect

    if sub in (None, False) or (isinstance(sub, Mapping) and not sub):
        return
    if sub is True:
        sub = {"enabled": True}
    if not isinstance(sub, Mapping):
        raise ValueError(f"quant.{key} must be a dict such as {defaults!r}, got {sub!r}.")
    _check_keys(sub, tuple(defaults), f"quant.{key}")
    if sub.get("enabled", True) is False:
        return
    changed = {k: v for k, v in sub.items() if v != defaults[k]}
    if changed:
        name, val = next(iter(changed.items()))
        raise ValueError(
            f"quant.{key}.{name}={val!r}: {key} quantization is not supported, only weight-only quantization "
            f"(activations stay in the model's dtype; DeepSpeed's engine does not read quant.{key} either). Remove "
            f"quant.{key}, or keep DeepSpeed's defaults {defaults!r}, or set quant.{key}.enabled=False."
        )
    log_no_effect(
        f"quant.{key}",
        f"DeepSpeed's default section (enabled) that its engine never reads; {key} values stay in the model's dtype",
    )


def merge_int8_dtype(values: dict[str, Any]) -> dict[str, Any]:
    """Turn ``dtype="int8"`` (DeepSpeed's int8 inference) into ``dtype="auto"`` plus an int8 ``quant`` section.

    ``values``: the canonical InferenceConfig keys. A ``quant`` section that asks for other bits is a conflict.
    """
    import torch

    dtype = values.get("dtype")
    if not (dtype is torch.int8 or (isinstance(dtype, str) and dtype.strip().lower() in ("int8", "torch.int8"))):
        return values
    out = dict(values)
    out["dtype"] = "auto"  # activations: the checkpoint's dtype (fp32 on CPU for fp16 ones; half on GPU)
    quant = parse_quant(values.get("quant"))
    if quant is None:
        out["quant"] = QuantSettings(8, q_groups=1).to_dict()
    elif quant.num_bits != 8:
        raise ValueError(
            f"dtype='int8' and quant.weight.num_bits={quant.num_bits} disagree; drop dtype='int8' (set the activation "
            "dtype instead) or use num_bits=8."
        )
    return out


def normalize_quant(value: Any) -> dict[str, Any] | None:
    """The stored form of a ``quant`` value: the normalized dict, or None when quantization is off."""
    settings = parse_quant(value)
    return None if settings is None else settings.to_dict()


# ---------------------------------------------------------------------------------------------------------------------
# Applying the section to a model
# ---------------------------------------------------------------------------------------------------------------------


def resolve_load_quant(cfg: Any) -> QuantSettings | None:
    """The quantization of this load: the config's, checked against the checkpoint's (a saved quantized model).

    A quantized checkpoint keeps its own settings; a config that asks for different ones is refused (re-quantizing
    quantized weights would only add error). A config without ``quant`` adopts the checkpoint's (written back to
    ``cfg.quant`` so the model reports it).
    """
    wanted, stored = cfg.quant_settings, getattr(cfg, "_checkpoint_quant", None)
    if stored is None:
        advise_calibration(wanted)
        return wanted
    if wanted is None:
        cfg.quant = stored.to_dict()
        return stored
    if wanted != stored:
        raise ValueError(
            f"the checkpoint holds weights quantized as {stored.describe()} but the inference config asks for "
            f"{wanted.describe()}; drop `quant` from the config (the checkpoint's settings are used) or load the "
            "original float checkpoint to quantize it differently."
        )
    return stored


def advise_calibration(settings: QuantSettings | None) -> None:
    """Warn once when float weights are about to be rounded to int4 without calibration: on trained models that costs
    far more than int8 (measured in docs/quantization.md), and GPTQ is one setting away."""
    if settings is None or settings.num_bits != 4 or settings.calibration is not None:
        return
    warn_once(
        "quant: int4 rounded to nearest costs trained models much quality (SmolLM2-135M: +58% perplexity symmetric, "
        "+28% asymmetric); quant.weight.calibration='gptq' with q_type='asymmetric' kept it within +5% "
        "(docs/quantization.md). Set it when the model's tokenizer is in its folder."
    )


def _targets(model: nn.Module, settings: QuantSettings) -> list[tuple[str, nn.Linear]]:
    """The float linears quantized one by one: a head tied to the input embedding is not among them (it is quantized
    once the model is built, together with the embedding: :func:`quantize_tied_head`)."""
    from ..modules.quant_linear import quantizable_linears

    return list(quantizable_linears(model, settings.lm_head and not head_is_tied(model)))


def swap_placeholders(model: nn.Module, settings: QuantSettings, dtype: torch.dtype, quantized: bool) -> int:
    """Before loading (``model`` on meta): replace each quantizable ``nn.Linear`` by a :class:`QuantLinear`
    placeholder. ``quantized``: the checkpoint already holds quantized tensors. Returns the number replaced."""
    from ..modules.quant_linear import QuantLinear, set_submodule

    if settings.calibration is not None and not quantized:
        return 0  # calibrated: the float weights load as they are, quantize_model_ quantizes them after a forward pass
    targets = _targets(model, settings)
    for name, lin in targets:
        spec = settings.spec_for(lin.in_features, head=is_head(model, lin))
        has_bias = lin.bias is not None
        set_submodule(model, name, QuantLinear.placeholder(lin.in_features, lin.out_features, spec, has_bias, dtype,
                                                           quantized))  # fmt: skip
    return len(targets)


def finalize_quantized(model: nn.Module) -> None:
    """After loading: every :class:`QuantLinear` checks its buffers (and unflattens a saved weight)."""
    from ..modules.quant_linear import QuantLinear

    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.finalize()


def _row_parallel_reduce(module: nn.Module):
    """The all-reduce of a (non-transposed) ``RowParallelLinear`` from AutoTP, else None."""
    if type(module).__name__ != "RowParallelLinear" or getattr(module, "transposed", True):
        return None
    from ..parallel import all_reduce_

    group = module.tp
    return lambda t: all_reduce_(t, group)


def quantize_model_(model: nn.Module, settings: QuantSettings) -> int:
    """Quantize, in place, every quantizable float linear still in ``model`` (HF ``nn.Linear`` modules and AutoTP's
    row-parallel wrappers), one at a time, freeing each float weight. Returns the number quantized."""
    from torch import nn

    from ..modules.quant_linear import QuantLinear, set_submodule

    count = 0
    targets: list[tuple[str, nn.Module, Any]] = [(n, m, None) for n, m in _targets(model, settings)]
    for name, module in model.named_modules():
        reduce = _row_parallel_reduce(module)
        if reduce is not None and "expert" not in name:
            targets.append((name, module, reduce))
    hessians = calibrate(model, targets, settings.calibration)
    if targets:
        advise_calibration(settings)
    for name, module, reduce in targets:
        w = module.weight
        if w.is_meta:
            raise ValueError(f"{name} has no weights yet (meta device); load the model before quantizing it.")
        spec = settings.spec_for(w.shape[1], head=is_head(model, module))
        q = QuantLinear.from_float(w.detach(), spec, module.bias, w.dtype, reduce, hessians.pop(name, None),
                                   damp_of(settings.calibration))  # fmt: skip
        set_submodule(model, name, q)
        module.weight = None if isinstance(module, nn.Linear) else module.weight  # drop our reference early
        count += 1
    return count + quantize_tied_head(model, settings)


def quantize_loaded(module: nn.Module, settings: QuantSettings) -> QuantLinear:
    """A :class:`QuantLinear` from one loaded float ``nn.Linear`` (used by the tensor-parallel loader)."""
    from ..modules.quant_linear import QuantLinear

    w = module.weight
    return QuantLinear.from_float(w.detach(), settings.spec_for(w.shape[1]), module.bias, w.dtype)


def drop_tensor_pages(t: torch.Tensor) -> None:
    """Give back the resident file pages under ``t`` when it is a view of a memory-mapped checkpoint.

    transformers reads checkpoint tensors as views of the mapped safetensors file; every page read stays resident
    (and counts in the process's RSS) until the file is unmapped, so a quantizing load would otherwise peak at the
    float checkpoint's size. Only whole pages strictly inside ``t`` are dropped (``MADV_DONTNEED``, the same helper
    kernel injection uses for released weights); the caller has just consumed ``t`` and holds no other view of it.
    """
    if t.device.type != "cpu":
        return
    from ..modules.weight_arena import drop_file_pages

    drop_file_pages([(t.data_ptr(), t.numel() * t.element_size())])


def quantize_on_load_op(quantizer: Any) -> Any:
    """transformers' per-tensor quantize op (a ``ConversionOps``): one checkpoint tensor in (float ``[N, K]``), the
    quantized buffers of its :class:`QuantLinear` out. The float tensor is dropped right after."""
    from transformers.core_model_loading import ConversionOps

    from hf_dsinfer.kernels.quant_format import quantize_weight

    class QuantizeOnLoad(ConversionOps):
        def convert(
            self, input_dict: dict[str, Any], full_layer_name: str | None = None, model: Any = None, **kwargs: Any
        ) -> dict[str, torch.Tensor]:
            (value,) = input_dict.values()
            value = value[0] if isinstance(value, list) else value
            module = model.get_submodule(full_layer_name.rpartition(".")[0])
            q, s, z = quantize_weight(value, module.spec, module.weight_scales.dtype)
            drop_tensor_pages(value)  # the float tensor's file pages: read once, not needed again
            del value
            out = {full_layer_name: q, f"{full_layer_name}_scales": s}
            if z is not None:
                out[f"{full_layer_name}_zeros"] = z
            return out

    return QuantizeOnLoad()


def quantize_slices(settings: QuantSettings) -> Any:
    """The tensor-parallel loader's ``on_loaded`` callback: each quantizable ``nn.Linear`` is replaced by a
    :class:`QuantLinear` as soon as this rank's slice of its weight is read (scales computed on the slice), so the
    float slice is dropped at once. A bias loaded after its weight goes to the replacement."""
    from torch import nn

    from ..modules.quant_linear import QuantLinear

    refuse_calibration(settings.calibration, "with tensor parallelism")
    state: dict[str, Any] = {"targets": None, "replaced": {}, "head": None}

    def on_loaded(places: list[tuple[nn.Module, str]]) -> None:
        for module, pname in places:
            replaced = state["replaced"].get(id(module))
            if replaced is not None:
                if pname == "bias":
                    replaced.bias = module.bias
                continue
            if pname != "weight" or not isinstance(module, nn.Linear) or id(module) not in state["targets"]:
                continue
            name, parent, child = state["targets"][id(module)]
            w = module.weight  # [N_local, K_local]
            bias = module.bias if module.bias is not None and not module.bias.is_meta else None
            q = QuantLinear.from_float(w.detach(), settings.spec_for(w.shape[1], head=state["head"] is module), bias,
                                       w.dtype)  # fmt: skip
            if module.bias is not None and module.bias.is_meta:
                q.bias = module.bias  # still on meta: set again when it is loaded
            setattr(parent, child, q)
            state["replaced"][id(module)] = q
            module.weight = None  # drop the float slice

    def bind(model: nn.Module) -> Any:
        targets = {}
        for name, module in _targets(model, settings):
            parent_name, _, child = name.rpartition(".")
            targets[id(module)] = (name, model.get_submodule(parent_name) if parent_name else model, child)
        state["targets"] = targets
        get_out = getattr(model, "get_output_embeddings", None)
        state["head"] = get_out() if get_out is not None else None
        return on_loaded

    return bind


# ---------------------------------------------------------------------------------------------------------------------
# A quantized inference copy refreshed from float training weights (the Hybrid Engine's QLoRA-style rollouts)
# ---------------------------------------------------------------------------------------------------------------------

_FUSED_LINEARS = ("attn.qkv", "attn.o", "mlp.up", "mlp.down")


def quantize_fused_layers_(layers: nn.ModuleList, settings: QuantSettings) -> int:
    """Replace the float linears of fused decoder layers (``attn.qkv``/``attn.o``/``mlp.up``/``mlp.down``) by
    :class:`QuantLinear` modules of the same shapes, freeing the float weights; their values are (re)written by
    :func:`refresh_fused_quantized`. MoE expert blocks stay float. Returns the number replaced."""
    from ..modules.linear import Linear
    from ..modules.quant_linear import QuantLinear

    refuse_calibration(settings.calibration, "for the Hybrid Engine's inference copy (refreshed on every switch)")
    count = 0
    for layer in layers:
        for path in _FUSED_LINEARS:
            parent_name, _, child = path.rpartition(".")
            parent = getattr(layer, parent_name, None)
            module = getattr(parent, child, None)
            if not isinstance(module, Linear):
                continue
            w = module.weight  # [N, K]
            q = QuantLinear.from_float(w.detach(), settings.spec_for(w.shape[1]), module.bias, w.dtype, module.reduce)
            setattr(parent, child, q)
            module.weight = None
            count += 1
    return count


def refresh_fused_quantized(layer: nn.Module, weight_map: dict[str, Any], get: Any) -> None:
    """Write fresh values into one fused layer in place: quantized linears get their packed float weight (one
    temporary tensor) quantized into their existing buffers, everything else is packed as usual (``pack_into``).

    Buffers keep their storage (captured CUDA graphs stay valid); the in-place writes bump their versions, so CPU
    packs are rebuilt on the next call.
    """
    from hf_dsinfer.kernels.quant_format import quantize_weight

    from ..modules.quant_linear import QuantLinear
    from ..policies.base import as_source

    for fused_name, src in weight_map.items():
        src = as_source(src)
        owner, _, attr = fused_name.rpartition(".")
        module = layer.get_submodule(owner) if owner else layer
        if isinstance(module, QuantLinear) and attr == "weight":
            w = src.pack(get).detach()  # [N, K] float, this layer's only temporary
            q, s, z = quantize_weight(w, module.spec, module.weight_scales.dtype)
            module.weight.copy_(q)
            module.weight_scales.copy_(s)
            if z is not None:
                module.weight_zeros.copy_(z)
        else:
            src.pack_into(get, layer.get_parameter(fused_name).data)
