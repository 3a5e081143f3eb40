"""``InferenceConfig``: DeepSpeed-Inference's configuration, as a transformers quantization config.

Field names, defaults and aliases follow DeepSpeed's ``DeepSpeedInferenceConfig`` so existing ``init_inference``
calls and JSON files keep working; our own additions are listed in ``OWN_FIELDS``. The config is a
``QuantizationConfigMixin`` registered under ``quant_method="dsinfer"``: transformers saves it in config.json and a
saved model reloads optimized (see ``integration/quantizer.py``).
"""

from __future__ import annotations

import contextvars
import copy
import difflib
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from transformers.utils.quantization_config import QuantizationConfigMixin

from .config_compat import (
    COMPAT_ALIASES,
    COMPAT_FIELDS,
    DtypeName,
    log_no_effect_values,
    normalize_injection_policy,
    pop_compat_fields,
)
from .moe_config import MOE_TOP_LEVEL, MoEConfig, merge_top_level_moe_keys
from .quant_config import QuantSettings, merge_int8_dtype, normalize_quant, parse_quant

QUANT_METHOD = "dsinfer"
AUTO = "auto"  # dtype / replace_with_kernel_inject: decided per model (see ``auto_dtype`` and docs/migration.md)

# canonical name -> accepted spellings (torch dtypes are accepted too)
_DTYPE_NAMES = {
    "float16": ("fp16", "float16", "half", "torch.float16"),
    "bfloat16": ("bf16", "bfloat16", "bfloat", "torch.bfloat16"),
    "float32": ("fp32", "float32", "float", "torch.float32"),
}
_DTYPE_BY_SPELLING = {s: canon for canon, spellings in _DTYPE_NAMES.items() for s in spellings}

# DeepSpeed's top-level fields and defaults, except two defaults that give the fast path (docs/migration.md):
# DeepSpeed has dtype="float16" (wrong and slow on CPU, a silent cast of bf16 checkpoints) and
# replace_with_kernel_inject=False (HF's own layers, so nothing is faster until the user finds the switch).
DEEPSPEED_FIELDS: dict[str, Any] = {
    "dtype": AUTO,
    "tensor_parallel": None,  # -> TensorParallelConfig
    "replace_with_kernel_inject": AUTO,
    "enable_cuda_graph": False,
    "injection_policy": None,
    "max_out_tokens": 1024,
    "min_out_tokens": 1,
    "checkpoint": None,
    "base_dir": "",
    "quant": None,
    "moe": None,
    "keep_module_on_host": False,
    "save_mp_checkpoint_path": None,
    "use_triton": False,
    "triton_autotune": False,
    "return_tuple": True,
    "training_mp_size": 1,
}
# Ours.
OWN_FIELDS: dict[str, Any] = {
    "cuda_graph_batch_sizes": None,  # None: 1, 2, 4, 8, 16, 24, 32, ... up to max_batch_size
    "max_batch_size": 8,  # rows of the static KV cache
    "cpu_compile": "auto",  # CPU decode steps through torch.compile, once they ran long enough to pay (True: at once)
    "threads": None,  # torch CPU threads for the process (torch.set_num_threads at load); None: leave torch's
}
FIELDS = {**DEEPSPEED_FIELDS, **OWN_FIELDS}

ALIASES = {
    "kernel_inject": "replace_with_kernel_inject",
    "tp": "tensor_parallel",
    "injection_dict": "injection_policy",
    "max_tokens": "max_out_tokens",
    "min_tokens": "min_out_tokens",
}
# DeepSpeed's deprecated top-level keys and where they moved (dotted path into a nested section).
# (``tp_grain_size`` was a top-level field before DeepSpeed 0.16.5 moved it into ``tensor_parallel``.)
DEPRECATED = {
    "mp_size": "tensor_parallel.tp_size",
    "mpu": "tensor_parallel.mpu",
    "tp_grain_size": "tensor_parallel.tp_grain_size",
}

TP_FIELDS: dict[str, Any] = {"enabled": True, "tp_size": 1, "tp_grain_size": 64, "mpu": None, "tp_group": None}
_TP_RUNTIME = ("mpu", "tp_group")  # process-group objects: kept in memory, never serialized

_BOOL_FIELDS = (
    "enable_cuda_graph",
    "keep_module_on_host",
    "use_triton",
    "triton_autotune",
    "return_tuple",
)

# Set by the from_pretrained hook while a user-passed config must replace the one saved in config.json.
_LOAD_OVERRIDE: contextvars.ContextVar[InferenceConfig | None] = contextvars.ContextVar(
    "hf_dsinfer_load_override", default=None
)


def normalize_dtype(value: Any, key: str = "dtype", allow_auto: bool = False) -> str:
    """Return the canonical dtype name (``float16``, ``bfloat16``, ``float32``) for any accepted spelling, or
    ``"auto"`` when ``allow_auto`` and the value is ``"auto"``."""
    if allow_auto and isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, str):
        canon = _DTYPE_BY_SPELLING.get(value.strip().lower())
        if canon is not None:
            return canon
    if value in ("int8", torch.int8) or str(value) == "torch.int8":
        raise ValueError(
            f"{key}=int8 is weight quantization: set it in the inference config (dtype='int8' or quant={{'enabled': "
            "True, 'weight': {'num_bits': 8}}}) and leave this dtype as fp16, bf16, fp32 or 'auto'."
        )
    valid = ", ".join(sorted(_DTYPE_BY_SPELLING) + ([AUTO] if allow_auto else []))
    raise ValueError(f"{key}={value!r} is not a dtype hf_dsinfer knows; use one of: {valid} (or a torch dtype).")


def auto_dtype(source: torch.dtype | str | None, device: torch.device | str | None) -> torch.dtype:
    """What ``dtype="auto"`` means for a model whose weights are ``source`` and that runs on ``device``.

    The checkpoint's (or built model's) dtype, with two exceptions that would otherwise give slow or failing runs:
    fp16 on a CPU becomes fp32 (CPUs have no fast fp16 GEMMs and HF's fp16 CPU path is imprecise), and bf16 on a
    GPU without bf16 becomes fp16. Each exception logs one info line. No source dtype (a model without floating
    weights): torch's default dtype. One rule on every CPU, so results do not depend on the machine's ISA.
    """
    from ..log import logger

    if isinstance(source, str):
        source = getattr(torch, normalize_dtype(source))
    dtype = source if source is not None and source.is_floating_point else torch.get_default_dtype()
    kind = torch.device(device).type if device is not None else None
    if kind == "cpu" and dtype == torch.float16:
        logger.info(
            "dtype='auto': the checkpoint is float16, which runs slowly on a CPU; using float32 "
            "(set dtype='fp16' in the inference config to keep float16)."
        )
        return torch.float32
    if kind == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        logger.info("dtype='auto': the checkpoint is bfloat16, which this GPU does not support; using float16.")
        return torch.float16
    return dtype


def read_json_config(path: str | os.PathLike, what: str = "config") -> dict[str, Any]:
    """The JSON object in the file ``path``; a missing file, invalid JSON or a non-object raise ``ValueError`` naming
    the file (``what``: the argument it was passed as, for the message)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{what}={path!r} is not a JSON file; pass a dict, an InferenceConfig or a file path.")
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} file {path!r} is not valid JSON: {e}. Fix the file or pass a dict.") from e
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {path!r} must hold a JSON object, got {type(data).__name__}.")
    return data


def _unknown_key_error(key: str, valid: list[str], where: str) -> ValueError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"Unknown {where} key {key!r}.{hint} Valid keys: {', '.join(sorted(valid))}.")


class TensorParallelConfig:
    """DeepSpeed's ``tensor_parallel`` section: ``enabled``, ``tp_size``, ``tp_grain_size``, ``mpu``, ``tp_group``.

    ``mpu`` and ``tp_group`` hold live process-group objects; they are never written to JSON.
    """

    def __init__(self, **kwargs: Any):
        for key in kwargs:
            if key not in TP_FIELDS:
                raise _unknown_key_error(key, list(TP_FIELDS), "tensor_parallel")
        values = {**TP_FIELDS, **kwargs}
        self.enabled = bool(values["enabled"])
        self.tp_size = values["tp_size"]
        self.tp_grain_size = values["tp_grain_size"]
        self.mpu = values["mpu"]
        self.tp_group = values["tp_group"]
        for key in ("tp_size", "tp_grain_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"tensor_parallel.{key} must be an integer >= 1, got {v!r}.")

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in TP_FIELDS if k not in _TP_RUNTIME}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorParallelConfig):
            return NotImplemented
        return self.to_dict() == other.to_dict() and self.mpu is other.mpu and self.tp_group is other.tp_group

    def __repr__(self) -> str:
        return f"TensorParallelConfig({self.to_dict()})"

    def __deepcopy__(self, memo: dict) -> TensorParallelConfig:
        # Process groups cannot be deep-copied: share them.
        return TensorParallelConfig(**self.to_dict(), mpu=self.mpu, tp_group=self.tp_group)


class InferenceConfig(QuantizationConfigMixin):
    """Configuration of hf_dsinfer, with DeepSpeed-Inference's field names, defaults and aliases.

    Build it from keyword arguments, a dict, a JSON file path, or another config plus overrides with
    :meth:`from_any`. Unknown keys raise ``ValueError`` naming the key; invalid values raise naming the key and the
    fix. Accepted aliases: ``kernel_inject``, ``tp``, ``injection_dict``, ``max_tokens``, ``min_tokens``; the
    deprecated ``mp_size``, ``mpu`` (and a top-level ``tp_grain_size``) map into ``tensor_parallel``, and ``ep_size``,
    ``ep_group`` / ``expert_group``, ``ep_mp_group`` / ``expert_mp_group``, ``moe_experts``, ``moe_type`` into
    ``moe``, each with a ``FutureWarning``. DeepSpeed's fields that only its own machinery reads (``zero``,
    ``triangular_masking``, ...) are accepted with one info line or refused with the reason (``config_compat.py``).
    ``dtype`` reads back as a str that compares equal to its torch dtype (``cfg.dtype == torch.half``).

    Fields (DeepSpeed's): ``dtype`` (default ``"auto"``: the checkpoint's dtype, fp16 becomes fp32 on CPU; DeepSpeed's
    is fp16), ``tensor_parallel`` (``tp_size``, ``tp_grain_size``, ``mpu``, ``tp_group``),
    ``replace_with_kernel_inject`` (default ``"auto"``: fused layers where a policy exists, HF's modules elsewhere
    with one warning; DeepSpeed's is False), ``enable_cuda_graph``, ``injection_policy``, ``max_out_tokens``
    (1024), ``min_out_tokens`` (1), ``checkpoint``, ``base_dir``, ``quant``, ``moe``, ``keep_module_on_host``,
    ``save_mp_checkpoint_path``, ``use_triton``, ``triton_autotune``, ``return_tuple``, ``training_mp_size``.
    Ours: ``cuda_graph_batch_sizes`` (batch buckets captured as CUDA graphs), ``max_batch_size`` (KV cache rows),
    ``cpu_compile`` (on CPU, decode steps run as one ``torch.compile``-d graph per batch bucket; ``"auto"``: where it
    pays), ``threads`` (torch's CPU threads for the process, set at load; None leaves them).
    """

    def __init__(self, **kwargs: Any):
        kwargs.pop("quant_method", None)  # written by to_dict; transformers' from_dict passes it back
        values = merge_int8_dtype(self._canonical_keys(kwargs))  # dtype="int8" -> an int8 quant section
        merged = {**FIELDS, **values}
        self.quant_method = QUANT_METHOD
        # A str that also compares equal to its torch dtype, as DeepSpeed's ``config.dtype`` (config_compat.py).
        self.dtype = DtypeName(normalize_dtype(merged["dtype"], allow_auto=True))
        # dtype="auto" resolved against a model (``resolve_dtype``); kept out of to_dict so "auto" round-trips.
        self._resolved_dtype = None
        # The quant section of the config.json a checkpoint was saved with (set by from_dict; None: float weights).
        self._checkpoint_quant: QuantSettings | None = None
        tp = merged["tensor_parallel"]
        if isinstance(tp, TensorParallelConfig):
            tp = copy.deepcopy(tp)
        elif tp is None:
            tp = TensorParallelConfig()
        elif isinstance(tp, Mapping):
            tp = TensorParallelConfig(**tp)
        else:
            raise ValueError(f"tensor_parallel must be a dict such as {{'tp_size': 2}}, got {tp!r}.")
        self.tensor_parallel = tp
        for key in FIELDS:
            if key not in ("dtype", "tensor_parallel"):
                # moe: parsed before the copy, so its process groups are shared, not deep-copied
                value = MoEConfig.from_value(merged[key]) if key == "moe" else merged[key]
                setattr(self, key, copy.deepcopy(value))
        self.injection_policy = normalize_injection_policy(merged["injection_policy"])
        self.post_init()

    # -- construction helpers -------------------------------------------------------------------------------------

    @staticmethod
    def _canonical_keys(kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Resolve aliases and deprecated keys; reject unknown ones; merge nested sections."""
        out: dict[str, Any] = {}
        given_as: dict[str, str] = {}  # canonical name -> the spelling the user used, for error messages
        tp_extra: dict[str, Any] = {}
        moe_extra: dict[str, Any] = {}  # DeepSpeed's deprecated top-level MoE keys
        for key, value in kwargs.items():
            if key in MOE_TOP_LEVEL:
                new = f"moe.{MOE_TOP_LEVEL[key]}"
                warnings.warn(f"{key} is deprecated; use {new} instead.", FutureWarning, stacklevel=4)
                moe_extra[key] = value
                continue
            if key in DEPRECATED:
                section, sub = DEPRECATED[key].split(".")
                warnings.warn(f"{key} is deprecated; use {DEPRECATED[key]} instead.", FutureWarning, stacklevel=4)
                tp_extra[sub] = value
                continue
            canon = ALIASES.get(key, COMPAT_ALIASES.get(key, key))
            if canon not in FIELDS and canon not in COMPAT_FIELDS:
                valid = [*FIELDS, *ALIASES, *DEPRECATED, *COMPAT_FIELDS, *COMPAT_ALIASES, *MOE_TOP_LEVEL]
                raise _unknown_key_error(key, valid, "InferenceConfig")
            if canon in out and out[canon] != value:
                raise ValueError(
                    f"{given_as[canon]} and {key} are the same setting with different values; pass only one."
                )
            out[canon] = value
            given_as[canon] = key
        if tp_extra:
            tp = out.get("tensor_parallel") or {}
            tp = tp.to_dict() | {"mpu": tp.mpu, "tp_group": tp.tp_group} if isinstance(tp, TensorParallelConfig) else tp
            tp = dict(tp)
            for sub, value in tp_extra.items():
                if sub in tp and tp[sub] != value:
                    raise ValueError(
                        f"tensor_parallel.{sub}={tp[sub]!r} conflicts with the deprecated alias for it ({value!r})."
                    )
                tp[sub] = value
            out["tensor_parallel"] = tp
        merge_top_level_moe_keys(out, moe_extra)
        pop_compat_fields(out)  # DeepSpeed-only fields: dropped with one info line, or refused (config_compat.py)
        return out

    @classmethod
    def from_any(cls, config: Any = None, **kwargs: Any) -> InferenceConfig:
        """Build from ``None``, an ``InferenceConfig``, a dict or a JSON file path, merged with ``kwargs``.

        A key given both in ``config`` and in ``kwargs`` with different values raises ``ValueError`` naming every
        such key (DeepSpeed's rule for ``init_inference(model, config, **kwargs)``).
        """
        if config is None:
            base: dict[str, Any] = {}
        elif isinstance(config, InferenceConfig):
            base = config._field_values()
        elif isinstance(config, Mapping):
            base = dict(config)
            base.pop("quant_method", None)
        elif isinstance(config, (str, os.PathLike)):
            base = read_json_config(config)
            base.pop("quant_method", None)
        else:
            raise ValueError(
                f"config must be None, an InferenceConfig, a dict or a JSON path, got {type(config).__name__}."
            )
        if not kwargs:
            return cls(**base)
        a = cls(**base)
        b = cls(**kwargs)
        given_a = cls._canonical_keys(base)
        given_b = cls._canonical_keys(kwargs)
        conflicts = []
        for key in sorted(set(given_a) & set(given_b)):
            if getattr(a, key) != getattr(b, key):
                conflicts.append(f"{key} ({getattr(a, key)!r} in config, {getattr(b, key)!r} in kwargs)")
        if conflicts:
            raise ValueError(
                "Conflicting values between config and keyword arguments for: "
                + "; ".join(conflicts)
                + ". Pass each setting once."
            )
        return cls(**{**base, **kwargs})

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        """transformers' loader entry point (config.json -> config). See ``integration/hooks.py`` for overrides."""
        override = _LOAD_OVERRIDE.get()
        config = copy.deepcopy(override) if override is not None else cls(**config_dict)
        # How the checkpoint's weights are stored (a saved quantized model), whatever config replaces the saved one.
        config._checkpoint_quant = parse_quant(config_dict.get("quant"))
        unused = {}
        for key, value in kwargs.items():
            if hasattr(config, key):
                setattr(config, key, value)
            else:
                unused[key] = value
        return (config, unused) if return_unused_kwargs else config

    # -- validation ------------------------------------------------------------------------------------------------

    def post_init(self) -> None:
        """Check every value; errors name the key and the fix."""
        for key in _BOOL_FIELDS:
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be True or False, got {getattr(self, key)!r}.")
        inject = self.replace_with_kernel_inject
        if isinstance(inject, str) and inject.strip().lower() == AUTO:
            self.replace_with_kernel_inject = AUTO
        elif not isinstance(inject, bool):
            raise ValueError(
                f"replace_with_kernel_inject must be True, False or 'auto', got {inject!r} ('auto', the default, "
                "injects fused layers where a policy exists and keeps HF's modules elsewhere)."
            )
        if isinstance(self.cpu_compile, str) and self.cpu_compile.strip().lower() == AUTO:
            self.cpu_compile = AUTO
        elif not isinstance(self.cpu_compile, bool):
            raise ValueError(f"cpu_compile must be True, False or 'auto', got {self.cpu_compile!r}.")
        t = self.threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"threads must be an integer >= 1 (torch's CPU threads) or None (leave them), got {t!r}.")
        for key in ("max_out_tokens", "min_out_tokens", "max_batch_size", "training_mp_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {v!r}.")
        if self.max_out_tokens < self.min_out_tokens:
            raise ValueError(
                f"max_out_tokens ({self.max_out_tokens}) is smaller than min_out_tokens ({self.min_out_tokens}); "
                "raise max_out_tokens or lower min_out_tokens."
            )
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None:
            if (
                not isinstance(sizes, (list, tuple))
                or not sizes
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)
            ):
                raise ValueError(f"cuda_graph_batch_sizes must be a non-empty list of integers >= 1, got {sizes!r}.")
            self.cuda_graph_batch_sizes = sorted(set(sizes))
            if self.cuda_graph_batch_sizes[-1] > self.max_batch_size:
                raise ValueError(
                    f"cuda_graph_batch_sizes reaches {self.cuda_graph_batch_sizes[-1]} but max_batch_size is "
                    f"{self.max_batch_size}; raise max_batch_size or drop the larger buckets."
                )
        if self.training_mp_size != 1:
            raise ValueError("training_mp_size other than 1 is not supported; reshard the checkpoint first.")
        self.moe = MoEConfig.from_value(self.moe)  # DeepSpeed's moe section (integration/moe_config.py)
        self.quant = normalize_quant(self.quant)  # weight-only int8/int4 (integration/quant_config.py)
        for key in ("checkpoint", "save_mp_checkpoint_path"):
            v = getattr(self, key)
            if v is not None and not isinstance(v, (str, dict)):
                raise ValueError(f"{key} must be a path or a dict, got {type(v).__name__}.")
        if not isinstance(self.base_dir, str):
            raise ValueError(f"base_dir must be a string path, got {self.base_dir!r}.")
        log_no_effect_values(self)  # use_triton=True, ...: one info line each

    # -- views -----------------------------------------------------------------------------------------------------

    @property
    def _resolved_dtype(self) -> torch.dtype | None:
        """What ``dtype="auto"`` resolved to (None before ``resolve_dtype``); ``dtype`` compares equal to it."""
        return self.__dict__.get("_resolved", None)

    @_resolved_dtype.setter
    def _resolved_dtype(self, value: torch.dtype | None) -> None:
        self.__dict__["_resolved"] = value
        if self.dtype == AUTO:
            self.dtype = DtypeName(AUTO, value)

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``; for ``dtype="auto"``, the dtype ``resolve_dtype`` chose."""
        if self.dtype != AUTO:
            return getattr(torch, self.dtype)
        if self._resolved_dtype is None:
            raise RuntimeError(
                "InferenceConfig(dtype='auto') has not been applied to a model yet, so it has no torch dtype; "
                "call config.resolve_dtype(model_dtype, device) or set dtype explicitly (fp16, bf16, fp32)."
            )
        return self._resolved_dtype

    def resolve_dtype(self, source: torch.dtype | None, device: torch.device | str | None = None) -> torch.dtype:
        """The torch dtype a model whose weights are ``source`` runs in on ``device``, remembered on this config.

        An explicit ``dtype`` wins; ``"auto"`` follows :func:`auto_dtype` (``device=None``: keep ``source`` as is,
        for a dtype the user chose explicitly elsewhere, e.g. ``from_pretrained(..., dtype=...)``). With weight-only
        quantization (``quant``, ``dtype="int8"``) on a GPU, fp32 becomes bf16 (fp16 without bf16): the quantized
        GEMMs take half-precision activations (DeepSpeed's int8 inference runs fp16 activations).
        """
        if self.dtype != AUTO:
            return getattr(torch, self.dtype)
        dtype = auto_dtype(source, device)
        on_gpu = device is not None and torch.device(device).type == "cuda"
        if on_gpu and self.quant is not None and dtype == torch.float32:
            bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
            dtype = torch.bfloat16 if bf16 else torch.float16
        self._resolved_dtype = dtype
        return self._resolved_dtype

    @property
    def quant_settings(self) -> QuantSettings | None:
        """The parsed ``quant`` section (weight-only int8/int4), or None when weights stay in ``dtype``."""
        return parse_quant(self.quant)

    @property
    def injects(self) -> bool:
        """True when fused layers are wanted (``replace_with_kernel_inject`` True or ``"auto"``)."""
        return self.replace_with_kernel_inject is not False

    @property
    def tp_size(self) -> int:
        """Shortcut for ``tensor_parallel.tp_size``."""
        return self.tensor_parallel.tp_size if self.tensor_parallel.enabled else 1

    def _field_values(self) -> dict[str, Any]:
        values = {k: getattr(self, k) for k in FIELDS}
        values["tensor_parallel"] = {
            **self.tensor_parallel.to_dict(),
            "mpu": self.tensor_parallel.mpu,
            "tp_group": self.tensor_parallel.tp_group,
        }
        return values

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable dict (process groups left out), with ``quant_method``."""
        out = {k: copy.deepcopy(getattr(self, k)) for k in FIELDS if k != "tensor_parallel"}
        out["dtype"] = str(self.dtype)  # a plain str in JSON, without the resolved dtype
        out["tensor_parallel"] = self.tensor_parallel.to_dict()
        out["moe"] = self.moe.to_dict() if self.moe is not None else None
        out["quant_method"] = QUANT_METHOD
        return out

    def to_diff_dict(self) -> dict[str, Any]:
        """Only the values that differ from the defaults (plus ``quant_method``)."""
        default = InferenceConfig().to_dict()
        return {k: v for k, v in self.to_dict().items() if k == "quant_method" or default.get(k) != v}

    def __iter__(self):
        yield from self.to_dict().items()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InferenceConfig):
            return NotImplemented
        return self._field_values() == other._field_values()

    def __deepcopy__(self, memo: dict) -> InferenceConfig:
        out = InferenceConfig(**self._field_values())
        out._resolved_dtype = self._resolved_dtype
        out._checkpoint_quant = self._checkpoint_quant
        return out
