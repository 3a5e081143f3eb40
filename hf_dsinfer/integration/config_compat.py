"""DeepSpeed config names that steer DeepSpeed-only machinery, and the ``dtype`` value DeepSpeed users compare.

DeepSpeed's ``DeepSpeedInferenceConfig`` (DeepSpeed 0.16.5) has fields that only its own kernel containers, its
ZeRO-Inference partitioning or its Hybrid Engine read. ``InferenceConfig`` accepts them so a DeepSpeed script runs
after changing the import:

* a field that cannot change results here is accepted and dropped, with one info line per field and process when its
  value differs from DeepSpeed's default (``NO_EFFECT``);
* a field whose value would change results if ignored is refused, naming the field and what to do instead
  (``REFUSED_UNLESS_DEFAULT``).

Also here: ``normalize_injection_policy`` (DeepSpeed's ``{LayerClass: (names...)}`` as JSON) and :class:`DtypeName`
(``dtype`` as DeepSpeed users compare it). docs/migration.md lists every DeepSpeed field with its treatment;
tests/test_config_deepspeed_fields.py checks that every field of DeepSpeed's class (written into the test as data) is
handled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..log import logger

# DeepSpeed name -> canonical name, for the fields handled here.
COMPAT_ALIASES = {"tm": "triangular_masking", "ckpt_config": "checkpoint_config", "args": "config"}

# field -> (DeepSpeed's default, why it changes nothing here). Accepted, logged once when not the default, dropped.
NO_EFFECT: dict[str, tuple[Any, str]] = {
    "zero": (
        {},
        "ZeRO-Inference partitions or offloads parameters, which changes where weights live, not the results; "
        "hf_dsinfer keeps every weight on the device (use tensor_parallel or quant to fit a large model)",
    ),
    "triangular_masking": (
        True,
        "DeepSpeed's kernel containers set the masking per model and never read this field; the fused layers use the "
        "model's own (causal or bidirectional) mask",
    ),
    "set_empty_params": (
        False,
        "DeepSpeed's Hybrid Engine sets it for its internal inference copy; here weights are always the model's",
    ),
    "transposed_mode": (
        False,
        "DeepSpeed's Hybrid Engine sets it for its weight layout; each fused layer here chooses its own layout",
    ),
    "replace_method": (
        "auto",
        "deprecated in DeepSpeed ('This parameter is no longer needed, please remove from your call to "
        "DeepSpeed-inference'); remove it",
    ),
}
# field -> (DeepSpeed's default, why any other value is refused and what to do instead).
REFUSED_UNLESS_DEFAULT: dict[str, tuple[Any, str]] = {
    "config": (
        None,
        "it replaces the model config DeepSpeed's kernels read (sizes, heads); hf_dsinfer reads model.config, so "
        "ignoring it would run a different model than the one you described. Remove it and set the values on "
        "model.config (or from_pretrained(..., config=...))",
    ),
    "injection_policy_tuple": (
        None,
        "it holds DeepSpeed policy classes for DeepSpeed's kernels; pass injection_policy={LayerClass: "
        "('attn.out_proj', 'mlp.down_proj')} for tensor parallelism, or rely on hf_dsinfer's policies "
        "(replace_with_kernel_inject)",
    ),
}
# checkpoint_config (alias ckpt_config): DeepSpeed 0.16.5 never reads it (its own TODO).
CHECKPOINT_CONFIG_KEYS = ("checkpoint_dir", "save_mp_checkpoint_path", "base_dir")
# Stored fields accepted as in DeepSpeed that have no effect at some values: field -> (value, why).
NO_EFFECT_VALUES: dict[str, tuple[Any, str]] = {
    "use_triton": (True, "the Triton kernels are always used on CUDA (and torch code elsewhere)"),
    "triton_autotune": (True, "kernel launch parameters are fixed per shape; nothing is autotuned at start"),
    "return_tuple": (
        False,
        "it shapes the output of DeepSpeed's own layers; the fused layers return what the HF model expects",
    ),
}
COMPAT_FIELDS = (*NO_EFFECT, *REFUSED_UNLESS_DEFAULT, "checkpoint_config")

_LOGGED: set[str] = set()


def log_no_effect(key: str, reason: str) -> None:
    """One info line per ``key`` and process saying that ``key`` changes nothing here, and why."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("hf_dsinfer: %s has no effect here: %s.", key, reason)


def _check_checkpoint_config(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ValueError(f"checkpoint_config must be a dict of {', '.join(CHECKPOINT_CONFIG_KEYS)}, got {value!r}.")
    unknown = [k for k in value if k not in CHECKPOINT_CONFIG_KEYS]
    if unknown:
        raise ValueError(
            f"Unknown checkpoint_config key {unknown[0]!r}. Valid keys: {', '.join(CHECKPOINT_CONFIG_KEYS)}."
        )
    given = {k: v for k, v in value.items() if v is not None}
    if given:
        raise ValueError(
            f"checkpoint_config={given!r}: DeepSpeed never reads this section either, so these paths would not be "
            "used; set the top-level fields instead: checkpoint (the checkpoint JSON), base_dir and "
            "save_mp_checkpoint_path."
        )


def pop_compat_fields(values: dict[str, Any]) -> None:
    """Remove DeepSpeed's no-effect fields from ``values`` (canonical names), logging the ones set to a
    non-default value; refuse the ones that would change results."""
    for key, (default, reason) in NO_EFFECT.items():
        if key not in values:
            continue
        value = values.pop(key)
        if key in ("triangular_masking", "set_empty_params", "transposed_mode") and not isinstance(value, bool):
            raise ValueError(f"{key} must be True or False, got {value!r}.")
        if key == "zero" and value is not None and not isinstance(value, Mapping):
            raise ValueError(f"zero must be a dict (DeepSpeed's ZeRO section), got {value!r}.")
        if key == "replace_method" and not isinstance(value, str):
            raise ValueError(f"replace_method must be a string (DeepSpeed's default is 'auto'), got {value!r}.")
        if key == "replace_method" or value not in (default, None):
            log_no_effect(key, reason)
    for key, (default, reason) in REFUSED_UNLESS_DEFAULT.items():
        if key in values:
            value = values.pop(key)
            if value is not default:
                alias = next((a for a, c in COMPAT_ALIASES.items() if c == key), None)
                named = f"{key} (alias {alias})" if alias else key
                raise ValueError(f"{named} is not supported: {reason}.")
    if "checkpoint_config" in values:
        _check_checkpoint_config(values.pop("checkpoint_config"))


def log_no_effect_values(config: Any) -> None:
    """One info line for each stored DeepSpeed field set to a value that changes nothing here."""
    for key, (value, reason) in NO_EFFECT_VALUES.items():
        if getattr(config, key) == value:
            log_no_effect(f"{key}={value}", reason)


def _policy_key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, type):
        return f"{key.__module__}.{key.__qualname__}"
    raise ValueError(f"injection_policy keys must be layer classes or their dotted names, got {key!r}.")


def normalize_injection_policy(value: Any) -> dict[str, list[str]] | None:
    """DeepSpeed's ``{LayerClass: ("self_attn.o_proj", "mlp.down_proj")}`` as JSON: dotted class name -> names."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise ValueError(
            "injection_policy must be a non-empty dict {LayerClass: ('attn.out_proj', 'mlp.down_proj')}, "
            f"got {value!r}."
        )
    out = {}
    for key, names in value.items():
        if isinstance(names, str):
            names = (names,)
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(
                f"injection_policy[{_policy_key(key)!r}] must be a tuple of module names (the layer's row-parallel "
                f"output projections, e.g. ('self_attn.o_proj', 'mlp.down_proj')), got {names!r}."
            )
        out[_policy_key(key)] = list(names)
    return out


class DtypeName(str):
    """``InferenceConfig.dtype``: the canonical name (``"float16"``, ``"bfloat16"``, ``"float32"`` or ``"auto"``) that
    also compares equal to the ``torch.dtype`` it stands for, as DeepSpeed's ``config.dtype`` (a ``torch.dtype``) does.

    ``cfg.dtype == torch.float16`` and ``cfg.dtype == "float16"`` both hold for ``dtype="fp16"``; ``"auto"`` compares
    equal to the dtype it resolved to once applied to a model (``resolved``), and to ``"auto"``. It is a ``str``, so
    the config stays JSON-serializable (config.json keeps ``"auto"``). Where a real ``torch.dtype`` is needed
    (``torch.zeros(..., dtype=...)``, ``isinstance``), use ``InferenceConfig.torch_dtype``.
    """

    resolved: torch.dtype | None

    def __new__(cls, name: str, resolved: torch.dtype | None = None) -> DtypeName:
        out = super().__new__(cls, name)
        out.resolved = resolved if name == "auto" else getattr(torch, name)
        return out

    def __eq__(self, other: object) -> bool:
        if isinstance(other, torch.dtype):
            return self.resolved is not None and other == self.resolved
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = str.__hash__  # hashes as the name: ``{cfg.dtype: ...}["float16"]`` works

    def __reduce__(self):
        # pickle / deepcopy rebuild it from the name and the resolved dtype
        return (DtypeName, (str(self), self.resolved if str(self) == "auto" else None))

    def __repr__(self) -> str:
        return str.__repr__(self)
