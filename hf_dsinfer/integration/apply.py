"""The one place where a loaded model becomes an optimized one: shared by the quantizer and ``init_inference``."""

from __future__ import annotations

import os

import torch
from torch import nn

from ..log import warn_once
from .config import InferenceConfig

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
    from .. import parallel

    # Tensor parallelism: sets up the process group now, so a tp_size that does not divide the world fails early.
    parallel.tp_group_from_config(cfg.tensor_parallel)
    if cfg.checkpoint is not None:
        parallel.read_description(cfg.checkpoint, cfg.base_dir)  # the file exists and has only known keys


def apply_inference_config(model: nn.Module, cfg: InferenceConfig) -> nn.Module:
    """Apply ``cfg`` to a model whose weights are loaded, in place; returns the model.

    Records the config, sets eval mode and, with ``replace_with_kernel_inject`` True or ``"auto"``, validates a user
    ``injection_policy`` and swaps in fused layers (``hf_dsinfer.policies.inject``). Models without a policy keep
    HF's own modules (one warning), so their output is HF's.
    """
    from ..parallel import tp_requested

    ep_size = cfg.moe.expert_parallel_size if cfg.moe is not None else 1
    if ep_size > 1 and not tp_requested(cfg.tensor_parallel):
        raise ValueError(
            f"moe.ep_size={ep_size} needs tensor parallelism: expert parallelism places experts on the "
            f"tensor-parallel ranks, and there is one. Launch {ep_size}+ processes with tensor_parallel.tp_size a "
            "multiple of ep_size, or set moe.ep_size=1."
        )
    setattr(model, CONFIG_ATTR, cfg)
    from ..generation.threads import apply_threads

    apply_threads(cfg.threads)  # torch's CPU threads, process-wide (None: left as they are)
    model.eval()
    apply_tensor_parallel(model, cfg)
    quant = cfg.quant_settings
    if quant is not None:  # weight-only int8/int4: linears not already quantized at load (init_inference, AutoTP)
        from ..modules.quant_linear import QuantLinear
        from .quant_config import quantize_model_

        quantize_model_(model, quant)
        if not any(isinstance(m, QuantLinear) for m in model.modules()):
            warn_once(
                f"quant: {type(model).__name__} has no nn.Linear layers hf_dsinfer quantizes (e.g. GPT-2's Conv1D, "
                "MoE experts); its weights stay in the activation dtype."
            )
    if cfg.injects:  # True or "auto" (the default): same path; no policy -> HF's modules, one warning
        from ..policies import inject

        # validates injection_policy too; models without a policy warn once; a TP-split model injects per rank
        model = inject(model, cfg, tp_layout(model))
    from .. import parallel
    from ..generation import install_generate
    from ..policies import get_injection
    from ..policies.generic import get_generic

    if quant is not None:  # CPU: pack the quantized weights for torch's CPU ops once, before any step is compiled
        from ..modules.quant_linear import prepack_cpu

        prepack_cpu(model)
    record = get_injection(model)
    if record is not None:  # CPU: the fused layers' and the head's weights in one allocation (decoding reads faster)
        from ..modules.weight_arena import pack_into_arena

        pack_into_arena([*record.runtime.layers, *_head(model)])
    # the fast generate loop (greedy/sampling), per instance: fused layers, or HF's modules on the generic path
    install_generate(model, cfg, record or get_generic(model))
    if is_tensor_parallel(model):
        # The fast loop samples on every rank from the same gathered logits: rank 0's RNG state must reach all.
        parallel.sync_rng_before_generate(model, model._dsinfer_tp_group)
    return model


def _head(model: nn.Module) -> list[nn.Module]:
    """The model's LM head module (read whole at every decode step), where it has one; an untied input embedding is
    only gathered from, row by row, and stays where it is."""
    module = getattr(model, "get_output_embeddings", lambda: None)()
    return [module] if isinstance(module, nn.Module) else []


def tp_layout(model: nn.Module):
    """The :class:`~hf_dsinfer.policies.TPLayout` of a model split over more than one rank, else None."""
    if not is_tensor_parallel(model):
        return None
    from ..parallel import all_reduce_
    from ..parallel.apply import GROUP_ATTR, PLAN_ATTR
    from ..parallel.autotp import local_head_config
    from ..policies import TPLayout

    plan, group = getattr(model, PLAN_ATTR), getattr(model, GROUP_ATTR)
    counts = set(plan.local_heads.values())
    # One local head count for every layer is what AutoTP produces; otherwise policies keep the global config and
    # TPLayout.check explains the mismatch (HF's split modules stay).
    config = local_head_config(model.config, *counts.pop()) if len(counts) == 1 else None
    return TPLayout(
        heads=dict(plan.local_heads),
        row_parallel=frozenset(plan.row_parallel),
        column_parallel=frozenset(plan.column_parallel),
        reduce=lambda t: all_reduce_(t, group),
        config=config,
        split_norms=frozenset(plan.norms),
    )


def is_tensor_parallel(model: nn.Module) -> bool:
    """True when ``model`` was split over more than one rank."""
    from ..parallel import SINGLE

    return getattr(model, "_dsinfer_tp_group", SINGLE).size > 1


def apply_tensor_parallel(model: nn.Module, cfg: InferenceConfig) -> None:
    """Split ``model`` over the TP group in place (AutoTP), or load it from ``cfg.checkpoint``; then write the
    per-rank checkpoint when ``save_mp_checkpoint_path`` is set. A model already split (sharded loading) is kept."""
    from .. import parallel

    tp_cfg = cfg.tensor_parallel
    tp = parallel.tp_group_from_config(tp_cfg)
    if not parallel.is_sharded(model):
        if cfg.checkpoint is not None:
            # DeepSpeed's flow: the weights come from the description, whatever the model holds (meta is cheapest).
            desc = parallel.read_description(cfg.checkpoint, cfg.base_dir)
            device = torch.device("cpu") if cfg.keep_module_on_host else local_device()
            parallel.load_from_description(
                model.to("meta"), desc, tp, tp_cfg.tp_grain_size, cfg.injection_policy, device
            )
        elif any(p.is_meta for p in model.parameters()):
            raise ValueError("the model has weights on the meta device; pass checkpoint= (a checkpoint description).")
        elif tp.size > 1:
            ep_size = cfg.moe.expert_parallel_size if cfg.moe is not None else 1
            parallel.shard_model(model, tp, tp_cfg.tp_grain_size, cfg.injection_policy, ep_size=ep_size)
    if cfg.save_mp_checkpoint_path is not None:
        parallel.save_mp_checkpoint(
            model, tp, cfg.save_mp_checkpoint_path, str(cfg.torch_dtype).removeprefix("torch."), tp_cfg.tp_grain_size
        )


def get_inference_config(model: nn.Module) -> InferenceConfig | None:
    """The ``InferenceConfig`` applied to ``model`` (or to the model inside a peft / engine wrapper), if any."""
    for m in (model, getattr(model, "module", None), getattr(model, "base_model", None)):
        if m is not None and getattr(m, CONFIG_ATTR, None) is not None:
            return getattr(m, CONFIG_ATTR)
    return None


