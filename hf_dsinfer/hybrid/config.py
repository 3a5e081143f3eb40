"""DeepSpeed's ``hybrid_engine`` config section, read with DeepSpeed's names and defaults.

A DeepSpeed training config enables its Hybrid Engine with::

    "hybrid_engine": {"enabled": true, "max_out_tokens": 512, "inference_tp_size": 1,
                      "release_inference_cache": false, "pin_parameters": true, "tp_gather_partition_size": 8}

:func:`read_hybrid_engine_config` turns that section (or a whole DeepSpeed config dict / JSON path holding it) into
:class:`HybridEngineSettings`, which ``HybridEngine(model, config=...)`` and ``HybridEngineCallback(config=...)``
apply. Every key of DeepSpeed's ``HybridEngineConfig`` (DeepSpeed 0.16.5: ``enabled``, ``max_out_tokens``,
``inference_tp_size``, ``release_inference_cache``, ``pin_parameters``, ``tp_gather_partition_size``) is accepted; the
ones that steer DeepSpeed-only machinery log once (info) why they change nothing here. One key is ours:
``enable_cuda_graph`` (decode steps of the inference copy replayed as CUDA graphs, the inference config's field of that
name; DeepSpeed's Hybrid Engine has no such key). Any other key is refused by name, with the closest valid name.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..log import logger

SECTION = "hybrid_engine"
AUTO = "auto"  # enable_cuda_graph="auto": on for a CUDA inference copy

# Keys accepted for compatibility that steer DeepSpeed machinery this engine does not have, and why.
NO_EFFECT = {
    "pin_parameters": (
        "DeepSpeed keeps ZeRO-3 gathered parameters resident between generations; here the inference copy is "
        "always a separate, persistent set of buffers, refreshed in place"
    ),
    "tp_gather_partition_size": (
        "DeepSpeed gathers that many layers at once for its tensor-parallel inference containers; here shards are "
        "gathered one layer (ZeRO-3) or one tensor (FSDP2) at a time"
    ),
}
_LOGGED: set[str] = set()


@dataclass(frozen=True)
class HybridEngineSettings:
    """DeepSpeed's ``hybrid_engine`` section, with DeepSpeed's defaults.

    Attributes:
        enabled: DeepSpeed's switch. ``False`` (DeepSpeed's default): no inference copy is built and ``generate``
            runs on the training model, as with DeepSpeed's engine without the Hybrid Engine.
        max_out_tokens: KV-cache capacity per sequence (prompt plus new tokens); the inference config's
            ``max_out_tokens``.
        inference_tp_size: tensor-parallel degree of the inference copy.
        release_inference_cache: free the KV cache (and CUDA graphs) after each generation.
        pin_parameters, tp_gather_partition_size: accepted, no effect here (see ``NO_EFFECT``).
        enable_cuda_graph: ours; ``None`` (default): the inference config decides (its ``enable_cuda_graph``),
            ``True``/``False``: sets it.
    """

    enabled: bool = False
    max_out_tokens: int = 512
    inference_tp_size: int = 1
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: int = 8
    enable_cuda_graph: bool | None = None

    def __post_init__(self) -> None:
        for name in ("enabled", "release_inference_cache", "pin_parameters", "enable_cuda_graph"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "enable_cuda_graph" and value is None):
                raise ValueError(f"{SECTION}.{name} must be true or false, got {value!r}.")
        for name in ("max_out_tokens", "inference_tp_size", "tp_gather_partition_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{SECTION}.{name} must be an integer >= 1, got {value!r}.")

    def inference_fields(self) -> dict[str, Any]:
        """The inference-config fields this section sets."""
        out: dict[str, Any] = {"max_out_tokens": self.max_out_tokens}
        if self.inference_tp_size > 1:
            out["tensor_parallel"] = {"tp_size": self.inference_tp_size}
        if self.enable_cuda_graph is not None:
            out["enable_cuda_graph"] = self.enable_cuda_graph
        return out


def read_hybrid_engine_config(config: Any) -> HybridEngineSettings:
    """:class:`HybridEngineSettings` from a DeepSpeed config (dict or JSON path) or from its ``hybrid_engine`` section.

    A dict with a ``hybrid_engine`` key is a whole DeepSpeed config (its other sections belong to DeepSpeed's
    training engine and are not read); a dict holding any of the section's own keys is the section itself; any
    other dict is a DeepSpeed config without the section: DeepSpeed's defaults (``enabled=False``), with a warning.
    A ``HybridEngineSettings`` is returned as is.
    """
    if isinstance(config, HybridEngineSettings):
        return config
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(
            f"config must be a DeepSpeed config dict, a JSON path or its {SECTION!r} section, "
            f"got {type(config).__name__}."
        )
    names = {f.name for f in fields(HybridEngineSettings)}
    if SECTION in config:
        section = config[SECTION]
    elif names & set(config):
        section = config  # the section itself
    else:
        section = {}
        logger.warning(
            "hf_dsinfer: the DeepSpeed config has no %r section (keys: %s); using DeepSpeed's defaults, in which the "
            "Hybrid Engine is disabled (generate runs on the training model). Add \"%s\": {\"enabled\": true}.",
            SECTION, ", ".join(sorted(config)) or "none", SECTION,
        )  # fmt: skip
    if not isinstance(section, dict):
        raise ValueError(f"{SECTION} must be a dict such as {{'enabled': true}}, got {section!r}.")
    valid = [f.name for f in fields(HybridEngineSettings)]
    for key in section:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"Unknown key {key!r} in the {SECTION} section.{hint} Valid keys: {', '.join(valid)}.")
    for key in sorted(set(section) & set(NO_EFFECT)):
        if key not in _LOGGED:
            _LOGGED.add(key)
            logger.info("hf_dsinfer: %s.%s has no effect here: %s.", SECTION, key, NO_EFFECT[key])
    return HybridEngineSettings(**section)


def section_inference_fields(
    settings: HybridEngineSettings, inference_config: Any, config_kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``config_kwargs`` plus the inference-config fields the ``hybrid_engine`` section sets.

    A field also given in ``inference_config`` (dict, JSON path or ``InferenceConfig``) or in ``config_kwargs`` must
    agree with the section: two different values for one setting are refused, naming both.
    """
    from ..integration.config import InferenceConfig, read_json_config  # config parsing only

    given: dict[str, Any] = {}
    if isinstance(inference_config, InferenceConfig):
        given = {"max_out_tokens": inference_config.max_out_tokens, "tp_size": inference_config.tp_size}
        if settings.enable_cuda_graph is not None:  # only compared when the section sets it (False is the default)
            given["enable_cuda_graph"] = inference_config.enable_cuda_graph
    elif inference_config is not None:
        raw = inference_config
        if isinstance(raw, (str, os.PathLike)):
            raw = read_json_config(raw, "inference_config")
        given = dict(raw)
    given.update(config_kwargs)
    tp = given.get("tensor_parallel")
    if isinstance(tp, dict) and "tp_size" in tp:
        given["tp_size"] = tp["tp_size"]
    out = dict(config_kwargs)
    wanted = {"max_out_tokens": settings.max_out_tokens, "tp_size": settings.inference_tp_size}
    if settings.enable_cuda_graph is not None:
        wanted["enable_cuda_graph"] = settings.enable_cuda_graph
    names = {
        "max_out_tokens": "max_out_tokens",
        "tp_size": "inference_tp_size",
        "enable_cuda_graph": "enable_cuda_graph",
    }
    for key, value in wanted.items():
        if key in given and given[key] != value:
            raise ValueError(
                f"{SECTION}.{names[key]}={value!r} in the DeepSpeed config conflicts with {key}={given[key]!r} in the "
                "inference config; set it in one place."
            )
    for key, value in settings.inference_fields().items():
        if key == "tensor_parallel" and "tp_size" in given:
            continue
        out.setdefault(key, value)
    return out


MAX_ROLLOUT_ROWS = 256  # the largest batch bucket the Trainer callback sizes the inference copy for


def rollout_batch_rows(args: Any) -> int | None:
    """Rows of one rollout batch of a Trainer's ``args``: TRL's ``generation_batch_size`` (GRPO / RLOO: prompts x
    completions per generation), else the larger per-device train / eval batch; None when ``args`` has none."""
    rows = getattr(args, "generation_batch_size", None)
    if not isinstance(rows, int) or rows < 1:
        sizes = [getattr(args, n, None) for n in ("per_device_train_batch_size", "per_device_eval_batch_size")]
        sizes = [s for s in sizes if isinstance(s, int) and s >= 1]
        rows = max(sizes) if sizes else None
    return min(rows, MAX_ROLLOUT_ROWS) if rows is not None else None


def resolve_inference_config(
    inference_config: Any,
    kwargs: Mapping[str, Any],
    training_dtype: torch.dtype,
    device_type: str = "cpu",
    rollout_rows: int | None = None,
) -> Any:
    """An ``InferenceConfig`` for the engine. Given as None, a dict or a JSON path, ``dtype`` defaults to the training
    weights' dtype and ``replace_with_kernel_inject`` to True; an ``InferenceConfig`` object is used as given.

    Rollout defaults (dict / path / None only; an explicit value always wins): ``enable_cuda_graph`` unset or
    ``"auto"`` is True on a CUDA ``device_type`` and False elsewhere; ``max_batch_size`` unset is ``rollout_rows``
    (the Trainer's rollout batch, at most :data:`MAX_ROLLOUT_ROWS`) when that is larger than the default 8, so the
    static cache and the CUDA-graph buckets cover the whole rollout batch.
    """
    # Config parsing only; imported here because integration/ sits above hybrid/ in the layer order.
    from ..integration.config import FIELDS, InferenceConfig, read_json_config

    if isinstance(inference_config, InferenceConfig):
        config = InferenceConfig.from_any(inference_config, **kwargs) if kwargs else inference_config
        config.resolve_dtype(training_dtype)  # dtype="auto" (the default): the training weights' dtype, as for a dict
        return config
    if isinstance(inference_config, (str, os.PathLike)):
        inference_config = read_json_config(inference_config, "inference_config")  # errors name the file
    raw = dict(inference_config or {})
    extra = dict(kwargs)
    keys = set(raw) | set(extra)
    if "dtype" not in keys:
        extra["dtype"] = training_dtype
    if not keys & {"replace_with_kernel_inject", "kernel_inject"}:
        extra["replace_with_kernel_inject"] = True
    graphs = extra.get("enable_cuda_graph", raw.get("enable_cuda_graph", AUTO))
    if isinstance(graphs, str) and graphs.strip().lower() == AUTO:
        raw.pop("enable_cuda_graph", None)
        extra["enable_cuda_graph"] = device_type == "cuda"  # the engine's copy decodes as CUDA graphs on a GPU
    if "max_batch_size" not in keys and rollout_rows is not None and rollout_rows > FIELDS["max_batch_size"]:
        extra["max_batch_size"] = int(rollout_rows)
    return InferenceConfig.from_any(raw, **extra)
