"""The transformers ``HfQuantizer`` for ``quant_method="dsinfer"``: how ``from_pretrained`` applies an
``InferenceConfig``.

transformers drives it: ``update_dtype`` picks the load dtype, ``update_device_map`` the device, and
``_process_model_after_weight_loading`` hands the loaded model to ``apply_inference_config``. Weights are saved as
plain HF tensors, so a saved model also loads, unoptimized but correct, where hf_dsinfer is not installed.

With ``quant`` (weight-only int8/int4): quantizable linears become :class:`QuantLinear` placeholders before loading
and each checkpoint tensor is quantized as it is read (``get_quantize_ops``). A quantized model saves its quantized
tensors under HF's names, flattened, with ``*_scales``/``*_zeros`` beside them: it reloads quantized with hf_dsinfer,
and transformers alone refuses it (size mismatch) rather than loading integers as float weights.

What transformers forces on any model with a quantizer (documented in docs/usage.md): ``.half()`` / ``.float()``
raise (use ``.to(dtype)`` or the config's ``dtype``), and Trainer refuses full fine-tuning without adapters.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.quantizers.base import HfQuantizer

from ..modules.quant_linear import QuantLinear, flat_for_save, tied_table_for_save
from .apply import apply_inference_config, check_dtype_supported, check_supported, local_device
from .config import AUTO, InferenceConfig
from .quant_config import finalize_quantized, quantize_on_load_op, resolve_load_quant, swap_placeholders


class DsInferQuantizer(HfQuantizer):
    """Applies an :class:`InferenceConfig` while transformers loads a model."""

    requires_calibration = False

    def __init__(self, quantization_config: InferenceConfig, **kwargs: Any):
        super().__init__(quantization_config, **kwargs)
        self.quantization_config: InferenceConfig = quantization_config
        # Weight-only quantization of this load (integration/quant_config.py); the checkpoint holds quantized
        # tensors only when it was saved quantized (a saved float model has a dsinfer config too).
        self.quant = resolve_load_quant(quantization_config)
        self.pre_quantized = bool(self.pre_quantized) and quantization_config._checkpoint_quant is not None

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        cfg = self.quantization_config
        check_supported(cfg)
        if cfg.dtype != AUTO:  # "auto" is resolved in update_dtype, to a dtype the device supports
            check_dtype_supported(cfg.torch_dtype, self._device())

    def _device(self) -> torch.device:
        return torch.device("cpu") if self.quantization_config.keep_module_on_host else local_device()

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # An explicit config dtype wins (the from_pretrained hook has already rejected a conflicting `dtype=`).
        # "auto": transformers passes the checkpoint's dtype (or the user's `dtype=`, which the hook has already
        # recorded as the resolution, so it is kept as given).
        cfg = self.quantization_config
        if cfg.dtype == AUTO and cfg._resolved_dtype is not None:
            return cfg._resolved_dtype
        return cfg.resolve_dtype(dtype, self._device())

    def update_device_map(self, device_map: dict[str, Any] | None) -> dict[str, Any] | None:
        # DeepSpeed puts the model on this rank's GPU; do the same when the user gave no device_map.
        if device_map is None and not self.quantization_config.keep_module_on_host and torch.cuda.is_available():
            return {"": local_device().index}
        return device_map

    def param_needs_quantization(self, model: Any, param_name: str, **kwargs: Any) -> bool:
        # Only the buffers of quantized placeholders (quant enabled): everything else loads as HF stores it and
        # fused layers re-pack it after loading. True also exempts them from transformers' shape check.
        if self.quant is None:
            return False
        owner, _, attr = param_name.rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            return False
        return isinstance(module, QuantLinear) and attr in ("weight", "weight_scales", "weight_zeros")

    def get_quantize_ops(self) -> Any:
        return quantize_on_load_op(self)

    def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        if self.quant is not None:  # quantizable linears become quantized placeholders (still on meta)
            dtype = kwargs.get("dtype") or self.quantization_config.torch_dtype
            swap_placeholders(model, self.quant, dtype, self.pre_quantized)
        return model

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        if self.quant is not None:
            finalize_quantized(model)
        return apply_inference_config(model, self.quantization_config)

    def get_state_dict_and_metadata(self, model: Any) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
        """The state dict ``save_pretrained`` writes: plain HF layout, so the checkpoint loads anywhere.

        Injected models hold packed tensors (``qkv``, ``gate_up``) under fused names; their policy splits them back
        under the HF names. Other models need no change (None: transformers takes ``model.state_dict()``).
        """
        from ..policies import hf_state_dict, is_injected

        if is_injected(model):
            sd = hf_state_dict(model)
        elif self.quant is not None or any(isinstance(m, QuantLinear) for m in model.modules()):
            sd = model.state_dict()
        else:
            return None, {}
        # quantized weights flat: transformers alone refuses them (no silent garbage); a quantized tied head is saved
        # as the embedding's float table, as a tied HF model saves it
        return flat_for_save(tied_table_for_save(model, sd)), {}

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # adapters (peft) train on top of it

    @property
    def is_qat_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True  # keep transformers' own generate auto-compile available
