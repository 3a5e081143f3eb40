"""``init_inference`` and ``InferenceEngine``: DeepSpeed's entry point for a model that is already built."""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch import nn

from .apply import CONFIG_ATTR, apply_inference_config, check_dtype_supported, check_supported, local_device
from .config import InferenceConfig


class InferenceEngine(nn.Module):
    """Wraps a model optimized by :func:`init_inference`.

    ``engine(...)`` runs the model's forward, ``engine.generate(...)`` its ``generate``, ``engine.module`` is the
    model itself. Attributes the engine does not define (``config``, ``device``, ``generation_config``, ...) are read
    from the model, so the engine can stand in for it. ``profile_model_time()`` turns on per-forward timing and
    ``model_times()`` returns (and clears) the measured milliseconds, as in DeepSpeed.
    """

    def __init__(self, model: nn.Module, config: InferenceConfig):
        super().__init__()
        self.module = model
        self.inference_config = config
        self._profile = False
        self._use_cuda_events = False
        self._times: list[Any] = []  # floats (ms) or (start, end) CUDA event pairs, resolved in model_times()

    # -- DeepSpeed's profiling API -----------------------------------------------------------------------------

    def profile_model_time(self, use_cuda_events: bool = True) -> None:
        """Record the wall time of every forward (and generate) call from now on.

        With ``use_cuda_events`` and a CUDA model the time is measured with CUDA events (no sync per call);
        otherwise with a synchronized host clock.
        """
        self._profile = True
        self._use_cuda_events = use_cuda_events and self._device().type == "cuda"

    def model_times(self) -> list[float]:
        """Milliseconds of each profiled call since the last read; the list is cleared when read."""
        if self._use_cuda_events and self._times:
            torch.cuda.synchronize()
        out = [t if isinstance(t, float) else t[0].elapsed_time(t[1]) for t in self._times]
        self._times = []
        return out

    def _timed(self, fn, *args: Any, **kwargs: Any) -> Any:
        if not self._profile:
            return fn(*args, **kwargs)
        if self._use_cuda_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self._times.append((start, end))
            return out
        self._sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self._sync()
        self._times.append((time.perf_counter() - t0) * 1e3)
        return out

    def _device(self) -> torch.device:
        p = next(self.module.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _sync(self) -> None:
        if self._device().type == "cuda":
            torch.cuda.synchronize()

    # -- model API -----------------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward (timed when profiling is on)."""
        return self._timed(self.module, *args, **kwargs)

    @torch.no_grad()
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate``.

        When profiling, ``model_times()`` gets one entry per forward step of the call (prefill, then each decode
        step), as DeepSpeed's per-forward timing does; generate paths that cannot time steps add the call's total.
        """
        if not hasattr(self.module, "generate"):
            raise AttributeError(f"{type(self.module).__name__} has no generate(); call the engine's forward instead.")
        if not self._profile:
            return self.module.generate(*args, **kwargs)
        from ..generation.stats import last_generate_stats, step_timing

        before, n_times = last_generate_stats(self.module), len(self._times)
        with step_timing():
            out = self._timed(self.module.generate, *args, **kwargs)
        stats = last_generate_stats(self.module)
        if stats is not None and stats is not before and stats.step_ms:
            self._times[n_times:] = list(stats.step_ms)  # the per-step times replace the call's total
        return out

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """Optimize an already built model for inference, DeepSpeed's way: ``init_inference(model, config, **kwargs)``.

    ``config`` is an :class:`InferenceConfig`, a dict, a JSON file path or None; ``kwargs`` are config fields. A
    field given in both with different values raises ``ValueError`` naming it. The model is cast to the config's
    ``dtype``, moved to this rank's GPU when there is one (unless ``keep_module_on_host``), and optimized in place.
    """
    if isinstance(model, InferenceEngine):
        raise ValueError("init_inference got an InferenceEngine; pass engine.module to re-initialize it.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"init_inference needs a torch.nn.Module, got {type(model).__name__}.")
    cfg = InferenceConfig.from_any(config, **kwargs)
    check_supported(cfg)
    first = next(model.parameters(), None)
    device = (first.device if first is not None else torch.device("cpu")) if cfg.keep_module_on_host else local_device()
    floating = next((p for p in model.parameters() if p.is_floating_point()), None)
    cfg.resolve_dtype(floating.dtype if floating is not None else None, device)  # dtype="auto": the model's own
    check_dtype_supported(cfg.torch_dtype, device)
    applied = getattr(model, CONFIG_ATTR, None)
    if applied is not None:  # optimized before (init_inference or from_pretrained): only the same settings are a no-op
        _check_same_settings(applied, cfg)
        return InferenceEngine(model, applied)
    from ..parallel import tp_requested

    if tp_requested(cfg.tensor_parallel) or cfg.checkpoint is not None:
        # Split (or load) on the host first, so the device never holds the full model. A meta model is cast too: the
        # loader materializes each parameter in the dtype its placeholder has.
        model.to(dtype=cfg.torch_dtype)
        model = _apply(model, cfg)
        model.to(device=device)
        _save_in_hf_layout(model)
        return InferenceEngine(model, cfg)
    # transformers' PreTrainedModel.to refuses dtype casts only for other quantization methods, never ours.
    model.to(device=device, dtype=cfg.torch_dtype)
    model = _apply(model, cfg)
    _save_in_hf_layout(model)
    return InferenceEngine(model, cfg)


def _apply(model: nn.Module, cfg: InferenceConfig) -> nn.Module:
    """``apply_inference_config``; when it fails the model is not marked optimized, so a corrected call can run."""
    try:
        return apply_inference_config(model, cfg)
    except BaseException:
        model.__dict__.pop(CONFIG_ATTR, None)
        raise


def _resolved_dtype(cfg: InferenceConfig) -> str:
    try:
        return str(cfg.torch_dtype).removeprefix("torch.")
    except RuntimeError:  # dtype="auto" never resolved
        return cfg.dtype


def _check_same_settings(applied: InferenceConfig, cfg: InferenceConfig) -> None:
    """Raise ``ValueError`` naming every setting in which ``cfg`` differs from the config ``applied`` before.

    The fused layers, static KV cache, rotary table, graphs and TP split were built for the applied values; they
    cannot be rebuilt in place, and silently keeping them while reporting the new values would be wrong.
    """
    old, new = applied.to_dict(), cfg.to_dict()
    old["dtype"], new["dtype"] = _resolved_dtype(applied), _resolved_dtype(cfg)  # "auto" compared as resolved
    changed = [f"{k}={new[k]!r} (applied: {old[k]!r})" for k in sorted(new) if old.get(k) != new[k]]
    if changed:
        raise ValueError(
            f"init_inference: this model was already optimized with other settings: {'; '.join(changed)}. An "
            "optimized model cannot be re-configured in place; load or build the model again and call "
            "init_inference once with the settings you want."
        )


def _save_in_hf_layout(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` write plain HF tensors (this instance only).

    ``from_pretrained`` attaches our transformers quantizer, whose ``get_state_dict_and_metadata`` un-packs the fused
    tensors at save time; a model given to ``init_inference`` has no quantizer, so without this its checkpoint would
    hold fused names (``qkv``, ``gate_up``) that nothing can load. The checkpoint carries no inference config: it
    reloads as the plain HF model it came from. Tensor-parallel models keep their refusal (``parallel.finish``).
    """
    from ..policies import hf_state_dict, is_injected

    save = getattr(model, "save_pretrained", None)
    if save is None or not is_injected(model) or "save_pretrained" in model.__dict__:
        return
    if getattr(model, "hf_quantizer", None) is not None:
        return

    @functools.wraps(save)
    def save_pretrained(save_directory: Any, *args: Any, state_dict: dict | None = None, **kwargs: Any) -> Any:
        return save(save_directory, *args, state_dict=hf_state_dict(model) if state_dict is None else state_dict,
                    **kwargs)

    model.save_pretrained = save_pretrained
