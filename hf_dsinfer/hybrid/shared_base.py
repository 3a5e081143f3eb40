"""No second copy: the inference copy and the training model share the weights' storage.

When a training weight is frozen (peft LoRA's base layers, or ``requires_grad=False``) and the inference copy holds it
in the same dtype, the copy's buffer (e.g. a row slice of the fused qkv / gate_up weight) is filled once with the base
value and the training parameter's ``.data`` becomes a *view* of it: one storage serves both models, the training
model's old one is freed. Nothing ever writes the shared storage again (a frozen weight does not change).

Full fine-tuning (a plain transformers model, no peft): a *trainable* weight is shared the same way, so the optimizer's
in-place updates land in the inference buffers themselves and a refresh copies nothing (on SmolLM2 the copy was 307 ms
of a ~720 ms switch, and the copy was as large as the model). Only weights that own their storage whole are taken: a
parameter that is a view into someone else's flat buffer (DeepSpeed ZeRO-1/2, Megatron-style contiguous grads, a
second engine) keeps being copied, since rebinding it would cut it off from the buffer its owner updates.

A training parameter whose ``.data`` is rebound after sharing (``model.to(...)``, ``load_state_dict(assign=True)``,
another engine taking it over) no longer writes the inference buffer: every refresh checks the addresses, and such a
tensor is copied from then on (one warning naming it), never silently stale.

LoRA stays out of the shared base: a fused linear with adapted parts becomes a :class:`LoRALinear`, which adds the
delta as a side path, ``y = x W^T + (x A^T) B^T`` with ``A [R, in]`` the active adapters' ``lora_A`` stacked over every
adapted part and ``B [out, R]`` block-diagonal (each part's ``lora_B`` times its scaling in its own rows). Why a side
path and not a fused copy of the adapted projections: with LoRA on every linear layer (the common RL setup) every
projection is adapted, so a fused copy is the full second copy again; the side path holds ``R (in + out)`` values
per linear (a few % of ``in x out`` at r=16) and costs two skinny GEMMs per linear in a decode step, in persistent
buffers that each refresh overwrites in place (CUDA graphs and the compiled CPU step stay valid).

A *frozen* weight without LoRA in another dtype than the inference copy's (an fp32 training model with a bf16 copy)
cannot share storage; it is **cast once** instead: its slice of the copy is filled at build and never rewritten by a
refresh (it does not change). Every refresh checks that the training tensor is the same, at the same address, with the
same version counter (an in-place write such as ``load_state_dict`` bumps it) and casts it again otherwise. A frozen
weight *with* LoRA in another dtype keeps ``W + BA`` fused into the copy at each refresh: the copy exists either way,
and a side path over a cast base was slower (SmolLM2, LoRA r=16 on every linear, bf16 copy of an fp32 model, 32 rows,
48 new tokens, 2 threads: generate 2.65 s + switch 24 ms, against 2.00-2.07 s + 129-130 ms fused).

Not shared (that tensor keeps its copy, refreshed as before; one info log says why where it is not the above): a
trainable tensor of a peft model (``modules_to_save``) or of a parameter that does not own its storage,
DeepSpeed-Chat LoRA layers (the delta is fused into the copy), a trainable or adapted tensor in another dtype than the
inference copy's, LoRA on a tensor without a side path (embedding, LM head), a source that is not a plain row slice (a
transposed Conv1D weight), a policy with its own ``pack_into``, tensor parallelism, a quantized copy, sharded (FSDP2 /
ZeRO-3) parameters, another device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..log import logger
from ..modules.linear import Linear
from ..policies.base import Cat, Param, Policy, as_source
from .weights import DTensor, _is_lora_layer, is_deepspeed_chat_lora

_LOGGED: set[str] = set()


def _once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.info("hf_dsinfer HybridEngine: %s", reason)


class LoRALinear(Linear):
    """A fused linear over a shared base weight, with LoRA as a side path (see the module docstring).

    ``lora_a [R, in]``, ``lora_b [out, R]`` (scaling folded in) are persistent buffers of the inference dtype.
    """

    def __init__(self, base: Linear, rank: int):
        super().__init__(base.weight, base.bias, base.reduce)
        w = base.weight
        self.register_buffer("lora_a", torch.zeros(rank, w.shape[1], dtype=w.dtype, device=w.device))
        self.register_buffer("lora_b", torch.zeros(w.shape[0], rank, dtype=w.dtype, device=w.device))

    def forward(self, x: torch.Tensor, defer_reduce: bool = False) -> torch.Tensor:
        y = super().forward(x, defer_reduce)  # [..., out]
        return y + (x @ self.lora_a.t()) @ self.lora_b.t()  # [..., R] -> [..., out]


def _parts(src: Any) -> list[str] | None:
    """Names of a source's row slices, in order, or None when it is not made of plain row slices."""
    src = as_source(src)
    if isinstance(src, Param):
        return [src.name]
    if isinstance(src, Cat) and all(isinstance(p, Param) for p in src.parts):
        return [p.name for p in src.parts]
    return None


#: The modules from the training model down to the one holding a parameter: ``(parent's _modules, key, child)``
#: steps, the holder, and the parameter's name in it.
Chain = tuple[list[tuple[dict, str, nn.Module]], nn.Module, str]


def _chain(weights: Any, name: str) -> Chain | None:
    """How HF name ``name`` resolves to the training model's base parameter, as identity-checkable steps
    (:meth:`.weights.TrainingWeights.module_steps`, then peft's ``get_base_layer()``); None where that cannot be
    cached (a ``modules_to_save`` wrapper on the way)."""
    path, _, leaf = name.rpartition(".")
    steps = weights.module_steps(path)
    if steps is None:
        return None
    mod = steps[-1][2] if steps else weights.hf_model
    if _is_lora_layer(mod):  # peft's get_base_layer(): down the base_layer submodules
        while isinstance(mod._modules.get("base_layer"), nn.Module):
            steps.append((mod._modules, "base_layer", mod._modules["base_layer"]))
            mod = mod._modules["base_layer"]
    return steps, mod, leaf


def _intact(chain: Chain, base: torch.Tensor) -> bool:
    """Every step of ``chain`` still holds the same module and its holder still holds ``base`` under its name."""
    steps, holder, leaf = chain
    return all(d.get(k) is c for d, k, c in steps) and holder._parameters.get(leaf) is base


def _base_param(weights: Any, name: str) -> tuple[torch.Tensor | None, nn.Module | None]:
    """The training model's *base* parameter behind HF name ``name`` and its LoRA layer (or None)."""
    path, _, leaf = name.rpartition(".")
    mod = weights.module(path)
    if _is_lora_layer(mod):
        return getattr(mod.get_base_layer(), leaf, None), mod
    return getattr(mod, leaf, None), None


@dataclass
class _LoRAPlan:
    """Where each active adapter's factors go in the side buffers: ``a_dst[i] <- a_src[i]`` (rows of ``lora_a``);
    B (a block of ``lora_b``) times its scaling: ``b_dst[j] <- b_src[j]`` (scaling 1) or
    ``b_scaled_dst[k] <- b_scaled_src[k] * scales[k]``."""

    a_dst: list[torch.Tensor] = field(default_factory=list)
    a_src: list[torch.Tensor] = field(default_factory=list)
    b_dst: list[torch.Tensor] = field(default_factory=list)
    b_src: list[torch.Tensor] = field(default_factory=list)
    b_scaled_dst: list[torch.Tensor] = field(default_factory=list)
    b_scaled_src: list[torch.Tensor] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    sharded: bool = False  # a factor is a DTensor: gathered at each refresh


class SharedBase:
    """Which inference tensors share the training weights, and the LoRA side paths (built once, after the first
    refresh).

    ``shared``: ids of the inference parameters the engine's refresh skips: those whose storage the training model
    uses, and frozen ones cast once (``cast``). ``trainable``: the subset the optimizer updates (full fine-tuning): not
    copied either, but re-packed at each refresh (:func:`.memory.repack`). ``lora``: ``(LoRALinear, [(row offset,
    training LoRA layer)])`` per side path.
    """

    def __init__(self, engine: Any, infer: nn.Module, record: Any):
        self.shared: set[int] = set()
        self.trainable: set[int] = set()
        self.lora: list[tuple[LoRALinear, list[tuple[int, nn.Module]]]] = []
        # (inference param, row offset, HF name, training param, the address it must keep, how the name resolves to
        # it: None where that must be walked each time) for every shared slice
        self.links: list[tuple[torch.Tensor, int, str, torch.Tensor, int, Chain | None]] = []
        self.broken: list[tuple[torch.Tensor, int, str]] = []  # links cut since: copied at each refresh, by name
        # (inference param, row offset, HF name, training param, its address, its version) for every slice cast once
        self.cast: list[list[Any]] = []
        self.cast_stale = False  # set by sleep(): the next refresh casts every slice again
        # The LoRA side paths' copy plan (see refresh_lora) and what it was built for; None: build it at the next one
        self._lora_plan: _LoRAPlan | None = None
        self._lora_key: list | None = None
        self._weights = engine.weights
        self.bytes_shared = 0
        self.plain_model = engine.weights.peft_model is None
        w = engine.weights
        policy_pack = type(record.policy).pack_into
        if policy_pack is not Policy.pack_into:
            _once(f"{type(record.policy).__name__} re-packs with its own pack_into: the base weights are copied")
            return
        train_layers = w.module(record.layers_prefix)
        for i, wmap in enumerate(record.weight_maps):
            layer = record.runtime.layers[i]
            prefix = f"{record.layers_prefix}.{i}."
            for fused_name, src in wmap.items():
                if src is not None:
                    self._share_fused(w, layer, fused_name, src, prefix, train_layers[i])
        for name, param in engine._plain:
            base, lora = _base_param(w, name)
            if lora is None and self._can_share(name, base, param, w):
                self._adopt(param, [base], [name])
            elif lora is None and self._can_cast(name, base, param, w):
                self._cast_once(param, [base], [name])

    # -- deciding --------------------------------------------------------------------------------------------------

    @staticmethod
    def _whole_weight(name: str, base: Any, w: Any) -> bool:
        """``base`` is a whole tensor whose value is the weight (what sharing and casting once both need)."""
        if not isinstance(base, torch.Tensor) or type(base).__name__ == "DTensor" or hasattr(base, "ds_id"):
            return False  # sharded (FSDP2 / ZeRO-3): gathered at each refresh, nothing to share or cast once
        # DeepSpeed-Chat LoRA: its effective weight is W + the delta: the fused copy holds that, not W
        return not is_deepspeed_chat_lora(w.module(name.rpartition(".")[0]))

    def _can_share(self, name: str, base: Any, param: torch.Tensor, w: Any) -> bool:
        if not self._whole_weight(name, base, w):
            return False
        if base.requires_grad and not self._owns_storage(base):
            _once(f"{name} is trainable and a view into a larger storage (a flat optimizer buffer?) or belongs to a "
                  "peft model: copied at each refresh, not shared")  # fmt: skip
            return False
        if base.dtype != param.dtype or base.device != param.device:
            if not self._castable(base, param):
                _once(f"{name}: the training weight is {base.dtype} on {base.device}, the inference copy "
                      f"{param.dtype} on {param.device}; copied at each refresh, not shared")  # fmt: skip
            return False
        return True

    @staticmethod
    def _castable(base: torch.Tensor, param: torch.Tensor) -> bool:
        """A frozen tensor in another dtype on the copy's device: cast once (see the module doc)."""
        return not base.requires_grad and base.device == param.device and base.dtype != param.dtype

    def _can_cast(self, name: str, base: Any, param: torch.Tensor, w: Any) -> bool:
        return self._whole_weight(name, base, w) and self._castable(base, param)

    def _owns_storage(self, base: torch.Tensor) -> bool:
        """A trainable tensor of a plain model that is its storage, whole (nothing else reads or writes through it)."""
        storage = base.untyped_storage()
        return (
            self.plain_model
            and base.is_contiguous()
            and base.storage_offset() == 0
            and storage.nbytes() == base.numel() * base.element_size()
        )

    def _share_fused(self, w: Any, layer: nn.Module, fused_name: str, src: Any, prefix: str, train: nn.Module) -> None:
        names = _parts(src)
        param = layer.get_parameter(fused_name)
        if names is None:
            _once(f"{fused_name} is not made of plain row slices ({as_source(src)!r}): copied, not shared")
            return
        bases, loras, cast = [], [], []
        for n in names:
            base, lora = _base_param(w, prefix + n)
            cast.append(self._can_cast(prefix + n, base, param, w))
            if not cast[-1] and not self._can_share(prefix + n, base, param, w):
                return
            bases.append(base)
            loras.append(lora)
        if any(cast) and not all(cast):
            return  # parts of one fused tensor shared and cast: keep the copy
        if sum(b.shape[0] for b in bases) != param.shape[0] or any(b.shape[1:] != param.shape[1:] for b in bases):
            return
        active = [(lo, w._active_lora(lo, prefix + n)) if lo is not None else (None, []) for lo, n in zip(loras, names)]
        adapted = [(lo, a) for lo, a in active if a]
        if any(lo.lora_B[a].bias is not None for lo, acts in adapted for a in acts):
            return  # lora_bias=True: the bias delta has no side path; the tensor keeps its copy
        if adapted and not fused_name.endswith(".weight"):
            return  # LoRA on a bias (lora_bias): not a side path; the tensor keeps its copy
        owner_path, _, leaf = fused_name.rpartition(".")
        owner = layer.get_submodule(owner_path)
        if adapted and (type(owner) is not Linear or owner.reduce is not None):
            _once(f"{fused_name}: LoRA on a {type(owner).__name__} has no side path; copied, not shared")
            return
        if all(cast) and adapted:
            # Fused W + BA at each refresh, not a side path over the cast base: the copy exists either way, and the
            # side path's skinny products cost more than the fusion (SmolLM2, LoRA r=16 on every linear, bf16 copy,
            # 32 rows, 48 new tokens, 2 threads: generate 2.65 s + switch 24 ms against 2.00-2.07 s + 129-130 ms).
            _once(f"{fused_name}: LoRA over a {bases[0].dtype} base in a {param.dtype} copy: W + BA fused into the "
                  "copy at each refresh")  # fmt: skip
            return
        if all(cast):
            self._cast_once(param, bases, [prefix + n for n in names])
        else:
            self._adopt(param, bases, [prefix + n for n in names])
        if not adapted:
            return
        rank = sum(lo.lora_A[a].weight.shape[0] for lo, acts in active for a in acts)
        side = LoRALinear(owner, rank)
        parent_path, _, child = owner_path.rpartition(".")
        setattr(layer.get_submodule(parent_path) if parent_path else layer, child, side)
        rows, offset = [], 0
        for (lo, _), base in zip(active, bases):
            if lo is not None:
                rows.append((offset, lo, prefix))
            offset += base.shape[0]
        self.lora.append((side, [(r, lo) for r, lo, _ in rows]))

    def _adopt(self, param: torch.Tensor, bases: list[torch.Tensor], names: list[str]) -> None:
        """Fill ``param``'s row slices with ``bases`` (HF names ``names``) and make each base a view of its slice."""
        offset = 0
        with torch.no_grad():
            for base, name in zip(bases, names):
                view = param.data.narrow(0, offset, base.shape[0])
                view.copy_(base.detach())
                base.data = view  # the training parameter now reads the inference buffer; its old storage is freed
                chain = _chain(self._weights, name)
                if chain is not None and not _intact(chain, base):
                    chain = None
                self.links.append((param, offset, name, base, view.data_ptr(), chain))
                offset += base.shape[0]
        self.shared.add(id(param))
        if any(b.requires_grad for b in bases):
            self.trainable.add(id(param))  # the optimizer writes it: re-packed at each refresh, never copied
        self.bytes_shared += param.numel() * param.element_size()

    def _cast_once(self, param: torch.Tensor, bases: list[torch.Tensor], names: list[str]) -> None:
        """Fill ``param``'s row slices with ``bases`` cast to its dtype, once; the refresh skips ``param`` from now on
        (:meth:`recast_changed` casts a slice again if its training tensor changes)."""
        _once(f"{names[0]} and the other frozen weights without LoRA are {bases[0].dtype}, the inference copy "
              f"{param.dtype}: cast into the copy once (not shared), not rewritten at refreshes")  # fmt: skip
        offset = 0
        with torch.no_grad():
            for base, name in zip(bases, names):
                param.data.narrow(0, offset, base.shape[0]).copy_(base.detach())
                self.cast.append([param, offset, name, base, base.data_ptr(), base._version])
                offset += base.shape[0]
        self.shared.add(id(param))  # skipped by the refresh; not trainable: its CPU packs stay

    # -- refreshing ------------------------------------------------------------------------------------------------

    def recast_changed(self, weights: Any) -> set[int]:
        """Cast again the frozen slices whose training tensor changed since (another tensor under that name, another
        address, or a bumped version counter: an in-place write), or all of them after ``sleep()`` freed the copy
        (``cast_stale``). Returns the ids of the params written (the refresh re-packs their CPU packs)."""
        written: set[int] = set()
        force, self.cast_stale = self.cast_stale, False
        with torch.no_grad():
            for entry in self.cast:
                param, offset, name, base, ptr, version = entry
                current = _base_param(weights, name)[0]
                if not force and current is base and base.data_ptr() == ptr and base._version == version:
                    continue
                value = weights.full(current.detach())
                param.data.narrow(0, offset, value.shape[0]).copy_(value)
                entry[3:] = [current, current.data_ptr(), current._version]
                written.add(id(param))
        return written

    def copy_unlinked(self, weights: Any) -> None:
        """Copy the training tensors that no longer share the inference buffer into their slices: their ``.data`` was
        rebound, or the model holds another parameter under that name now (``fully_shard``, a replaced module). One
        warning per tensor when first seen; the current parameter is read by name at every refresh after that."""
        intact = []
        for link in self.links:
            param, offset, name, base, ptr, chain = link
            # The cached resolution is the walk's answer while every module on it is still in place (no walk:
            # ~13 us a link on SmolLM2's peft model); a moved module falls back to the walk.
            cached = chain is not None and _intact(chain, base)
            if base.data_ptr() == ptr and (cached or _base_param(weights, name)[0] is base):
                intact.append(link)
                continue
            logger.warning(
                "hf_dsinfer HybridEngine: the training weight %s no longer shares the inference copy's storage (its "
                ".data was rebound, e.g. by model.to() or load_state_dict(assign=True), or the parameter was "
                "replaced); it is copied at each refresh from now on", name,
            )  # fmt: skip
            self.broken.append((param, offset, name))
            self.trainable.add(id(param))  # rewritten at each refresh: its packed copies follow
        self.links = intact
        with torch.no_grad():
            for param, offset, name in self.broken:
                current = weights.full(_base_param(weights, name)[0].detach())
                param.data.narrow(0, offset, current.shape[0]).copy_(current)

    def unchanged(self) -> set[int]:
        """Ids of the shared inference parameters no refresh rewrites (the frozen base): their packs stay valid."""
        return self.shared - self.trainable

    def _lora_state(self) -> list:
        """What the side paths' plan depends on: each LoRA layer's routing (merged, disabled, active adapters) and
        its active factors (by identity) and scalings. Cheap: no tensor is read."""
        key: list = []
        for _, parts in self.lora:
            for _, lo in parts:
                merged, off = lo.merged, lo.disable_adapters
                fa, fb = lo._modules["lora_A"]._modules, lo._modules["lora_B"]._modules  # ModuleDicts' entries
                acts = () if merged or off else tuple(a for a in lo.active_adapters if a in fa)
                key.append((merged, off, acts))
                key += [(id(fa[a]._parameters["weight"]), id(fb[a]._parameters["weight"]), lo.scaling[a]) for a in acts]
        return key

    def _build_lora_plan(self, weights: Any) -> _LoRAPlan:
        """Zero the side buffers and list where each active factor goes (checked as at build: variants, rank)."""
        plan = _LoRAPlan()
        for side, parts in self.lora:
            side.lora_a.zero_()  # rows and blocks no adapter fills stay zero: the plan never writes them
            side.lora_b.zero_()
            a_rows = 0
            for offset, lo in parts:
                for a in weights._active_lora(lo, "lora"):
                    a_w, b_w = lo.lora_A[a].weight, lo.lora_B[a].weight  # [r, in], [out_part, r]
                    r = a_w.shape[0]
                    if a_rows + r > side.lora_a.shape[0]:
                        raise ValueError(
                            "the active LoRA adapters changed rank since the Hybrid Engine was built; build a new "
                            "HybridEngine after changing adapters (or pass share_base=False)."
                        )
                    plan.a_dst.append(side.lora_a[a_rows : a_rows + r])
                    plan.a_src.append(a_w)
                    b_dst = side.lora_b[offset : offset + b_w.shape[0], a_rows : a_rows + r]
                    scale = float(lo.scaling[a])
                    if scale == 1.0:  # nothing to multiply: copied (and cast) straight
                        plan.b_dst.append(b_dst)
                        plan.b_src.append(b_w)
                    else:
                        plan.b_scaled_dst.append(b_dst)
                        plan.b_scaled_src.append(b_w)
                        plan.scales.append(scale)
                    a_rows += r
        sources = (*plan.a_src, *plan.b_src, *plan.b_scaled_src)
        plan.sharded = any(DTensor is not None and isinstance(t, DTensor) for t in sources)
        return plan

    def refresh_lora(self, weights: Any) -> None:
        """Copy the active adapters' factors (scaling folded into B) into the side-path buffers, in place.

        The copies are planned once (which factor goes to which rows) and replanned whenever an adapter is switched,
        merged, disabled, rescaled or replaced; a refresh is then a few foreach calls, not ~10 tensor calls per adapted
        linear (SmolLM2, 210 adapted linears: 12-19 ms of refresh before; on a GPU each call was also a launch). B
        is scaled as before (in the factor's dtype, then cast), with no product where the scaling is 1.
        """
        key = self._lora_state()
        if self._lora_plan is None or key != self._lora_key:
            self._lora_plan, self._lora_key = self._build_lora_plan(weights), key
        plan = self._lora_plan
        if not plan.a_dst:
            return
        a_src, b_src, b_scaled_src = plan.a_src, plan.b_src, plan.b_scaled_src
        if plan.sharded:  # FSDP2 factors: gathered each time
            a_src, b_src, b_scaled_src = ([weights.full(t.detach()) for t in ts] for ts in (a_src, b_src, b_scaled_src))
        with torch.no_grad():
            torch._foreach_copy_(plan.a_dst, a_src)  # [r, in] each
            if plan.b_dst:
                torch._foreach_copy_(plan.b_dst, b_src)  # [out_part, r] each
            if plan.b_scaled_dst:  # scaled in the factor's dtype, then cast (a product of bf16 values rounded
                # after the cast would differ; in place on the strided blocks it was also slower: 26 us a call)
                torch._foreach_copy_(plan.b_scaled_dst, torch._foreach_mul(b_scaled_src, plan.scales))

    def forget_lora_plan(self) -> None:
        """The side buffers lost their values (``sleep()``): the next refresh replans and zeroes them again."""
        self._lora_plan = None

    def extra_bytes(self) -> int:
        """Bytes of the side-path buffers (the only weights the engine adds for shared tensors)."""
        return sum((s.lora_a.numel() + s.lora_b.numel()) * s.lora_a.element_size() for s, _ in self.lora)
