"""The one place where a loaded model becomes an optimized one: shared by the quantizer and ``init_inference``."""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from .config import InferenceConfig

logger = logging.getLogger("hf_dsinfer")

CONFIG_ATTR = "_dsinfer_config"


def local_device() -> torch.device:
    """The device this process should run on: ``cuda:LOCAL_RANK`` (torchrun sets it) or the current CUDA device,
    else CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = os.environ.get("LOCAL_RANK")
    index = int(local_rank) if local_rank is not None else torch.cuda.current_device()
    return torch.device("cuda", index)


def check_dtype_supported(dtype: torch.dtype, device: torch.device) -> None:
    """Raise a clear error when ``device`` cannot compute in ``dtype`` (bf16 needs compute capability 8.0+)."""
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"dtype='bf16' was requested but {name} does not support bfloat16; "
            "use dtype='fp16' in the inference config."
        )


def check_supported(cfg: InferenceConfig) -> None:
    """Reject settings this version cannot honour, before any work is done (never silently ignore them)."""
    if cfg.tp_size > 1:
        raise ValueError(
            f"tensor_parallel.tp_size={cfg.tp_size}: tensor parallelism is not available in this version of "
            "hf_dsinfer yet; use tp_size=1."
        )
    if cfg.checkpoint is not None or cfg.save_mp_checkpoint_path is not None:
        raise ValueError(
            "checkpoint / save_mp_checkpoint_path (DeepSpeed checkpoint descriptions) are not supported by this "
            "version yet; load weights with from_pretrained(path) instead."
        )


def apply_inference_config(model: nn.Module, cfg: InferenceConfig) -> nn.Module:
    """Apply ``cfg`` to a model whose weights are loaded, in place; returns the model.

    Today this records the config, sets eval mode and (through the policies package, when it provides one) swaps in
    fused layers. Models without a policy keep HF's own modules, so their output is HF's.
    """
    setattr(model, CONFIG_ATTR, cfg)
    model.eval()
    if cfg.replace_with_kernel_inject:
        try:
            from ..policies import inject  # provided by the kernel-injection layer
        except ImportError:
            inject = None
        if inject is None:
            warn_once(
                "replace_with_kernel_inject=True: fused layers are not available in this build; running HF's own "
                "modules (output is identical, speed is HF's)."
            )
        else:
            model = inject(model, cfg)
    return model


def get_inference_config(model: nn.Module) -> InferenceConfig | None:
    """The ``InferenceConfig`` applied to ``model`` (or to the model inside a peft / engine wrapper), if any."""
    for m in (model, getattr(model, "module", None), getattr(model, "base_model", None)):
        if m is not None and getattr(m, CONFIG_ATTR, None) is not None:
            return getattr(m, CONFIG_ATTR)
    return None


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Log a warning once per process (unsupported cases fall back with one warning, not one per call)."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
