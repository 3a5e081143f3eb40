"""Which file holds each checkpoint tensor, and reading a whole tensor or one rank's slice of it.

Two file kinds:

* ``.safetensors``: ``safe_open(file).get_slice(name)[...]`` reads only the slice's bytes; the file is opened per
  tensor so the pages a slice touched are unmapped right after it is read.
* pickled torch files (HF's ``pytorch_model*.bin``, DeepSpeed's ``.pt``, Megatron-style ``mp_rank_XX`` files): read
  with ``torch.load(mmap=True, weights_only=True)``. The tensors are views of a private file map, so taking a slice
  copies only the slice's bytes; one file stays mapped at a time (the one being read), so a rank's peak host memory
  is at most one file plus its own slices. ``weights_only=True`` refuses pickles holding arbitrary Python objects
  (unpickling them can run code), with an error that says how to re-save the state dict. Files written by torch
  before 1.6 (no zip container) cannot be mapped and are read whole, one at a time.

A file holding a training checkpoint rather than a bare state dict (DeepSpeed's ``{"module": state_dict, ...}``,
Megatron's ``{"model": ...}``) is read through that key, as DeepSpeed's loader does.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ..log import logger
from .moe import is_per_expert_key
from .shard import Shard

SAFETENSORS = ".safetensors"
# Keys under which DeepSpeed's and Megatron's checkpoints keep the model's state dict (DeepSpeed's _choose_module_key).
MODULE_KEYS = ("module", "model")
_LEGACY_LOGGED: set[str] = set()


def is_safetensors(path: str) -> bool:
    """Whether ``path`` is a safetensors file (anything else is read as a pickled torch file)."""
    return path.endswith(SAFETENSORS)


def _load_torch_file(path: str) -> dict[str, torch.Tensor]:
    """The state dict in the pickled torch file ``path``, memory-mapped where the format allows."""
    try:
        try:
            obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as e:
            if "zipfile" not in str(e) and "mmap" not in str(e):
                raise
            if path not in _LEGACY_LOGGED:  # written by torch < 1.6: no zip container, cannot be mapped
                _LEGACY_LOGGED.add(path)
                logger.info("%s predates torch's zip format and cannot be memory-mapped; it is read whole.", path)
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{path} holds Python objects besides tensors, which hf_dsinfer does not unpickle: it loads checkpoint "
            f"files with torch.load(weights_only=True) because unpickling arbitrary objects can run code ({first}). "
            "If you trust the file, re-save only its weights: sd = torch.load(path, weights_only=False); "
            "torch.save(sd.get('module', sd), 'weights.pt') (or convert it to safetensors), and point the checkpoint "
            "at the new file."
        ) from e
    return _state_dict_of(obj, path)


def _state_dict_of(obj: Any, path: str) -> dict[str, torch.Tensor]:
    """The name -> tensor mapping inside a loaded checkpoint object (a bare state dict, or one under ``module`` /
    ``model``); values that are not tensors (DeepSpeed's quantized ``[weight, scale]`` pairs) are refused by name."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a state dict (a mapping of names to tensors).")
    nested = [k for k in MODULE_KEYS if isinstance(obj.get(k), Mapping)]
    if len(nested) == 1 and not all(isinstance(v, torch.Tensor) for v in obj.values()):
        obj = obj[nested[0]]
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad and any(isinstance(obj[k], (list, tuple)) for k in bad):
        raise ValueError(
            f"{path}: the entries {bad[:3]} are not tensors (DeepSpeed's quantized checkpoints store [weight, scale] "
            "pairs, which cannot be read here); load the float checkpoint and set `quant` instead."
        )
    if bad:
        raise ValueError(
            f"{path} is neither a state dict nor a training checkpoint with one of {list(MODULE_KEYS)} holding it "
            f"(entries that are not tensors: {sorted(map(str, bad))[:8]}); save the model's state_dict() on its own."
        )
    return dict(obj)


class CheckpointIndex:
    """tensor name -> file over a set of checkpoint files (safetensors or pickled torch files); reads whole tensors or
    :class:`Shard` slices.

    ``weight_map``: name -> file for pickled files whose names are known without opening them (HF's
    ``pytorch_model.bin.index.json``); other pickled files are opened (memory-mapped) once to list their names.
    Call :meth:`close` when done: it unmaps the pickled file still open.
    """

    def __init__(self, files: Iterable[str], weight_map: Mapping[str, str] | None = None):
        self.files = list(files)
        self.where: dict[str, str] = {}
        self.stored: dict[str, str] = {}  # model-side name -> name in the file, where transformers renames keys
        self._open_path: str | None = None  # the one pickled file kept mapped while its tensors are read
        self._open_state: dict[str, torch.Tensor] | None = None
        for path in self.files:
            if not os.path.isfile(path):
                raise ValueError(f"checkpoint file {path} does not exist; check the checkpoint list and base_dir.")
        mapped = {os.path.abspath(p) for p in (weight_map or {}).values()}
        for key, path in (weight_map or {}).items():
            self.where[key] = path
        for path in self.files:
            if is_safetensors(path):
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        self.where[key] = path
            elif os.path.abspath(path) not in mapped:
                for key in self._state(path):
                    self.where[key] = path
        self.close()

    @classmethod
    def from_directory(cls, directory: str) -> CheckpointIndex:
        """The checkpoint in an HF model directory: safetensors (``model.safetensors.index.json``,
        ``model.safetensors`` or any ``*.safetensors``), else pickled shards (``pytorch_model.bin.index.json``,
        ``pytorch_model*.bin``)."""
        for index_name, suffix, prefix in (
            ("model.safetensors.index.json", SAFETENSORS, ""),
            ("pytorch_model.bin.index.json", ".bin", "pytorch_model"),
        ):
            index = os.path.join(directory, index_name)
            if os.path.isfile(index):
                with open(index, encoding="utf-8") as f:
                    weight_map = {k: os.path.join(directory, v) for k, v in json.load(f)["weight_map"].items()}
                return cls(sorted(set(weight_map.values())), weight_map)
            files = sorted(n for n in os.listdir(directory) if n.endswith(suffix) and n.startswith(prefix))
            if files:
                return cls(os.path.join(directory, n) for n in files)
        raise ValueError(
            f"{directory} holds no model weights (*.safetensors or pytorch_model*.bin); tensor-parallel loading reads "
            "them per slice (re-save the model with save_pretrained, or load with tp_size=1)."
        )

    def _state(self, path: str) -> dict[str, torch.Tensor]:
        """The state dict of the pickled file ``path``; the previously open file is released first."""
        if self._open_path != path:
            self.close()
            self._open_state = _load_torch_file(path)
            self._open_path = path
        return self._open_state

    def close(self) -> None:
        """Drop the open pickled file (its map goes with the last view of it)."""
        self._open_path, self._open_state = None, None

    def rename_for(self, model: nn.Module) -> CheckpointIndex:
        """Apply transformers' checkpoint key renames for ``model`` (e.g. GPT-NeoX's ``embed_out`` -> ``lm_head``).

        Renames that only change names are followed; a key matched by a converting transform (experts merged,
        tensors fused at load) cannot be read per slice and raises, naming it.
        """
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightRenaming
        except ImportError:  # a transformers without conversion mappings stores model names as they are
            return self
        transforms = get_model_conversion_mapping(model)
        renames = [t for t in transforms if isinstance(t, WeightRenaming)]
        others = [t for t in transforms if not isinstance(t, WeightRenaming)]
        for key in list(self.where):
            for t in others:
                if t.rename_source_key(key)[1] is not None and not is_per_expert_key(key):  # experts: parallel/moe.py
                    raise ValueError(
                        f"checkpoint tensor {key} is converted by transformers at load ({type(t).__name__}); such "
                        "checkpoints cannot be read per slice. Load with tp_size=1, save_pretrained, then use TP."
                    )
            new = key
            for t in renames:
                new = t.rename_source_key(new)[0]
            if new != key:
                self.where[new] = self.where[key]
                self.stored[new] = self.stored.get(key, key)
        return self

    def find(self, names: list[str], prefix: str = "") -> str | None:
        """The first of ``names`` stored here (also tried with the base-model prefix added or removed)."""
        for name in names:
            candidates = [name]
            if prefix:
                candidates += [f"{prefix}.{name}", name[len(prefix) + 1 :] if name.startswith(prefix + ".") else None]
            for c in candidates:
                if c is not None and c in self.where:
                    return c
        return None

    def read(self, key: str, shard: Shard | None) -> torch.Tensor:
        """The stored tensor ``key``, or only this rank's ``shard`` of it (a private copy, not a view of the file)."""
        stored = self.stored.get(key, key)
        path = self.where[key]
        if is_safetensors(path):
            with safe_open(path, framework="pt") as f:
                if shard is None:
                    return f.get_tensor(stored).clone()
                piece = f.get_slice(stored)
                return shard.read(piece, piece.get_shape())
        tensor = self._state(path).get(stored)
        if tensor is None:
            raise ValueError(f"{path} has no tensor {stored!r} although its index lists it there.")
        if shard is None:
            return tensor.clone(memory_format=torch.contiguous_format)
        return shard.read(tensor, tuple(tensor.shape))
