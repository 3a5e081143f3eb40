"""Per-rank sharded loading: each rank reads only its slice of every tensor from the checkpoint files.

``load_pretrained_tp`` builds the model on the meta device (no memory), plans tensor parallelism on it (shapes
shrink), then materializes every parameter from its slice of the checkpoint (:class:`~.checkpoint_index.
CheckpointIndex`: safetensors slices, or memory-mapped ``.bin`` / ``.pt`` files read one at a time). Peak host memory
per rank stays near ``1/tp`` of the weights plus the largest single tensor (safetensors) or the largest file (pickled
shards). Buffers that are not in the checkpoint (rotary ``inv_freq``) are recomputed by transformers' own
``initialize_weights``, which skips every loaded parameter.

Also here: DeepSpeed's checkpoint JSON (``{"type", "checkpoints", "version", "base_dir", "tp_size" | "mp_size",
"parallelization"}``), read as DeepSpeed reads it:

* ``checkpoints`` a list (BLOOM-style ``"pp"``, the default): every file is a part of the whole model; each rank reads
  its slices of every file.
* ``parallelization: "tp"``, or ``checkpoints: {"tp": [...], "non_tp": [...]}``: files already split per rank for
  ``tp_size`` ranks (DeepSpeed's order: partition ``m`` of rank ``r`` at ``tp[m * tp_size + r]``); each rank reads its
  own files as they are, and the replicated tensors from ``non_tp`` (or from its own files).
* ``type: "Megatron"``: one ``mp_rank_XX`` file per model-parallel rank. One file: the whole model, read per slice;
  ``tp_size`` files: already split, rank ``r`` reads file ``r``.

``save_mp_checkpoint`` writes a TP-split checkpoint (per-rank safetensors files plus that JSON) that a later start
loads without re-slicing.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from .. import hf_compat
from .apply import apply_plan, finish, parameter_groups
from .autotp import TPPlan, build_plan
from .checkpoint_index import CheckpointIndex
from .groups import TPGroup, barrier
from .moe import read_fused_experts
from .shard import DEFAULT_GRAIN, Shard

DESCRIPTION_KEYS = {
    "type",
    "checkpoints",
    "version",
    "base_dir",
    "tp_size",
    "mp_size",
    "parallelization",
    "dtype",
    "tp_grain_size",
}
DESCRIPTION_FILE = "ds_inference_config.json"


def _build_meta(cls: type, config: Any, dtype: torch.dtype, attn_implementation: str | None) -> nn.Module:
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        return hf_compat.model_from_config(cls, config, **kwargs)


def materialize(
    model: nn.Module,
    plan: TPPlan,
    tp: TPGroup,
    sharded: CheckpointIndex,
    replicated: CheckpointIndex | None = None,
    presliced: bool = False,
    device: torch.device | None = None,
    on_loaded: Any = None,
) -> nn.Module:
    """Load every parameter of the meta ``model`` (this rank's slices of ``sharded``), then its buffers.

    ``presliced``: ``sharded`` already holds this rank's slices (a TP-split checkpoint); replicated tensors then come
    from ``replicated``.
    """
    device = device or torch.device("cpu")
    prefix = getattr(model, "base_model_prefix", "")
    replicated = replicated or sharded
    computed = hf_compat.keys_recomputed_at_init(model)  # left out of checkpoints, e.g. Marian's position tables
    to_compute: list[str] = []

    def load(names: list[str], shard: Shard | None, current: torch.Tensor) -> torch.Tensor:
        source = replicated if (presliced and shard is None) else sharded
        key = source.find(names, prefix)
        if key is None and not presliced:  # MoE experts stored one tensor per expert: read and stack this rank's
            experts = read_fused_experts(source, lambda n: source.find([n], prefix), names[0], shard, current.shape)
            if experts is not None:
                return experts.to(device=device, dtype=current.dtype)
        if key is None and shard is None and any(re.search(p, n) for p in computed for n in names):
            to_compute.append(names[0])
            return torch.empty(current.shape, dtype=current.dtype, device=device)  # filled by the model's init below
        if key is None:
            raise ValueError(f"the checkpoint has no tensor for {names[0]} (also looked for {names[1:]}).")
        tensor = source.read(key, None if presliced else shard)
        expected = shard.local_shape(current.shape) if shard is not None else tuple(current.shape)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} does not match this rank's {expected}.")
        dtype = current.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.to(device=device, dtype=dtype)

    try:
        apply_plan(model, plan, tp, load=load, on_loaded=on_loaded)
        for name in to_compute:
            _leave_to_init(model, name)
        _materialize_buffers(model, replicated, prefix, device, init=bool(to_compute))
    finally:  # unmap the pickled file still open
        sharded.close()
        replicated.close()
    return model


def _leave_to_init(model: nn.Module, name: str) -> None:
    """Give parameter ``name`` (and every module sharing it) a fresh Parameter that transformers' initialization does
    not skip (apply_plan marks what it places as initialized)."""
    owner, _, pname = name.rpartition(".")
    old = model.get_submodule(owner)._parameters[pname]
    new = nn.Parameter(old.data, requires_grad=False)
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is old:
                module._parameters[key] = new


def _materialize_buffers(
    model: nn.Module, index: CheckpointIndex, prefix: str, device: torch.device, init: bool = False
) -> None:
    """Persistent buffers from the checkpoint; the rest (and parameters left to it, ``init``) computed by
    transformers' initialization, which skips every loaded tensor."""
    pending = init
    for mod_name, module in model.named_modules():
        persistent = set(module._buffers) - getattr(module, "_non_persistent_buffers_set", set())
        for bname, buf in list(module._buffers.items()):
            if buf is None or not buf.is_meta:
                continue
            full = f"{mod_name}.{bname}" if mod_name else bname
            key = index.find([full], prefix) if bname in persistent else None
            if key is not None:
                value = index.read(key, None).to(device)
                hf_compat.mark_initialized(value)
            else:
                value = torch.empty_like(buf, device=device)
                pending = True
            module._buffers[bname] = value
    if pending:
        init = getattr(model, "initialize_weights", None) or getattr(model, "init_weights", None)
        if init is None:
            raise ValueError(f"{type(model).__name__} has buffers missing from the checkpoint and no init method.")
        init()
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise ValueError(f"tensors still unloaded after loading: {leftover[:5]}")


def read_description(checkpoint: str | dict, base_dir: str = "") -> dict[str, Any]:
    """DeepSpeed's checkpoint JSON (a path or a dict), checked; ``base_dir`` (argument or key) made absolute."""
    if isinstance(checkpoint, (str, os.PathLike)):
        path = os.fspath(checkpoint)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint={path!r} is not a file; pass DeepSpeed's checkpoint JSON (path or dict).")
        with open(path, encoding="utf-8") as f:
            try:
                desc = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"checkpoint file {path!r} is not valid JSON: {e}. Fix the file.") from e
        if not isinstance(desc, dict):
            raise ValueError(f"checkpoint file {path!r} must hold a JSON object, got {type(desc).__name__}.")
        base = base_dir or desc.get("base_dir") or os.path.dirname(os.path.abspath(path))
    else:
        desc = dict(checkpoint)
        base = base_dir or desc.get("base_dir") or ""
    unknown = set(desc) - DESCRIPTION_KEYS
    if unknown:
        raise ValueError(
            f"checkpoint description has unknown keys {sorted(unknown)}; known: {sorted(DESCRIPTION_KEYS)}."
        )
    if "checkpoints" not in desc:
        raise ValueError(
            "checkpoint description needs a 'checkpoints' entry (a list of files, or {'tp': [...], 'non_tp': [...]})."
        )
    desc["base_dir"] = base
    return desc


def _files(desc: dict[str, Any], entries: list[str]) -> list[str]:
    return [e if os.path.isabs(e) else os.path.join(desc["base_dir"], e) for e in entries]


def _checkpoint_layout(desc: dict[str, Any], tp: TPGroup) -> tuple[list[str] | None, list[str]]:
    """How the description's files map to this rank: ``(None, files)`` when every file is a part of the whole model
    (each rank reads its slices), ``(own, replicated)`` when the files are already split per rank (``own``: this
    rank's files, ``replicated``: where its unsplit tensors are)."""
    ckpts = desc["checkpoints"]
    megatron = str(desc.get("type", "")).lower() == "megatron"
    if not (desc.get("parallelization") == "tp" or isinstance(ckpts, dict) or megatron):
        return None, _files(desc, list(ckpts))
    split = _files(desc, list(ckpts["tp"] if isinstance(ckpts, dict) else ckpts))
    saved = int(desc.get("mp_size", desc.get("tp_size", len(split))))
    if megatron and len(split) == 1:
        return None, split  # one mp_rank file: the whole model
    if saved != tp.size or len(split) % saved:
        what = f"{len(split)} mp_rank files" if megatron else f"tp_size={saved}"
        raise ValueError(
            f"the checkpoint was split for {what} but this run has tp_size={tp.size}; run with tp_size={saved} or "
            "load the original (unsplit) checkpoint (resharding a split checkpoint is not implemented)."
        )
    own = split[tp.rank :: saved]  # DeepSpeed's order: partition m of rank r is entry m * tp_size + r
    non_tp = _files(desc, list(ckpts.get("non_tp", []))) if isinstance(ckpts, dict) else []
    return own, non_tp + own


def load_from_description(
    model: nn.Module,
    desc: dict[str, Any],
    tp: TPGroup,
    grain: int = DEFAULT_GRAIN,
    injection_policy: dict[str, list[str]] | None = None,
    device: torch.device | None = None,
) -> nn.Module:
    """Load a meta ``model`` from a checkpoint description (see the module docstring for the layouts): files already
    split per rank are read as they are, files holding parts of the whole model are read per slice."""
    if tp.size > 1:
        plan = build_plan(model, tp.size, tp.rank, grain=grain, injection_policy=injection_policy)
    else:
        plan = TPPlan(1, 0)
    own, files = _checkpoint_layout(desc, tp)
    if own is not None:
        if int(desc.get("tp_grain_size", grain)) != grain:
            raise ValueError(
                f"the checkpoint was split with tp_grain_size={desc['tp_grain_size']}, this run uses {grain}."
            )
        sharded, replicated = CheckpointIndex(own), CheckpointIndex(files)
        materialize(model, plan, tp, sharded, replicated, presliced=True, device=device)
    else:
        materialize(model, plan, tp, CheckpointIndex(files).rename_for(model), device=device)
    finish(model, tp)
    return model


def load_pretrained_tp(
    cls: type,
    path: str,
    config: Any,
    tp: TPGroup,
    dtype: torch.dtype,
    *,
    grain: int = DEFAULT_GRAIN,
    injection_policy: dict[str, list[str]] | None = None,
    checkpoint: dict[str, Any] | None = None,
    attn_implementation: str | None = None,
    device: torch.device | None = None,
    ep_size: int = 1,
    on_loaded: Any = None,
) -> nn.Module:
    """``cls.from_pretrained(path)`` for tensor parallelism: meta model -> plan -> each rank reads its slices
    (``ep_size``: MoE experts split by features (1), or into ``ep_size`` expert groups, see ``parallel/moe.py``;
    ``on_loaded(meta_model)``: returns the per-parameter callback of :func:`~.apply.apply_plan`, e.g. to quantize
    each linear's slice as soon as it is read)."""
    model = _build_meta(cls, config, dtype, attn_implementation)
    if checkpoint is not None:
        load_from_description(model, checkpoint, tp, grain, injection_policy, device)
    else:
        plan = build_plan(model, tp.size, tp.rank, grain=grain, injection_policy=injection_policy, ep_size=ep_size)
        materialize(
            model,
            plan,
            tp,
            CheckpointIndex.from_directory(path).rename_for(model),
            device=device,
            on_loaded=on_loaded(model) if on_loaded is not None else None,
        )
        finish(model, tp)
    model.eval()
    return model


def save_mp_checkpoint(
    model: nn.Module, tp: TPGroup, directory: str, dtype_name: str, grain: int = DEFAULT_GRAIN
) -> str:
    """Write this rank's slices (``tp_XX.safetensors``); rank 0 also writes the replicated tensors, config.json and
    the description ``ds_inference_config.json`` that a later start passes as ``checkpoint``. Returns its path."""
    plan: TPPlan = getattr(model, "_dsinfer_tp_plan", None) or TPPlan(1, 0)
    os.makedirs(directory, exist_ok=True)
    sharded, replicated = {}, {}
    for names, _, param in parameter_groups(model):
        target = sharded if any(n in plan.shards for n in names) else replicated
        target[names[0]] = param.detach().to("cpu").contiguous()
    for name, buf in model.named_buffers():
        owner, _, bname = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if bname not in getattr(module, "_non_persistent_buffers_set", set()):
            replicated[name] = buf.detach().to("cpu").contiguous()
    tp_files = [f"tp_{r:02d}.safetensors" for r in range(tp.size)]
    save_file(sharded, os.path.join(directory, tp_files[tp.rank]))
    out = os.path.join(directory, DESCRIPTION_FILE)
    if tp.rank == 0:
        save_file(replicated, os.path.join(directory, "non_tp.safetensors"))
        if hasattr(model, "config"):
            model.config.to_json_file(os.path.join(directory, "config.json"))
        desc = {
            "type": "ds_model",
            "version": 1.0,
            "base_dir": os.path.abspath(directory),
            "parallelization": "tp",
            "tp_size": tp.size,
            "tp_grain_size": grain,
            "dtype": dtype_name,
            "checkpoints": {"non_tp": ["non_tp.safetensors"], "tp": tp_files},
        }
        with open(out, "w", encoding="utf-8") as f:
            json.dump(desc, f, indent=2)
    barrier(tp)
    return out
