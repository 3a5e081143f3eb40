"""Registration with transformers, run when transformers imports the modules it patches (see ``post_import``).

* ``InferenceConfig`` / ``DsInferQuantizer`` under ``quant_method="dsinfer"`` (transformers' official plugin hook),
  so ``from_pretrained(path, quantization_config=cfg)`` works and a saved model reloads optimized.
* The ``inference_config=`` keyword of ``from_pretrained``: transformers would pass an unknown keyword on to the
  model's ``__init__`` (TypeError), so ``PreTrainedModel.from_pretrained`` is wrapped once to translate it into
  ``quantization_config``. Auto classes and pipelines reach the wrapper because they call the model class's
  ``from_pretrained``.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .config import _LOAD_OVERRIDE, AUTO, QUANT_METHOD, InferenceConfig, normalize_dtype
from .quantizer import DsInferQuantizer

_HOOK_FLAG = "_hf_dsinfer_hook"
# transformers' warning when config.json already holds a quantization config: ours replaces it on purpose.
_SAVED_CONFIG_WARNING = r"You passed `quantization_config` or equivalent parameters to `from_pretrained`"


def register() -> None:
    """Register the config, the quantizer and the ``from_pretrained`` hook. Safe to call any number of times.

    ``import hf_dsinfer`` does not call this: it runs the two halves when transformers imports the modules they patch
    (``hf_dsinfer.integration.post_import``), so the import stays light.
    """
    register_quantization_method()
    install_from_pretrained_hook()


def register_quantization_method() -> None:
    """Map ``quant_method="dsinfer"`` to ``InferenceConfig``/``DsInferQuantizer`` (transformers' public
    ``register_quantization_config`` / ``register_quantizer``, through the compat boundary: idempotent)."""
    from ..hf_compat import register_quantization_method as register

    register(QUANT_METHOD, InferenceConfig, DsInferQuantizer)


def install_from_pretrained_hook() -> None:
    """Wrap ``PreTrainedModel.from_pretrained`` once so it accepts ``inference_config=``."""
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"].__func__
    if getattr(original, _HOOK_FLAG, False):
        return

    @functools.wraps(original)
    def from_pretrained(cls, *args: Any, inference_config: Any = None, **kwargs: Any):
        return load_with_inference_config(original, cls, args, inference_config, kwargs)

    setattr(from_pretrained, _HOOK_FLAG, True)
    from_pretrained.__doc__ = (original.__doc__ or "") + (
        "\n\n        hf_dsinfer adds `inference_config` (an InferenceConfig, a dict or a JSON path): load the model "
        "optimized for inference. It is the same as `quantization_config=InferenceConfig(...)`.\n"
    )
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _explicit_dtype(kwargs: dict[str, Any]) -> str | None:
    for key in ("dtype", "torch_dtype"):
        value = kwargs.get(key)
        if value is not None and value != "auto" and not isinstance(value, dict):
            return normalize_dtype(value, key)
    return None


def load_with_inference_config(
    original: Callable, cls: type, args: tuple, inference_config: Any, kwargs: dict[str, Any]
) -> Any:
    """``from_pretrained`` with ``inference_config`` translated; the user's config replaces a saved one."""
    quant = kwargs.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == QUANT_METHOD:
        quant = kwargs["quantization_config"] = InferenceConfig.from_any(quant)
    if inference_config is not None:
        cfg = InferenceConfig.from_any(inference_config)
        if quant is not None and quant != cfg:
            raise ValueError(
                "from_pretrained got both inference_config and a different quantization_config; pass the "
                "InferenceConfig once, as either argument."
            )
        kwargs["quantization_config"] = cfg
    cfg = kwargs.get("quantization_config")
    if not isinstance(cfg, InferenceConfig):
        return original(cls, *args, **kwargs)
    # A private copy: resolving dtype="auto" for this checkpoint must not leak into the caller's object.
    cfg = kwargs["quantization_config"] = copy.deepcopy(cfg)
    cfg._resolved_dtype = None  # decided again for this load (the object may have served another model)
    explicit = _explicit_dtype(kwargs)
    if explicit is not None and cfg.dtype == AUTO:
        cfg.resolve_dtype(getattr(torch, explicit))  # the user's `dtype=` decides "auto", as given
    elif explicit is not None and explicit != cfg.dtype:
        raise ValueError(
            f"from_pretrained got dtype={explicit!r} but the inference config says dtype={cfg.dtype!r}; set the "
            "dtype in one place (the inference config's `dtype`)."
        )
    from ..parallel import tp_requested

    if tp_requested(cfg.tensor_parallel) or cfg.checkpoint is not None:
        return _load_tensor_parallel(cls, args, cfg, kwargs)
    token = _LOAD_OVERRIDE.set(cfg)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SAVED_CONFIG_WARNING)
            return original(cls, *args, **kwargs)
    finally:
        _LOAD_OVERRIDE.reset(token)


# from_pretrained keywords the tensor-parallel loader can ignore at these values (Auto classes pass them along).
_IGNORABLE = {
    "cache_dir": None, "force_download": False, "local_files_only": False, "token": None, "revision": "main",
    "subfolder": "", "proxies": None, "code_revision": None, "_from_auto": None, "_from_pipeline": None,
    "adapter_kwargs": None, "_commit_hash": None, "use_safetensors": True, "low_cpu_mem_usage": True,
    "device_map": None, "_adapter_model_path": None, "trust_remote_code": None, "output_loading_info": False,
}


def _load_tensor_parallel(cls: type, args: tuple, cfg: InferenceConfig, kwargs: dict[str, Any]) -> Any:
    """``from_pretrained`` with tensor parallelism: each rank reads only its slices (``hf_dsinfer.parallel``)."""
    import os

    from transformers import AutoConfig, GenerationConfig

    from .. import parallel
    from .apply import apply_inference_config, check_supported, local_device
    from .quant_config import parse_quant, quantize_slices

    check_supported(cfg)
    if not args:
        raise TypeError("from_pretrained needs the model path as its first argument.")
    path, extra = os.fspath(args[0]), args[1:]
    config = kwargs.pop("config", None)
    attn = kwargs.pop("attn_implementation", None)
    trust = kwargs.get("trust_remote_code")
    for key in ("quantization_config", "dtype", "torch_dtype"):
        kwargs.pop(key, None)  # the config's dtype was checked against these above
    free = ("_from_auto", "_from_pipeline", "_commit_hash", "trust_remote_code", "token", "cache_dir", "adapter_kwargs")
    if "_adapter_model_path" in (kwargs.get("adapter_kwargs") or {}):
        kwargs["_adapter_model_path"] = True  # a peft adapter directory: not supported with TP (reported below)
    bad = [k for k, v in kwargs.items() if k not in _IGNORABLE or (k not in free and v != _IGNORABLE[k] and v)]
    if extra or bad:
        raise ValueError(
            f"from_pretrained with tensor parallelism does not support {sorted(bad) or 'positional model args'}; "
            "remove them (the model goes to this rank's device; weights are read from local safetensors files)."
        )
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.pt", "*.model", "*.txt"])
    if config is None:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    saved = getattr(config, "quantization_config", None)
    saved = saved.to_dict() if hasattr(saved, "to_dict") else saved
    if isinstance(saved, dict) and saved.get("quant_method") == QUANT_METHOD and parse_quant(saved.get("quant")):
        raise ValueError(
            f"{path} was saved with quantized weights; tensor-parallel loading reads float checkpoints (each rank "
            "quantizes its own slices). Load the original float checkpoint with `quant` and tensor_parallel, or load "
            "this one with tp_size=1."
        )
    desc = parallel.read_description(cfg.checkpoint, cfg.base_dir) if cfg.checkpoint is not None else None
    device = torch.device("cpu") if cfg.keep_module_on_host else local_device()
    if cfg.dtype == AUTO and cfg._resolved_dtype is None:
        cfg.resolve_dtype(getattr(config, "dtype", None), device)  # config.json's dtype, as transformers reads it
    model = parallel.load_pretrained_tp(
        cls, path, config, parallel.tp_group_from_config(cfg.tensor_parallel), cfg.torch_dtype,
        grain=cfg.tensor_parallel.tp_grain_size, injection_policy=cfg.injection_policy, checkpoint=desc,
        attn_implementation=attn, device=device,
        ep_size=cfg.moe.expert_parallel_size if cfg.moe is not None else 1,
        on_loaded=quantize_slices(cfg.quant_settings) if cfg.quant_settings is not None else None,
    )
    model.config.name_or_path = path
    if os.path.isfile(os.path.join(path, "generation_config.json")) and getattr(model, "generation_config", None):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return apply_inference_config(model, cfg)
