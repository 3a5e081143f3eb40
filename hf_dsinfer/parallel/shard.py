"""Which slice of each tensor a tensor-parallel rank keeps: pure index arithmetic, no torch.distributed.

A :class:`Shard` names the rows (or columns) a rank keeps along one dim as ``[start, stop)`` pieces, concatenated in
order, optionally followed by one inner cut along another dim (a range of MoE experts, then features within them).
The same object cuts an in-memory tensor (:meth:`Shard.take`) and reads the piece straight from a safetensors file
(:meth:`Shard.read`), so in-place sharding, per-rank sliced loading and the fused layers' TP plans (policies declare
``column`` / ``row`` / ``qkv`` / ``gate_up``) all share one set of rules:

* **Heads** are never split, and KV-head groups stay whole. With at least as many kv heads as ranks, the kv heads
  are dealt out like DeepSpeed does (``kv // tp`` each, one more for the first ``kv % tp`` ranks: 40 heads on 3 ranks
  -> 14 / 13 / 13) and every rank keeps the q heads that attend to its kv heads. With fewer kv heads than ranks
  (``tp % num_kv_heads == 0``), each kv head is replicated on ``tp // num_kv_heads`` ranks, which share its q heads
  the same way.
* **Grain rule** for the MLP intermediate dim and the vocab: the dim is cut into ``n // grain`` units of ``grain``
  elements (``tensor_parallel.tp_grain_size``, default 64 like DeepSpeed); ``units // tp`` go to each rank, the first
  ``units % tp`` ranks take one more, and the last rank also takes the ``n % grain`` left over. A dim too small to
  give every rank one unit is split element by element. Any size works: vocab 50257 on 3 ranks -> 16768 / 16768 /
  16721.
* **Fused layouts** (``[q | k | v]``, per-head interleaved ``[q k v]``, ``[gate | up]``) are lists of segments; a
  rank keeps, in every segment, the units it would keep from the unfused tensor, so each part splits consistently.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

Ranges = tuple[tuple[int, int], ...]
DEFAULT_GRAIN = 64  # tensor_parallel.tp_grain_size's default, DeepSpeed's: slices stay multiples of a GEMM tile


@dataclass(frozen=True)
class Shard:
    """The pieces ``ranges`` (``[start, stop)``, in order) a rank keeps along ``dim`` of a tensor of ``full`` there.

    ``inner``: a second cut, along another dim, of the piece the first one keeps (MoE experts under expert parallelism
    combined with tensor parallelism keep a range of experts along dim 0 and, within them, a slice of features).
    """

    dim: int
    ranges: Ranges
    full: int
    inner: Shard | None = None

    def __post_init__(self) -> None:
        if self.inner is not None and (self.inner.dim == self.dim or self.inner.inner is not None):
            raise ValueError(f"a Shard's inner cut must be one cut along another dim than {self.dim}")

    @property
    def size(self) -> int:
        """Length of the kept dim (the outer one)."""
        return sum(b - a for a, b in self.ranges)

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """``shape`` with ``dim`` (and the inner cut's dim) shrunk to the kept lengths (checks the full lengths)."""
        if shape[self.dim] != self.full:
            raise ValueError(f"tensor of shape {tuple(shape)} does not match a shard of {self.full} along {self.dim}")
        out = list(shape)
        out[self.dim] = self.size
        return self.inner.local_shape(out) if self.inner is not None else tuple(out)

    def narrow(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full ``tensor``: a view where every cut keeps one range, else a new tensor."""
        self.local_shape(tensor.shape)
        parts = [tensor.narrow(self.dim, a, b - a) for a, b in self.ranges]
        piece = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)
        return self.inner.narrow(piece) if self.inner is not None else piece

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full ``tensor``, as a new contiguous tensor (the full one can then be freed)."""
        return self.narrow(tensor).contiguous().clone()

    def read(self, tensor_slice, shape: Sequence[int]) -> torch.Tensor:
        """This rank's piece read from a safetensors ``get_slice`` object of a tensor of ``shape``, as a private copy.

        safetensors returns views into a copy-on-write map of the whole file; copying keeps only this rank's bytes
        resident and lets the map go once the file is closed. With an inner cut, each block read is the
        intersection of both cuts' ranges, so no byte outside the rank's piece is copied.
        """
        self.local_shape(shape)
        inner = self.inner
        pieces = []
        for a, b in self.ranges:
            blocks = []
            for r in inner.ranges if inner is not None else (None,):
                index = [slice(None)] * len(shape)
                index[self.dim] = slice(a, b)
                if r is not None:
                    index[inner.dim] = slice(*r)
                blocks.append(tensor_slice[tuple(index)])
            pieces.append(blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=inner.dim))
        if len(pieces) == 1:
            return pieces[0].clone(memory_format=torch.contiguous_format)
        return torch.cat(pieces, dim=self.dim)


def _merge(ranges: Iterable[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def split_units(n: int, tp: int, rank: int, grain: int = 1, what: str = "dimension") -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank`` when ``n`` elements are split over ``tp`` ranks by the grain rule."""
    if n < tp:
        raise ValueError(f"{what} ({n}) is smaller than tensor_parallel.tp_size={tp}; lower tp_size.")
    if n // grain < tp:
        grain = 1  # too few whole units to give every rank one: split element by element
    units, leftover = divmod(n, grain)
    base, extra = divmod(units, tp)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return start * grain, stop * grain + (leftover if rank == tp - 1 else 0)


def split_sizes(n: int, tp: int, grain: int = 1, what: str = "dimension") -> list[int]:
    """Every rank's length under :func:`split_units` (rank order)."""
    return [b - a for a, b in (split_units(n, tp, r, grain, what) for r in range(tp))]


def _deal(n: int, tp: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``n`` whole items dealt over ``tp`` ranks: the first ``n % tp`` ranks get one more."""
    base, extra = divmod(n, tp)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class HeadPartition:
    """The q heads ``[q_start, q_stop)`` and kv heads ``[kv_start, kv_stop)`` one rank keeps."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start

    @classmethod
    def for_rank(cls, num_heads: int, num_kv_heads: int, tp: int, rank: int, where: str = "") -> HeadPartition:
        """Rank ``rank``'s heads; errors say which numbers do not fit together (``where`` names the module)."""
        at = f" in {where}" if where else ""
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) does not divide num_attention_heads ({num_heads}){at}."
            )
        group = num_heads // num_kv_heads  # q heads per kv head
        if num_kv_heads >= tp:
            kv_start, kv_stop = _deal(num_kv_heads, tp, rank)
            return cls(kv_start * group, kv_stop * group, kv_start, kv_stop)
        if tp % num_kv_heads:
            raise ValueError(
                f"tensor_parallel.tp_size={tp} and num_key_value_heads ({num_kv_heads}){at}: with fewer kv heads than "
                f"ranks, tp_size must be a multiple of {num_kv_heads} (each kv head is then replicated on "
                f"tp_size / {num_kv_heads} ranks); use tp_size <= {num_kv_heads} or a multiple of it."
            )
        sharers = tp // num_kv_heads  # ranks replicating one kv head, sharing its q heads
        if group < sharers:
            raise ValueError(
                f"tensor_parallel.tp_size={tp} is more than num_attention_heads ({num_heads}){at}: some rank would "
                f"hold no head; use tp_size <= {num_heads}."
            )
        kv = rank // sharers
        q_start, q_stop = _deal(group, sharers, rank % sharers)
        return cls(kv * group + q_start, kv * group + q_stop, kv, kv + 1)

    def keeps(self) -> dict[str, tuple[int, int]]:
        """Unit ranges per part name, for :func:`select`: q heads, and kv heads for ``k`` and ``v``."""
        kv = (self.kv_start, self.kv_stop)
        return {"q": (self.q_start, self.q_stop), "k": kv, "v": kv}


# A layout lists the segments of a fused dim in order: (part name, first unit, unit count, elements per unit).
Segment = tuple[str, int, int, int]


def concat_layout(parts: Sequence[tuple[str, int, int]]) -> list[Segment]:
    """Parts stored one after the other, ``[(name, units, unit_size), ...]``: e.g. ``[q | k | v]``, ``[gate | up]``."""
    return [(name, 0, units, size) for name, units, size in parts]


def grouped_layout(groups: int, per_group: Sequence[tuple[str, int, int]]) -> list[Segment]:
    """Parts interleaved per group: ``groups`` times ``per_group`` (e.g. GPT-NeoX's per-head ``[q k v]``: groups =
    heads, per_group = ``[("q", 1, d), ("k", 1, d), ("v", 1, d)]``; Falcon-40B's per-kv-group ``[q.. k v]``)."""
    return [(name, g * units, units, size) for g in range(groups) for name, units, size in per_group]


def select(layout: Sequence[Segment], keep: dict[str, tuple[int, int]], dim: int = 0) -> Shard:
    """The :class:`Shard` keeping, in every segment, the units of each part inside ``keep[part]`` (``[lo, hi)``)."""
    ranges = []
    offset = 0
    for name, first, units, size in layout:
        lo, hi = keep[name]
        a, b = max(first, lo), min(first + units, hi)
        if a < b:
            ranges.append((offset + (a - first) * size, offset + (b - first) * size))
        offset += units * size
    return Shard(dim, _merge(ranges), offset)


def even_shard(n: int, tp: int, rank: int, dim: int = 0, grain: int = 1, what: str = "dimension") -> Shard:
    """A plain split of ``n`` by the grain rule along ``dim``."""
    a, b = split_units(n, tp, rank, grain, what)
    return Shard(dim, ((a, b),), n)


def halves_shard(n: int, tp: int, rank: int, dim: int = 0, grain: int = 1, what: str = "dimension") -> Shard:
    """``[gate | up]`` of ``n`` elements: each half split by the grain rule, the two pieces kept in order."""
    if n % 2:
        raise ValueError(f"fused gate/up {what} ({n}) is odd; it cannot hold two equal halves.")
    half = n // 2
    a, b = split_units(half, tp, rank, grain, what)
    return Shard(dim, _merge([(a, b), (half + a, half + b)]), n)
