"""Reading a training model's *effective* weights: LoRA fused in, wrappers unwrapped, shards gathered.

:class:`TrainingWeights` answers one question for the Hybrid Engine: "what tensor does the plain HF parameter
``model.layers.3.self_attn.q_proj.weight`` hold, as the training model computes it right now?" Names are the ones
of the bare HF model (no peft ``base_layer``/``modules_to_save`` segments). The answer is a full (unsharded) tensor
that is only ever *read*: training weights, LoRA factors and optimizer state are never written.

* peft LoRA (``lora.Linear`` incl. GPT-2's ``Conv1D`` with ``fan_in_fan_out``, ``lora.Embedding``): the base weight
  plus ``scaling[a] * B[a] @ A[a]`` for every active adapter ``a`` in peft's order, the products computed in fp32.
  ``scaling`` is read from the layer, so ``use_rslora`` (``alpha / sqrt(r)``) and ``set_scale`` are honoured; dropout
  is the identity at inference. Adapters that are merged or disabled contribute nothing (as in peft's forward).
  LoRA variants (DoRA, aLoRA, ...) and other peft tuners are refused with an error naming them.
* DeepSpeed-Chat LoRA (``LinearLayer_LoRA``: ``lora_right_weight [in, r]``, ``lora_left_weight [r, out]``,
  ``lora_scaling``): ``W + lora_scaling * (right @ left)^T`` in fp32, nothing once ``fuse_lora`` is set.
* Any other module that holds parameters the plain architecture does not have (an unknown adapter) is refused by
  name (:meth:`TrainingWeights.check_modules`).
* peft ``modules_to_save``: the active adapter's copy of the module (or the original when none is active).
* FSDP2 (``fully_shard``): DTensor parameters are gathered with ``full_tensor()`` (a collective: every rank must
  refresh, in the same order, which the engine guarantees).
* DeepSpeed ZeRO-3: partitioned parameters (those with ``ds_id``) are gathered per module with
  ``deepspeed.zero.GatheredParameters`` (read-only, ``modifier_rank=None``). DeepSpeed is imported only then.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import torch
from torch import nn

try:  # DTensor is public from torch 2.4; the project requires newer, but keep the import failure-proof.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


class UnsupportedAdapterError(ValueError):
    """The training model uses an adapter the engine cannot fuse exactly into plain weights."""


def unwrap_training_model(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """``(hf_model, peft_model)``: strip DDP / DeepSpeed ``.module`` wrappers and peft's wrapper.

    ``hf_model`` is the transformers model (with LoRA layers inside when peft is used); ``peft_model`` the
    ``PeftModel`` or None.
    """
    while not hasattr(model, "config") and isinstance(getattr(model, "module", None), nn.Module):
        if type(model).__name__ == "FullyShardedDataParallel":
            raise ValueError(
                "FSDP1 (FullyShardedDataParallel) flattens parameters, which the Hybrid Engine cannot read per "
                "tensor; shard with FSDP2 (torch.distributed.fsdp.fully_shard, accelerate fsdp_version=2) instead."
            )
        model = model.module  # DistributedDataParallel, DeepSpeedEngine
    peft_model = None
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        peft_model = model
        model = model.get_base_model()
    return model, peft_model


def _is_lora_layer(module: nn.Module) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft absent: no LoRA layers can exist
        return False
    return isinstance(module, LoraLayer)


def _is_tuner_layer(module: nn.Module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return isinstance(module, BaseTunerLayer)


def _is_modules_to_save(module: nn.Module) -> bool:
    try:
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return False
    return isinstance(module, ModulesToSaveWrapper)


def _is_aux_wrapper(module: nn.Module) -> bool:
    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:
        return False
    return isinstance(module, AuxiliaryTrainingWrapper)


def is_deepspeed_chat_lora(module: nn.Module) -> bool:
    """DeepSpeed-Chat's ``LinearLayer_LoRA``: a Linear stand-in holding ``weight [out, in]``, ``lora_right_weight
    [in, r]``, ``lora_left_weight [r, out]``, ``lora_scaling`` and a ``fuse_lora`` flag."""
    return all(hasattr(module, a) for a in ("weight", "lora_right_weight", "lora_left_weight", "lora_scaling"))


def check_peft_model(peft_model: nn.Module | None) -> None:
    """Refuse peft methods that are not LoRA (prompt learning, IA3, LoHa, ...): they cannot become plain weights
    the fused layers run, and silently dropping them would generate with the wrong model."""
    if peft_model is None:
        return
    for name, cfg in peft_model.peft_config.items():
        ptype = str(getattr(cfg, "peft_type", "")).split(".")[-1].upper()
        if ptype != "LORA":
            raise UnsupportedAdapterError(
                f"adapter {name!r} is of type {ptype}: the Hybrid Engine fuses LoRA adapters only. Merge it into the "
                "base model first (merge_and_unload) or generate with the training model."
            )


class TrainingWeights:
    """Read-only view of a training model's effective HF-named weights (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.hf_model, self.peft_model = unwrap_training_model(model)
        check_peft_model(self.peft_model)
        self.gather_s = 0.0  # seconds spent gathering shards since the last reset_timer()

    # -- module resolution ------------------------------------------------------------------------------------------

    @staticmethod
    def _active_module(module: nn.Module) -> nn.Module:
        """The module peft's forward would run in place of a ``modules_to_save`` wrapper."""
        if _is_modules_to_save(module):
            active = list(module.active_adapters)
            if module.disable_adapters or not active or any(a not in module.modules_to_save for a in active):
                return module.original_module
            return module.modules_to_save[active[0]]
        if _is_aux_wrapper(module):
            raise UnsupportedAdapterError(
                f"{type(module).__name__} (e.g. peft trainable_token_indices) is not supported by the Hybrid Engine; "
                "use modules_to_save for the embedding instead."
            )
        return module

    def module_steps(self, path: str) -> list[tuple[dict, str, nn.Module]] | None:
        """:meth:`module`'s walk as ``(parent's _modules, key, child)`` steps, for callers that cache where a path
        leads and later check every step by identity; None where the walk meets a peft wrapper (which module it
        stands for depends on the active adapter) or a missing module."""
        steps: list[tuple[dict, str, nn.Module]] = []
        mod = self.hf_model
        for part in path.split(".") if path else []:
            child = mod._modules.get(part)
            if self._active_module(mod) is not mod or child is None:
                return None
            steps.append((mod._modules, part, child))
            mod = child
        return steps if self._active_module(mod) is mod else None

    def module(self, path: str) -> nn.Module:
        """The (effective) training module at HF path ``path`` ("" is the model itself)."""
        mod = self.hf_model
        for part in path.split(".") if path else []:
            mod = self._active_module(mod)
            child = mod._modules.get(part)
            if child is None:
                raise KeyError(f"the training model has no module {path!r} (missing {part!r})")
            mod = child
        return self._active_module(mod)

    # -- tensors ----------------------------------------------------------------------------------------------------

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a possibly sharded parameter (FSDP2 DTensor: all-gathered)."""
        if DTensor is not None and isinstance(tensor, DTensor):
            t0 = time.perf_counter()
            out = tensor.full_tensor()
            self.gather_s += time.perf_counter() - t0
            return out
        return tensor

    def get(self, name: str) -> torch.Tensor:
        """Effective value of HF parameter ``name`` (e.g. ``model.layers.0.mlp.up_proj.weight``); read only."""
        path, _, leaf = name.rpartition(".")
        mod = self.module(path)
        if _is_lora_layer(mod):
            return self._lora_value(mod, leaf, name)
        if leaf == "weight" and is_deepspeed_chat_lora(mod):
            return self._deepspeed_chat_lora_value(mod)
        if _is_tuner_layer(mod):
            raise UnsupportedAdapterError(
                f"{name}: {type(mod).__name__} is a peft adapter layer the Hybrid Engine cannot fuse (LoRA only)."
            )
        value = getattr(mod, leaf, None)
        if not isinstance(value, torch.Tensor):
            raise KeyError(f"the training model has no tensor {name!r}")
        return self.full(value.detach())

    def buffer(self, name: str) -> torch.Tensor | None:
        """A buffer of the training model (rotary frequencies), or None when absent."""
        path, _, leaf = name.rpartition(".")
        try:
            value = getattr(self.module(path), leaf, None)
        except KeyError:
            return None
        return value if isinstance(value, torch.Tensor) else None

    def _active_lora(self, mod: nn.Module, name: str) -> list[str]:
        """Adapters whose delta peft's forward adds on top of the base layer right now."""
        if mod.merged:
            if mod.disable_adapters:
                raise UnsupportedAdapterError(
                    f"{name}: adapters are merged into the base weight and disabled at the same time; peft would "
                    "unmerge on the next forward. Call unmerge_adapter() (or enable the adapters) first."
                )
            return []  # merged adapters already live in the base weight; the forward adds nothing more
        if mod.disable_adapters:
            return []
        factors = mod.lora_A if hasattr(mod, "lora_A") and len(mod.lora_A) else mod.lora_embedding_A
        active = [a for a in mod.active_adapters if a in factors]
        for a in active:
            variant = getattr(mod, "lora_variant", {}).get(a)
            if variant is not None or getattr(mod, "use_dora", {}).get(a, False):
                kind = type(variant).__name__ if variant is not None else "DoRA"
                raise UnsupportedAdapterError(
                    f"{name}: adapter {a!r} uses the LoRA variant {kind}, which the Hybrid Engine does not fuse; "
                    "only plain LoRA (W + scaling * B @ A) is fused exactly."
                )
        return active

    def _lora_value(self, mod: nn.Module, leaf: str, name: str) -> torch.Tensor:
        from peft.tuners.lora import layer as lora_layer

        base_layer = mod.get_base_layer()
        base = getattr(base_layer, leaf, None)
        if not isinstance(base, torch.Tensor):
            raise KeyError(f"the training model has no tensor {name!r}")
        base = self.full(base.detach())
        active = self._active_lora(mod, name)
        if not active:
            return base
        if leaf == "bias":  # lora_bias=True: lora_B carries a bias, scaled like the weight delta
            out = base.float()
            for a in active:
                b = mod.lora_B[a].bias if hasattr(mod, "lora_B") and a in mod.lora_B else None
                if b is not None:
                    out = out + self.full(b.detach()).float() * mod.scaling[a]
            return out
        if leaf != "weight":
            return base
        out: torch.Tensor | None = None  # base + the scaled deltas, built in place in the first delta's buffer
        for a in active:
            if isinstance(mod, lora_layer.Embedding):
                a_w = self.full(mod.lora_embedding_A[a].detach()).float()  # [r, num_embeddings]
                b_w = self.full(mod.lora_embedding_B[a].detach()).float()  # [dim, r]
                delta = (b_w @ a_w).t()  # [num_embeddings, dim], like the embedding table
            elif isinstance(mod, lora_layer.Linear):
                a_w = self.full(mod.lora_A[a].weight.detach()).float()  # [r, in]
                b_w = self.full(mod.lora_B[a].weight.detach()).float()  # [out, r]
                delta = b_w @ a_w  # [out, in]
                if mod.fan_in_fan_out:  # GPT-2 Conv1D stores [in, out]
                    delta = delta.t()
            else:
                raise UnsupportedAdapterError(
                    f"{name}: LoRA on {type(mod).__name__} is not fused by the Hybrid Engine (Linear, Conv1D and "
                    "Embedding are)."
                )
            # The same operations as peft's merge (delta * scaling, then added; a sum's operand order does not change
            # an IEEE result, and a bf16/fp16 base widens exactly), so fp32 results are bitwise equal. In place in
            # the first delta's fresh buffer: one weight-sized allocation, not three.
            delta.mul_(mod.scaling[a])
            out = delta.add_(base) if out is None else out.add_(delta)
        return out

    def _deepspeed_chat_lora_value(self, mod: nn.Module) -> torch.Tensor:
        """``W + scaling * (right @ left)^T`` for DeepSpeed-Chat's LoRA layer (its forward adds
        ``x @ right @ left * scaling``); nothing is added once ``fuse_lora_weight()`` has folded it into ``W``."""
        base = self.full(mod.weight.detach())
        if getattr(mod, "fuse_lora", False):
            return base
        right = self.full(mod.lora_right_weight.detach()).float()  # [in, r]
        left = self.full(mod.lora_left_weight.detach()).float()  # [r, out]
        # fp32 products, then (delta * scaling) added once: the order used for peft's LoRA above, in place too.
        delta = (right @ left).t()  # [out, in]: a view of a fresh product
        return delta.mul_(float(mod.lora_scaling)).add_(base)

    def check_modules(self, reference: nn.Module) -> None:
        """Refuse training modules that compute something the plain architecture cannot hold.

        ``reference`` is the plain HF model built from the same config (the inference copy before injection). Each
        module of it is compared with its training counterpart one level at a time: the counterpart must own the
        same direct parameters (none extra, none missing for modules that own some) and no child holding parameters
        that the reference module does not have as a child too. The children the reference does have are checked
        on their own turn, so a module owning parameters next to sub-modules (Mamba's mixer: ``A_log``, ``D`` and
        its projections) is plain. Adapters the engine fuses (peft LoRA, DeepSpeed-Chat LoRA) are let through;
        anything else (a Linear subclass with extra factors, a wrapper around the Linear, an adapter attached next
        to an MLP's projections) would be silently dropped from the generated model: refused by name.
        """
        for path, ref in reference.named_modules():
            try:
                mod = self.module(path)
            except KeyError:
                continue  # the refresh names the missing parameter
            if _is_tuner_layer(mod):
                continue  # peft: LoRA is fused, other tuners are refused by name in get()
            own = {n for n, _ in ref.named_parameters(recurse=False)}
            trained_own = {n for n, _ in mod.named_parameters(recurse=False)}
            ref_children = {n for n, _ in ref.named_children()}
            # Parameters under children the architecture does not have at this place: an adapter's own modules.
            nested = sorted(
                f"{child_name}.{n}"
                for child_name, child in mod.named_children()
                if child_name not in ref_children
                for n, _ in child.named_parameters()
            )
            extra = sorted(trained_own - own) + nested
            if is_deepspeed_chat_lora(mod):
                extra = [n for n in extra if n not in ("lora_right_weight", "lora_left_weight")]
            if extra or not own <= trained_own:
                raise UnsupportedAdapterError(
                    f"{path or 'the model'}: the training model holds a {type(mod).__module__}.{type(mod).__name__} "
                    f"with parameters {sorted(trained_own) + nested} where the architecture has {type(ref).__name__} "
                    f"{sorted(own)}; an adapter the Hybrid Engine does not know cannot be fused into the inference "
                    "copy (it would generate from a different model). Use peft LoRA or DeepSpeed-Chat LoRA, or merge "
                    "the adapter into the weights before building the engine."
                )

    # -- gathering (ZeRO-3) -----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered(self, module: nn.Module) -> Iterator[None]:
        """Inside: ZeRO-3 partitioned parameters of ``module`` hold their full data (read only). FSDP2 needs nothing
        here (:meth:`full` gathers tensor by tensor, which keeps the peak at one tensor)."""
        if "deepspeed" not in sys.modules:  # only deepspeed partitions parameters: none to gather, no module walk
            yield
            return
        params = [p for p in module.parameters() if hasattr(p, "ds_id")]
        if not params:
            yield
            return
        try:
            import deepspeed
        except ImportError as e:  # pragma: no cover - parameters with ds_id imply deepspeed is installed
            raise RuntimeError("parameters are ZeRO-3 partitioned but deepspeed cannot be imported") from e
        t0 = time.perf_counter()
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            self.gather_s += time.perf_counter() - t0
            yield

    # -- change tracking --------------------------------------------------------------------------------------------

    def fingerprint(self) -> tuple:
        """A cheap key that changes whenever a tracked in-place update of a weight happens (no data is read).

        It combines every parameter's autograd version counter (optimizers update in place and bump it) with the
        LoRA routing state (active adapters, scaling, merged/disabled). Writes through ``.data`` escape it: that is
        why ``refresh="always"`` is the engine's default.
        """
        versions = tuple(p._version for p in self.hf_model.parameters())
        lora = tuple(
            (tuple(m.active_adapters), tuple(sorted(m.scaling.items())), m.merged, m.disable_adapters)
            for m in self.hf_model.modules()
            if _is_lora_layer(m)
        )
        chat = [m for m in self.hf_model.modules() if is_deepspeed_chat_lora(m)]
        ds_chat = tuple((m.lora_scaling, getattr(m, "fuse_lora", False)) for m in chat)
        return versions, lora, ds_chat
