"""What tensor parallelism did to an HF model before kernel injection, and the checks that let fused layers take over.

The integration layer first splits the HF modules with AutoTP (``hf_dsinfer.parallel``: q/k/v and gate/up
column-parallel by KV-head groups, output projections row-parallel, vocab-parallel embedding and head), then injects.
Packing the already-split HF weights gives each rank's slice of the fused tensors in the fused layouts, because
AutoTP splits fused checkpoints (phi3's ``qkv_proj``, falcon's and neox's ``query_key_value``) part by part. What the
fused layers still need is told here: the local head counts (for the spec, the packing and the static KV cache) and
the all-reduce of the row-parallel ``attn.o`` / ``mlp.down``. This module knows nothing of ``hf_dsinfer.parallel``:
the integration layer fills :class:`TPLayout` from the plan.

Two per-head details a policy reads from the split HF modules themselves:

* a full-width q/k norm (OLMo-2) that AutoTP split carries ``full_width`` and ``share``; the policy passes them on as
  ``AttentionSpec.qk_norm_split`` and the fused layer sums the statistics over the ranks with :attr:`TPLayout.reduce`;
* an attention whose ALiBi bias AutoTP slices per rank (BLOOM) records which global heads this rank holds
  (:func:`alibi_head_range`); a head's slope depends on its global index, so the policy takes the slopes of those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .base import Source

# What AutoTP records on a module it changed (``hf_dsinfer.parallel.layers.TP_ATTR``; a dict with a "kind").
TP_RECORD = "_dsinfer_tp"
# Fused weights and how AutoTP must have split the HF modules they are packed from.
_ROW = ("attn.o.weight", "mlp.down.weight")
_COLUMN = ("attn.qkv.weight", "mlp.up.weight")


@dataclass(frozen=True)
class TPLayout:
    """One rank's view of a tensor-parallel model, as kernel injection needs it.

    ``heads``: attention output projection (module path) -> ``(local q heads, local kv heads)``. ``row_parallel`` /
    ``column_parallel``: module paths AutoTP split by input / output features. ``reduce``: the in-place sum over
    the ranks (row-parallel linears apply it before their bias). ``config``: the model config with this rank's head
    counts (None: keep the model's own). ``split_norms``: norm modules AutoTP split with all-reduced statistics.
    """

    heads: dict[str, tuple[int, int]]
    row_parallel: frozenset[str]
    column_parallel: frozenset[str]
    reduce: Callable[[torch.Tensor], torch.Tensor]
    config: Any = None
    # norms over a whole head-split projection whose statistics AutoTP all-reduces (OLMo-2's q/k norm)
    split_norms: frozenset[str] = frozenset()

    @contextmanager
    def local_config(self, model: nn.Module) -> Iterator[None]:
        """While policies read specs and weight maps, ``model.config`` is :attr:`config` (this rank's head counts).

        Policies read head counts from the config or from the attention modules (which AutoTP already rewrote), so
        both agree on the local numbers; the global config is restored afterwards.
        """
        if self.config is None:
            yield
            return
        original = model.config
        model.config = self.config
        try:
            yield
        finally:
            model.config = original

    def check(self, prefix: str, layers: nn.ModuleList, specs: list, maps: list[dict[str, Source]]) -> str | None:
        """Why the fused layers cannot take over this split (a reason for the fallback warning), or None.

        Reads no weight values: the packed qkv shape is worked out on the meta device.
        """
        for i, (hf_layer, spec, wmap) in enumerate(zip(layers, specs, maps)):
            reason = self._check_layer(i, f"{prefix}.{i}", hf_layer, spec, wmap)
            if reason:
                return reason
        return None

    def _check_layer(self, i: int, path: str, hf_layer: nn.Module, spec: Any, wmap: dict[str, Source]) -> str | None:
        row, column = _ROW, _COLUMN
        if getattr(spec, "moe", None) is not None:
            # MoE layer: the experts are split by parallel/moe.py (not linears); a shared expert is a dense MLP
            shared = "mlp.shared.up.weight" in wmap
            row = ("attn.o.weight",) + (("mlp.shared.down.weight",) if shared else ())
            column = ("attn.qkv.weight",) + (("mlp.shared.up.weight",) if shared else ())
        sources = {name: _modules(path, wmap, name) for name in row + column}
        for name in row:
            if not sources[name] or not sources[name] <= self.row_parallel:
                return f"{name} of layer {i} is not packed from a row-parallel (input-split) module"
        for name in column:
            if not sources[name] or not sources[name] <= self.column_parallel:
                return f"{name} of layer {i} is not packed from column-parallel (output-split) modules"
        fused_rows = set().union(*(sources[name] for name in row))
        stray = sorted(m for m in self.row_parallel if m.startswith(path + ".") and m not in fused_rows)
        if stray:
            return f"layer {i} has row-parallel modules the fused layer does not reduce: {', '.join(stray)}"
        a = spec.attention
        norms = sorted(n for n in self.split_norms if n.startswith(path + "."))
        if norms:
            # The fused layer sums the statistics over the ranks only for its q/k norm, and only when told to.
            qk = _modules(path, wmap, "attn.q_norm.weight") | _modules(path, wmap, "attn.k_norm.weight")
            if getattr(a, "qk_norm_split", None) is None or not set(norms) <= qk:
                return (
                    f"layer {i} normalizes over all heads ({norms[0]}), which tensor parallelism splits with "
                    "all-reduced statistics; the fused layer would normalize this rank's heads only"
                )
        (o_proj,) = sources["attn.o.weight"]
        local = self.heads.get(o_proj)
        if getattr(a, "alibi_slopes", None) is not None:
            # A head's slope depends on its index in the whole model: the policy must have read this rank's heads.
            ranges = [r for r in map(alibi_head_range, hf_layer.modules()) if r is not None]
            if len(ranges) != 1 or ranges[0][1] - ranges[0][0] != a.num_heads:
                return (
                    f"layer {i} uses ALiBi, but AutoTP recorded no single range of this rank's heads ({ranges}) "
                    f"matching its {a.num_heads} local heads, so the slopes cannot be offset"
                )
        if local != (a.num_heads, a.num_kv_heads):
            return (
                f"layer {i}'s policy reports {a.num_heads} q / {a.num_kv_heads} kv heads on this rank but the "
                f"split keeps {local}"
            )

        def get(n: str) -> torch.Tensor:  # a parameter, or a weight-only quantized linear's buffer (same rows)
            try:
                return hf_layer.get_parameter(n).to("meta")
            except AttributeError:
                return hf_layer.get_buffer(n).to("meta")

        rows = wmap["attn.qkv.weight"].pack(get).shape[0]
        if rows != (a.num_heads + 2 * a.num_kv_heads) * a.head_dim:
            return (
                f"layer {i}'s split qkv has {rows} rows, not ({a.num_heads} + 2 * {a.num_kv_heads}) * "
                f"{a.head_dim} for the local heads"
            )
        return None


def _modules(layer_path: str, wmap: dict[str, Source], fused_name: str) -> set[str]:
    """Module paths of the HF parameters fused tensor ``fused_name`` of one layer is packed from."""
    src = wmap.get(fused_name)
    return {f"{layer_path}.{n.rpartition('.')[0]}" for n in src.names()} if src is not None else set()


def alibi_head_range(module: nn.Module) -> tuple[int, int, int] | None:
    """``(first, stop, all)``: the global q heads ``[first, stop)`` of ``all`` this rank holds of an attention module
    whose per-head ALiBi bias AutoTP slices (BLOOM), or None when the module is not split that way."""
    record = getattr(module, TP_RECORD, None)
    if not isinstance(record, dict) or record.get("kind") != "alibi" or "of" not in record:
        return None
    start, stop = record["heads"]
    return int(start), int(stop), int(record["of"])
