"""LoRA adapters served side by side (vLLM's ``--enable-lora``): peft adapter folders loaded into slots at run time.

:class:`LoRARegistry` turns every fused linear of an injected model (``attn.qkv``, ``attn.o``, ``mlp.up``,
``mlp.down``) into a :class:`~hf_dsinfer.modules.lora.MultiLoRALinear` with ``max_loras`` slots of rank
``max_lora_rank``, maps a peft adapter's target modules onto them (``q_proj`` / ``k_proj`` / ``v_proj`` onto their
row ranges of the fused qkv, ``gate_proj`` / ``up_proj`` onto the fused gate_up, through the policy's weight map),
and loads / unloads adapters by name. A request names its adapter; each step the runner gives every token its
adapter's slot (-1: base) and one forward serves every adapter and the base.

Under tensor parallelism every rank builds its own registry over its shard of the fused linears and loads the same
folders into the same slots (rank 0 decides, :mod:`.tp_worker` forwards the load / unload); each rank keeps its
piece of an adapter, cut by the same :class:`~hf_dsinfer.parallel.shard.Shard` that cut the base weight it adapts:
``B``'s output rows for a column-parallel projection (q/k/v, gate/up), ``A``'s input columns for a row-parallel one
(o, down; :class:`~hf_dsinfer.modules.lora.MultiLoRALinear` adds the delta before the all-reduce).

An adapter's requests never share KV blocks with another adapter's or the base's (the same prompt gives other keys
and values): :attr:`LoRAAdapter.key` seeds the prefix keys of its requests, fresh at every load.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import threading
from dataclasses import dataclass

import torch
from torch import nn

from ..modules.linear import Linear
from ..modules.lora import LoRASlots, MultiLoRALinear
from ..policies.base import Cat, Param, as_source
from ..policies.injection import get_injection

#: The fused linears that take adapters (the layer attribute path, the fused parameter name).
FUSED_LINEARS = (("attn.qkv", "attn.qkv.weight"), ("attn.o", "attn.o.weight"),
                 ("mlp.up", "mlp.up.weight"), ("mlp.down", "mlp.down.weight"))  # fmt: skip
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LoRAAdapter:
    """One loaded adapter: its name (what requests ask for), folder, slot, largest rank and prefix-key seed."""

    name: str
    path: str
    slot: int
    rank: int
    key: bytes
    in_use: int = 0  # requests submitted with it and not finished


class LoRARegistry:
    """Adapter slots over the fused linears of ``model`` (see the module docstring). Thread-safe."""

    def __init__(self, model: nn.Module, max_loras: int = 4, max_lora_rank: int = 16):
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: pass a positive integer (--{name.replace('_', '-')})")
        record = get_injection(model)
        if record is None:
            raise ValueError("LoRA adapters need a model with fused layers (load it with an inference_config)")
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.state = LoRASlots()
        self.adapters: dict[str, LoRAAdapter] = {}
        self._lock = threading.Lock()
        self._loads = itertools.count()
        #: HF module path (e.g. ``model.layers.0.self_attn.k_proj``) -> (side path, part index).
        self.targets: dict[str, tuple[MultiLoRALinear, int]] = {}
        self.side_paths: list[MultiLoRALinear] = []
        #: HF module path -> the TP shard of its weight (None: not split, e.g. tp_size 1).
        self.shards: dict[str, object | None] = {}
        plan_shards = _tp_shards(model)
        for i, layer in enumerate(record.runtime.layers):
            for attr, fused in FUSED_LINEARS:
                src = record.weight_maps[i].get(fused)
                parent_name, _, leaf = attr.rpartition(".")
                parent = getattr(layer, parent_name, None)
                base = getattr(parent, leaf, None)
                if src is None or not isinstance(base, Linear):
                    continue  # MoE experts, quantized linears: no side path (an adapter for them is refused)
                if isinstance(base, MultiLoRALinear):  # an earlier engine's side path: this registry replaces it
                    base = Linear(base.weight, base.bias, base.reduce)
                names, rows = _parts(as_source(src), base.weight.shape[0])
                if names is None:
                    continue
                side = MultiLoRALinear(base, self.state, max_loras, max_lora_rank, rows)
                setattr(parent, leaf, side)
                self.side_paths.append(side)
                for p, n in enumerate(names):
                    module = f"{record.layers_prefix}.{i}.{n.removesuffix('.weight')}"
                    shard = plan_shards.get(f"{module}.weight")
                    # a split must be the fused linear's own kind: rows of a column-parallel one, columns of a
                    # row-parallel one (an unsplit weight that is reduced would count the delta once per rank);
                    # anything else (MoE cuts) has no side path
                    row_parallel = base.reduce is not None
                    if (shard is None and row_parallel) or (
                        shard is not None and (shard.inner is not None or shard.dim != int(row_parallel))
                    ):
                        continue
                    self.targets[module] = (side, p)
                    self.shards[module] = shard
        if not self.targets:
            raise ValueError("this model has no fused linear that can take a LoRA adapter")

    # -- adapters --------------------------------------------------------------------------------------------------

    def load(self, name: str, path: str | os.PathLike, slot: int | None = None) -> LoRAAdapter:
        """Load the peft adapter folder ``path`` (adapter_config.json + adapter_model.safetensors) as ``name``, into
        the first free slot (or ``slot``: a tensor-parallel worker takes the one rank 0 chose).

        Errors (``ValueError`` naming the setting): a name already loaded, no free slot (``--max-loras``), a rank
        above ``--max-lora-rank``, a module without a side path (embeddings, LM head, MoE experts), DoRA, LoRA
        biases, ``modules_to_save``.
        """
        path = os.fspath(path)
        config, tensors = _read_adapter(path)
        with self._lock:
            if name in self.adapters:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it or pick another name")
            used = {a.slot for a in self.adapters.values()}
            free = [s for s in range(self.max_loras) if s not in used]
            if not free:
                raise ValueError(f"all {self.max_loras} LoRA slots are in use ({', '.join(self.adapters)}); unload "
                                 "one or raise --max-loras")  # fmt: skip
            parts = self._match(config, tensors, path)
            if slot is None:
                slot = free[0]
            elif slot not in free:
                raise ValueError(f"LoRA slot {slot} is not free on this rank (internal error: ranks out of step)")
            for side in self.side_paths:
                side.clear_slot(slot)
            for (side, p), (a, b, scale) in parts.items():
                side.set_part(slot, p, a.to(side.lora_a.dtype), b, scale)
            rank = max(a.shape[0] for a, _, _ in parts.values())
            key = hashlib.blake2b(f"lora\0{name}\0{next(self._loads)}".encode(), digest_size=16).digest()
            adapter = LoRAAdapter(name, path, slot, rank, key)
            self.adapters[name] = adapter
            return adapter

    def _match(self, config: dict, tensors: dict[str, torch.Tensor], path: str) -> dict:
        """``{(side path, part): (A [r, in], B [out, r], scale)}`` for every adapted module of the adapter."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            m = _LORA_KEY.match(key)
            if m is None:
                raise ValueError(f"{path}: tensor {key!r} is not a LoRA A/B weight (modules_to_save, LoRA biases and "
                                 "DoRA magnitudes are not supported when serving adapters)")  # fmt: skip
            pairs.setdefault(m.group(1), {})[m.group(2)] = t
        out = {}
        for module, ab in pairs.items():
            if module not in self.targets:
                known = sorted({k.rsplit(".", 1)[-1] for k in self.targets})
                raise ValueError(f"{path}: the adapter targets {module!r}, which has no LoRA side path here; "
                                 f"adapters may target {known}")  # fmt: skip
            if set(ab) != {"A", "B"}:
                raise ValueError(f"{path}: {module} has lora_{''.join(ab)} but not both A and B")
            a, b = ab["A"], ab["B"]
            r = a.shape[0]
            if r > self.max_lora_rank:
                raise ValueError(f"{path}: {module} has rank {r} > max_lora_rank={self.max_lora_rank}; "
                                 "raise --max-lora-rank")  # fmt: skip
            alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
            scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
            shard = self.shards[module]
            if shard is not None:  # tensor parallelism: this rank's piece, cut as the base weight was
                try:
                    a, b = (shard.narrow(a), b) if shard.dim == 1 else (a, shard.narrow(b))
                except ValueError as e:
                    raise ValueError(f"{path}: {module}'s LoRA weights A {tuple(a.shape)} / B {tuple(b.shape)} do "
                                     f"not fit the model's projection ({e})") from e  # fmt: skip
            out[self.targets[module]] = (a, b, scale)
        if not out:
            raise ValueError(f"{path}: the adapter holds no LoRA weights")
        return out

    def unload(self, name: str) -> None:
        """Forget adapter ``name`` (its slot is zeroed and free again). Refused while requests use it."""
        with self._lock:
            adapter = self.adapters.get(name)
            if adapter is None:
                raise KeyError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self.adapters) or 'none'})")
            if adapter.in_use:
                raise ValueError(f"LoRA adapter {name!r} is used by {adapter.in_use} unfinished request(s); "
                                 "unload it when they finish")  # fmt: skip
            del self.adapters[name]
            for side in self.side_paths:
                side.clear_slot(adapter.slot)

    def acquire(self, name: str) -> LoRAAdapter:
        """The adapter a new request asks for, counted as in use until :meth:`release`."""
        with self._lock:
            adapter = self.adapters.get(name)
            if adapter is None:
                raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.adapters) or 'none'}")
            adapter.in_use += 1
            return adapter

    def release(self, name: str | None) -> None:
        """A request with adapter ``name`` finished (None: a base request, nothing to do)."""
        if name is None:
            return
        with self._lock:
            adapter = self.adapters.get(name)
            if adapter is not None and adapter.in_use > 0:
                adapter.in_use -= 1

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self.adapters)

    # -- per step ----------------------------------------------------------------------------------------------------

    def set_step(self, token_slots: list[int] | None, device: torch.device) -> None:
        """Give this step's tokens their slots (``None`` or all -1: no side path runs)."""
        self.state.set(token_slots, device)


def _tp_shards(model: nn.Module) -> dict[str, object]:
    """HF parameter name -> its tensor-parallel shard (``dim`` 0: output rows, 1: input columns); empty at tp 1."""
    from ..parallel.apply import PLAN_ATTR

    plan = getattr(model, PLAN_ATTR, None)
    return {} if plan is None else dict(plan.shards)


def _parts(src: object, out_rows: int) -> tuple[list[str] | None, list[int]]:
    """HF parameter names of the row slices of a fused source and their row counts (None: not plain slices)."""
    if isinstance(src, Param):
        return [src.name], [out_rows]
    if isinstance(src, Cat) and all(isinstance(p, Param) for p in src.parts) and src.rows is not None:
        return [p.name for p in src.parts], list(src.rows)
    return None, []


def _pattern_value(pattern: dict, module: str, default: float) -> float:
    """peft's ``alpha_pattern`` rule: a key matches a module name ending in ``.key`` (or equal to it)."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_adapter(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """adapter_config.json and the tensors of adapter_model.safetensors (or .bin) of a peft folder, checked."""
    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{path} is not a peft adapter folder: no adapter_config.json")
    with open(cfg_file) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    for flag in ("use_dora", "lora_bias", "fan_in_fan_out"):
        if config.get(flag):
            raise ValueError(f"{path}: {flag}=True adapters are not supported when serving adapters; merge it instead")
    if config.get("modules_to_save"):
        raise ValueError(f"{path}: modules_to_save ({config['modules_to_save']}) is not supported when serving "
                         "adapters (a full copy of a module per adapter); merge the adapter instead")  # fmt: skip
    st_file = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st_file):
        from safetensors.torch import load_file

        return config, load_file(st_file)
    bin_file = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(bin_file):
        return config, torch.load(bin_file, map_location="cpu", weights_only=True)
    raise ValueError(f"{path}: no adapter_model.safetensors (or adapter_model.bin)")
