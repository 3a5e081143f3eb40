"""Weight-only int8 / int4 matmuls on CPU through torch's packed-weight ops, packed once at load.

:func:`pack_for_cpu` turns a weight in :mod:`.quant_format`'s layout into a :class:`CpuPackedWeight` (tensors plus a
few ints; the tensors can be registered as non-persistent buffers and the object rebuilt from them with
:meth:`CpuPackedWeight.from_buffers`); :func:`cpu_quant_matmul` multiplies with it. Kinds:

* ``fp16gemm``: fbgemm's fp16-weight GEMM for fp32 activations (``torch.ops.quantized.linear_prepack_fp16`` /
  ``linear_dynamic_fp16``, vectorized on AVX2; 2 bytes per weight). Per channel it
  holds the integers ``q - z`` (|q - z| <= 255: exact in fp16) and multiplies the fp32 result by the row's scale,
  so it is exact like the reference. With groups it holds ``(q - z) * s`` in fp16: exact for int4 weights from
  :func:`~.quant_format.quantize_weight` (their scales have at most 8 / 7 significant bits), rounded once (2^-11
  relative per weight, ~1e-3 of the outputs) for other scales; :attr:`CpuPackedWeight.exact` says which. The
  packed matrix is an opaque object fbgemm owns (a TorchScript class, not a tensor): it cannot be cloned or moved
  (``.to``), so it is not among :meth:`CpuPackedWeight.buffers`; a deep copy packs again. Under ``torch.compile`` it
  runs as the op ``hf_dsinfer::fp16_weight_linear``, one opaque call that receives an int slot of a table holding
  the packed object (so the graph's inputs stay tensors and ints).
* ``fp16gemm_exact``: with groups, the integers ``q - z`` and block-expanded activations (row ``g * M + m`` is row
  ``m`` masked to group ``g``'s columns): one GEMM gives every group's partial sums, scaled and summed in fp32, so
  it is exact and reads the weight once; up to :data:`FP16GEMM_MAX_EXPANDED_ROWS` expanded rows, beyond which it
  dequantizes per call (slow: measured in docs/kernels.md). Per channel it is ``fp16gemm``.
* ``int8pack``: ``torch._weight_int8pack_mm`` (int8 ``[N, K]``, one scale per row): int8, symmetric, per channel.
* ``int4pack``: ``torch._weight_int4pack_mm_for_cpu`` over ``torch._convert_weight_to_int4pack_for_cpu``'s layout.
  The op computes ``(u - 8) * scale + zero`` per group; any affine ``(u - z) * s`` maps onto it with
  ``scale = s`` and ``zero = (8 - z) * s``. It takes groups of 32/64/128/256 columns, ``K`` a multiple of the group
  and ``N`` a multiple of 16: a group size that is a multiple of 32 is expressed with the largest of those dividing
  it (scales repeated), per-channel weights with 128 (or less), ``K`` is padded with zero activations (the padded
  weight columns then add nothing) and ``N`` with zero rows sliced off the output.
* ``dequant``: every spec. int8 values ``[N, K_pad]``, ``K`` padded to whole groups; int4 of an even group size
  as nibbles ``[N, K_pad / 2]`` uint8 (two codes per byte, split per group: :mod:`.quant_cpu_fused`) with the
  products ``z * s`` in place of the zeros, int4 of an odd group size one byte per code. Each call dequantizes
  with one broadcast multiply per group (``(q - z) * s`` in fp32, the reference's values; nibbles ``u * s - z * s``,
  one rounding apart) and runs one ``F.linear``. Inside a compiled graph, at up to :data:`FUSED_DEQUANT_MAX_ROWS`
  rows (decoding), it is instead one reduction that inductor fuses into a single loop
  (:func:`~.quant_cpu_fused.fused_matmul`, :func:`~.quant_cpu_fused.fused_nibble_matmul`): the stored bytes are
  read once and no fp32 weight is written per call.

Exactness: the ops take their scales in the activation dtype and return that dtype, so with
``compute_dtype=torch.float32`` (the default) activations are cast to fp32, the scales are kept in fp32 and the
result is the reference's ``x @ dequant(w).T`` up to fp32 summation order (``fp16gemm`` with groups aside), then
rounded once to ``x.dtype``. With
``compute_dtype=torch.bfloat16`` the activations and the result are rounded to bf16 (2^-8 relative each): faster on
CPUs whose torch kernels vectorize only bf16 (measured in docs/kernels.md), not exact.

Validation: torch's weight ops are not right everywhere (``torch._weight_int8pack_mm`` with bf16 activations at ``K``
not a multiple of 16 returns garbage or crashes on torch 2.13; table in docs/quantization.md), so before a kind other
than ``dequant`` is used :func:`pack_for_cpu` checks it once per shape class (:func:`check_kind`, cached): first
:func:`known_bad`'s rules (a segmentation fault cannot be probed in-process), then a probe of a few milliseconds
against the exact dequantized reference. A kind that fails is not used: the weight is packed as ``dequant`` (the
reference's own computation) with one info line naming the kind, the reason and the fallback.

The packed layouts are torch's internal ones: never save them; pack again at load.
``python -m hf_dsinfer.kernels.quant_cpu`` measures every kind against fp32 ``F.linear`` (see :func:`main`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging

import torch
import torch.nn.functional as F

from .quant_cpu_fused import fused_matmul as _fused_matmul
from .quant_cpu_fused import fused_nibble_matmul, pack_nibbles, unpack_nibbles
from .quant_format import QuantSpec

__all__ = [
    "FALLBACK_KIND",
    "KINDS",
    "CpuPackedWeight",
    "Fp16Pack",
    "check_kind",
    "cpu_quant_matmul",
    "default_kind",
    "fbgemm_available",
    "known_bad",
    "pack_for_cpu",
    "supported_kinds",
]

# hf_dsinfer's logger by name (``hf_dsinfer.log`` imports transformers, which kernels/ must not): same object.
_logger = logging.getLogger("transformers.hf_dsinfer")

KINDS = ("fp16gemm", "fp16gemm_exact", "int8pack", "int4pack", "dequant")
#: fp16gemm_exact with groups runs M * G rows through one GEMM up to this many (decode); more dequantize per call.
FP16GEMM_MAX_EXPANDED_ROWS = 16
_INT4_GROUPS = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts


@dataclasses.dataclass(frozen=True)
class CpuPackedWeight:
    """A quantized weight packed for :func:`cpu_quant_matmul`.

    ``weight``: an :class:`Fp16Pack` (fp16gemm), int8 ``[N, K]`` (int8pack), torch's int4 layout ``[N_pad, K_pad / 2]``
    uint8 (int4pack) or int8 ``[N, K_pad]`` values / uint8 ``[N, K_pad / 2]`` nibbles (dequant). ``scales``: fp32
    ``[N]`` or ``[G, N]`` (fp16gemm), ``[N]`` (int8pack), ``[K_pad / group, N_pad, 2]`` scale-and-zero pairs
    (int4pack) or fp32 ``[N, G, 1]`` (dequant). ``zeros``: fp32 ``[N, G, 1]`` (dequant, asymmetric), fp32 ``z * s``
    ``[N, G]`` (dequant nibbles), the 0/1 group mask ``[G, K]`` (fp16gemm with groups), else None. Ints and the spec
    are plain attributes, so ``torch.compile`` treats them as constants.
    """

    kind: str
    weight: torch.Tensor | Fp16Pack
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    spec: QuantSpec
    in_features: int
    out_features: int
    group: int = 0  # int4pack: the op's group size; dequant: the spec's
    k_padded: int = 0  # K rounded up to a multiple of ``group``
    compute_dtype: torch.dtype = torch.float32
    source: tuple = ()  # fp16gemm: (qweight, scales, zeros) it was packed from, to pack a deep copy again
    exact: bool = True  # False: fp16gemm with groups whose (q - z) * s did not all fit fp16 (rounded once)
    # fp16gemm of int8 weights: (q [N, K] int8, s [N, G, 1] fp32, z [N, G, 1] fp32 or None), the stored integers (no
    # copy) that a compiled decode step reduces over directly (:func:`_fused_matmul`): 1 byte per weight, not 2.
    fused: tuple = ()
    # dequant of int4 with an even group size: ``weight`` is [N, K_pad / 2] uint8, two codes per byte
    # (quant_cpu_fused.pack_nibbles), ``zeros`` the fp32 products z * s ``[N, G]`` (8 * s when symmetric).
    nibbles: bool = False

    def __deepcopy__(self, memo: dict) -> CpuPackedWeight:
        import copy

        if not self.kind.startswith("fp16gemm"):
            fields = {f.name: copy.deepcopy(getattr(self, f.name), memo) for f in dataclasses.fields(self)}
            return CpuPackedWeight(**fields)
        qweight, scales, zeros = copy.deepcopy(self.source, memo)  # fbgemm's handle cannot be copied: pack again
        return pack_for_cpu(qweight, scales, zeros, self.spec, self.in_features, kind=self.kind)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The tensors, to register as non-persistent buffers (``module.register_buffer(name, t, persistent=False)``)
        so ``.to()`` moves them; rebuild with :meth:`from_buffers` afterwards."""
        fbgemm = self.kind.startswith("fp16gemm")
        out = {} if fbgemm else {"weight": self.weight}
        if self.scales is not None:
            out["scales"] = self.scales
        if self.zeros is not None:
            out["zeros"] = self.zeros
        return out

    def from_buffers(self, buffers: dict[str, torch.Tensor]) -> CpuPackedWeight:
        """This packing with its tensors replaced (same metadata), e.g. after the module moved its buffers."""
        return dataclasses.replace(self, weight=buffers.get("weight", self.weight), scales=buffers.get("scales"),
                                   zeros=buffers.get("zeros"))  # fmt: skip


def fbgemm_available() -> bool:
    """Whether this torch build has fbgemm (x86 builds; not macOS/ARM), which ``fp16gemm`` needs."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        ops = torch.ops.quantized
        return ops.linear_prepack_fp16 is not None and ops.linear_dynamic_fp16 is not None
    except (AttributeError, RuntimeError):  # pragma: no cover - a build without the quantized ops
        return False


# fbgemm's fp16 weight lives in a TorchScript object (``LinearPackedParamsBase``), which fake tensors cannot run and
# which is not a tensor a compiled graph can take as an input. Each packing is kept in this table under an int slot:
# the graph's op receives the slot (a constant of the traced code) and looks the object up. The slot is freed when the
# last CpuPackedWeight holding its Fp16Pack is collected.
_FP16_PACKS: dict[int, torch.ScriptObject] = {}
_FP16_SLOTS = itertools.count()


class Fp16Pack:
    """fbgemm's fp16-packed weight (``torch.ops.quantized.linear_prepack_fp16``) and its slot in the op's table."""

    __slots__ = ("slot", "__weakref__")

    def __init__(self, weight: torch.Tensor):
        """Pack ``weight [N, K]`` (fp32, rounded to fp16 by fbgemm)."""
        self.slot = next(_FP16_SLOTS)
        _FP16_PACKS[self.slot] = torch.ops.quantized.linear_prepack_fp16(weight.contiguous(), None)

    @property
    def packed(self) -> torch.ScriptObject:
        return _FP16_PACKS[self.slot]

    def __del__(self, _packs: dict = _FP16_PACKS) -> None:  # the table bound now: module globals are gone at exit
        _packs.pop(self.slot, None)


# Inside torch.compile the fp16 GEMM is one opaque op (defined with torch.library directly: ~15 us per call here,
# where a torch.library.custom_op costs ~80 us); eager calls skip the op and call fbgemm directly.
_LIB = torch.library.Library("hf_dsinfer", "FRAGMENT")
_OP = "fp16_weight_linear"
try:
    _LIB.define(f"{_OP}(Tensor x, int slot, int out_features) -> Tensor")
except RuntimeError:  # pragma: no cover - defined already (the module imported twice under two names)
    pass
else:
    _LIB.impl(_OP, lambda x, slot, out_features: torch.ops.quantized.linear_dynamic_fp16(x, _FP16_PACKS[slot]),
              "CPU")  # fmt: skip
    torch.library.register_fake(f"hf_dsinfer::{_OP}", lambda x, slot, out_features: x.new_empty(x.shape[0],
                                out_features), lib=_LIB)  # fmt: skip


# ``materialize(x)``: a copy of ``x`` that inductor cannot see through (an opaque op), so the producer of ``x`` is
# computed once into a buffer instead of being fused into, and recomputed by, every consumer loop (the fused
# dequantize-and-reduce matmul below).
try:
    _LIB.define("materialize(Tensor x) -> Tensor")
except RuntimeError:  # pragma: no cover - defined already (the module imported twice under two names)
    pass
else:
    _LIB.impl("materialize", lambda x: x.clone(), "CPU")
    torch.library.register_fake("hf_dsinfer::materialize", lambda x: torch.empty_like(x), lib=_LIB)

@functools.cache  # registered once per process; later calls return the first answer
def lower_materialize() -> bool:
    """Give inductor a lowering of ``hf_dsinfer::materialize``: a copy that inductor realizes into a buffer of the
    generated code, so the producer is still computed once (not inlined into the consumer loop) but no opaque op is
    called. Without it every use is a call back into Python (~7 us here; the compiled SmolLM2 decode step makes 120)
    plus a size and an alignment assert on its output. Called before a graph is compiled (idempotent); False when this
    torch's inductor has no such hook (the opaque op then stays, same values)."""
    try:
        from torch._inductor.lowering import clone, register_lowering
    except ImportError:  # pragma: no cover - an inductor without these names: keep the opaque op
        return False

    def _lowered(x):
        out = clone(x)  # a pointwise copy of x's values
        out.realize()  # stored once into a buffer: consumers load it instead of recomputing x's producer
        return out

    register_lowering(torch.ops.hf_dsinfer.materialize.default, type_promotion_kind=None)(_lowered)
    return True


def _fp16_weight_linear(x: torch.Tensor, pack: Fp16Pack, out_features: int) -> torch.Tensor:
    """``x [M, K]`` fp32 times the fbgemm-packed fp16 weight: ``[M, out_features]`` fp32."""
    if torch.compiler.is_compiling():
        return torch.ops.hf_dsinfer.fp16_weight_linear(x, pack.slot, out_features)
    return torch.ops.quantized.linear_dynamic_fp16(x, pack.packed)


def _int4_group(spec: QuantSpec, in_features: int) -> int | None:
    """The op's group size expressing ``spec``'s groups, or None when none does."""
    if spec.n_groups(in_features) == 1:  # per channel: any group works, the scale is repeated
        return next(g for g in _INT4_GROUPS if g <= max(32, min(128, in_features)))
    return next((g for g in _INT4_GROUPS if spec.group_size % g == 0), None)


def supported_kinds(spec: QuantSpec, in_features: int) -> tuple[str, ...]:
    """The kinds :func:`pack_for_cpu` can build for ``spec`` (``dequant`` always)."""
    spec = spec.for_features(in_features)
    kinds = ["fp16gemm", "fp16gemm_exact"] if fbgemm_available() else []
    if spec.float_zero:  # fractional q - z: fp16gemm_exact's integers do not exist (fp16gemm rounds, exact=False)
        kinds = kinds[:1]
    if spec.num_bits == 8 and spec.symmetric and spec.n_groups(in_features) == 1:
        kinds.append("int8pack")
    if spec.num_bits == 4 and _int4_group(spec, in_features) is not None:
        kinds.append("int4pack")
    return (*kinds, "dequant")


def default_kind(spec: QuantSpec, in_features: int, compute_dtype: torch.dtype = torch.float32) -> str:
    """The kind :func:`pack_for_cpu` picks, from the measurements in docs/kernels.md.

    Every default is exact. fp32 compute: per channel ``fp16gemm`` (1.5-3.6x faster than fp32 ``F.linear`` on the
    AVX2 dev machine), with groups ``dequant`` (0.2-1.2x; ``fp16gemm`` is the fast choice there but rounds weights to
    fp16, ``fp16gemm_exact`` is exact and ~1.0-1.2x for a few decode rows only). torch's int8/int4 weight kernels
    have no vectorized fp32 path there (0.04-0.43x). bf16 compute: ``int8pack`` / ``int4pack`` where they apply
    (1.4-3.4x, activations and outputs rounded to bf16), else ``dequant``.
    """
    kinds = supported_kinds(spec, in_features)
    if compute_dtype == torch.bfloat16:
        return next(k for k in kinds if not k.startswith("fp16gemm"))
    per_channel = spec.for_features(in_features).n_groups(in_features) == 1
    exact_fp16 = not spec.float_zero  # a fractional zero point makes q - z inexact in fp16
    return "fp16gemm" if per_channel and exact_fp16 and "fp16gemm" in kinds else "dequant"


def pack_for_cpu(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    spec: QuantSpec,
    in_features: int,
    *,
    kind: str | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> CpuPackedWeight:
    """Pack a :mod:`.quant_format` weight for :func:`cpu_quant_matmul` (once, at load; the inputs are not kept
    unless ``kind="dequant"``). ``kind``: one of :data:`KINDS` (default: :func:`default_kind`); ``compute_dtype``:
    fp32 (exact) or bf16 (see the module docstring). A kind that :func:`check_kind` rejects for this shape is
    replaced by :data:`FALLBACK_KIND` (one info line per shape class): the result's ``kind`` says which was used."""
    spec = spec.for_features(in_features)
    if compute_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"compute_dtype must be torch.float32 or torch.bfloat16, got {compute_dtype}")
    kind = kind or default_kind(spec, in_features, compute_dtype)
    if kind not in supported_kinds(spec, in_features):
        raise ValueError(f"kind={kind!r} cannot hold {spec} (in_features={in_features}); use one of "
                         f"{supported_kinds(spec, in_features)}")  # fmt: skip
    if kind.startswith("fp16gemm") and compute_dtype != torch.float32:
        raise ValueError(f"kind={kind!r} computes in fp32 (fp32 activations, fp16 weights); drop compute_dtype")
    if kind != FALLBACK_KIND and check_kind(kind, spec, in_features, qweight.shape[0], compute_dtype) is not None:
        kind = FALLBACK_KIND
    return _pack(qweight, scales, zeros, spec, in_features, kind, compute_dtype)


def _pack(
    qweight: torch.Tensor,
    scales: torch.Tensor | None,
    zeros: torch.Tensor | None,
    spec: QuantSpec,
    in_features: int,
    kind: str,
    compute_dtype: torch.dtype,
) -> CpuPackedWeight:
    """:func:`pack_for_cpu` without the checks (``spec`` already for ``in_features``, ``kind`` supported)."""
    n, k = qweight.shape[0], in_features
    if kind.startswith("fp16gemm"):
        if spec.num_bits == 4:
            from .quant_format import unpack_int4

            q = unpack_int4(qweight, k).float() - (8.0 if zeros is None else 0.0)  # [N, K]
        else:
            q = qweight.float()
        groups = spec.n_groups(k)
        col_group = torch.arange(k) // spec.group_size  # [K]
        if zeros is not None:
            q = q - zeros.float()[:, col_group]  # integers in [-255, 255], unless the zero point is fractional
        if kind == "fp16gemm" and groups > 1:  # the dequantized weight in fp16: exact where it fits (int4 scales of
            q, post, mask = q * scales.float()[:, col_group], None, None  # quantize_weight do), else rounded once
        else:
            # q - z (exact in fp16 when an integer); the scales multiply the fp32 products after the GEMM: per row,
            # or per group on the block-expanded activations (see cpu_quant_matmul).
            post = scales.float().reshape(n).contiguous() if groups == 1 else scales.float().t().contiguous()
            mask = None if groups == 1 else (col_group[None, :] == torch.arange(groups)[:, None]).float()  # [G, K]
        exact = torch.equal(q.half().float(), q)  # what the fp16 pack holds is what the reference computes
        packed = Fp16Pack(q)  # an opaque object owned by fbgemm
        fused = ()
        if spec.num_bits == 8 and k % spec.group_size == 0:  # whole groups: the integers reshape to [N, G, gs]
            fused = (qweight.contiguous(), scales.float().reshape(n, groups, 1).contiguous(),
                     zeros.float().reshape(n, groups, 1).contiguous() if zeros is not None else None)  # fmt: skip
        return CpuPackedWeight(kind, packed, post, mask, spec, k, n, spec.group_size, k, compute_dtype=compute_dtype,
                               source=(qweight, scales, zeros), exact=exact, fused=fused)  # fmt: skip
    if kind == "dequant":
        gs, groups = spec.group_size, spec.n_groups(k)
        k_pad = gs * groups
        if spec.num_bits == 4 and gs % 2 == 0:
            # Two codes per byte, in the split layout the compiled decode reduction reads (quant_cpu_fused.py);
            # ``zeros`` holds z * s (8 * s symmetric), the term Q4_1's dot product subtracts per group.
            from .quant_format import unpack_int4

            u = F.pad(unpack_int4(qweight, k), (0, k_pad - k))  # [N, K_pad] codes in [0, 15], padding code 0
            s = scales.float().reshape(n, groups, 1).contiguous()  # [N, G, 1]
            z = zeros.float().reshape(n, groups, 1) if zeros is not None else torch.full_like(s, 8.0)
            zs = (z * s).reshape(n, groups).contiguous()  # [N, G]
            return CpuPackedWeight("dequant", pack_nibbles(u, gs), s, zs, spec, k, n, gs, k_pad, compute_dtype,
                                   nibbles=True)  # fmt: skip
        if spec.num_bits == 4:  # an odd group size (per channel at an odd K): one byte per code
            from .quant_format import unpack_int4

            q = unpack_int4(qweight, k).to(torch.int16)  # [N, K] in [0, 15]
            q = (q - 8 if zeros is None else q).to(torch.int8)  # symmetric: the zero point folded in
        else:
            q = qweight
        if k_pad != k:
            q = F.pad(q, (0, k_pad - k))  # [N, K_pad] int8; padding columns meet zero activations
        q = q.contiguous()  # int8 without padding: the caller's qweight itself, no copy
        s = scales.float().reshape(n, groups, 1).contiguous()  # [N, G, 1]
        z = zeros.float().reshape(n, groups, 1).contiguous() if zeros is not None else None
        return CpuPackedWeight("dequant", q, s, z, spec, k, n, gs, k_pad, compute_dtype)
    if kind == "int8pack":
        s = scales.to(compute_dtype).reshape(n).contiguous()  # [N]
        return CpuPackedWeight("int8pack", qweight.contiguous(), s, None, spec, k, n, compute_dtype=compute_dtype)
    group = _int4_group(spec, k)
    k_pad = -(-k // group) * group
    n_pad = -(-n // 16) * 16
    from .quant_format import unpack_int4

    u = unpack_int4(qweight, k).to(torch.int32)  # [N, K] in [0, 15]
    u = F.pad(u, (0, k_pad - k, 0, n_pad - n), value=8)  # [N_pad, K_pad]; padding columns meet zero activations
    packed = torch._convert_weight_to_int4pack_for_cpu(u, 1)  # [N_pad, K_pad / 2] uint8, torch's layout
    # Per op group j: the original group of its first column (the op's group divides the original one).
    orig = torch.clamp(torch.arange(0, k_pad, group) // spec.group_size, max=spec.n_groups(k) - 1)  # [K_pad / group]
    s = scales.float()[:, orig]  # [N, K_pad / group]
    z = zeros.float()[:, orig] if zeros is not None else torch.full_like(s, 8.0)
    pairs = torch.stack([s, (8.0 - z) * s], dim=-1)  # [N, G', 2]: (u - z) * s == (u - 8) * s + (8 - z) * s
    pairs = F.pad(pairs, (0, 0, 0, 0, 0, n_pad - n)).transpose(0, 1).contiguous().to(compute_dtype)  # [G', N_pad, 2]
    return CpuPackedWeight("int4pack", packed, pairs, None, spec, k, n, group, k_pad, compute_dtype)


#: Rows up to which a compiled ``dequant`` matmul runs as one fused dequantize-and-reduce (:func:`_fuse_dequant`).
FUSED_DEQUANT_MAX_ROWS = 4


def _fuse_dequant(packed: CpuPackedWeight, rows: int) -> bool:
    """Whether a ``dequant`` matmul of ``rows`` rows takes the fused reduction: fp32 compute, inside a graph being
    compiled (inductor fuses it; eager would not), and a few rows (each row dequantizes the weight again in registers:
    measured on SmolLM2's MLP shape, 1 thread, loaded machine, 330-460 us against 700 us for the compiled
    dequantize-then-``F.linear``; docs/performance.md)."""
    return (packed.compute_dtype == torch.float32 and rows <= FUSED_DEQUANT_MAX_ROWS
            and torch.compiler.is_compiling())  # fmt: skip


# -- validation: a kind runs only where it computes the reference ----------------------------------------------------

#: The kind every spec can use and that computes the reference's own values (no torch weight op involved).
FALLBACK_KIND = "dequant"
#: Relative error (max |got - want| over max |want|) a probe accepts: fp32 compute differs from the reference only in
#: summation order (and fp16gemm with groups by one fp16 rounding, ~1e-3); bf16 compute rounds activations, scales
#: and the output to bf16 (2^-8 each). The failures seen are 1e7 to 1e38 or NaN.
_PROBE_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 5e-2}
_PROBE_ROWS = (1, 5)  # a decode row and a few rows of a batch
_checked: dict[tuple, str | None] = {}  # shape class -> None (checked good) or why the kind is not used


def known_bad(kind: str, in_features: int, compute_dtype: torch.dtype) -> str | None:
    """Why ``kind`` must not run at ``K = in_features`` with ``compute_dtype`` by rule (None: no rule against it).

    These are the combinations measured wrong on torch 2.13.0+cpu (docs/quantization.md, *CPU kinds torch gets
    wrong*): ``torch._weight_int8pack_mm`` with bf16 activations and K not a multiple of 16 returned values of 1e7 to
    1e38 (and NaN) at 1 and 3 rows and crashed the process (segmentation fault) at 2 and at 4 or more rows, for every
    such K tried (8 to 1032); every K that is a multiple of 16 was right, and so were fp16 and fp32 activations. A
    crash cannot be probed, so the rule applies before any probe and on every torch version (the fallback is exact).
    """
    if kind == "int8pack" and compute_dtype == torch.bfloat16 and in_features % 16:
        return (
            "torch._weight_int8pack_mm with bf16 activations returns garbage or crashes at K not a multiple of 16 "
            "(measured on torch 2.13)"
        )
    return None


def check_kind(
    kind: str, spec: QuantSpec, in_features: int, out_features: int, compute_dtype: torch.dtype = torch.float32
) -> str | None:
    """None when ``kind`` computes the exact dequantized reference for this shape class, else why it is not used.

    The shape class is (kind, compute dtype, spec, K, N mod 16): what torch's ops tile by. Checked once per class
    and cached: :func:`known_bad`'s rules, then a probe (:data:`_PROBE_ROWS` rows times a seeded random weight of
    16 to 31 rows, a few milliseconds). A rejection logs one info line naming the kind and :data:`FALLBACK_KIND`.
    """
    spec = spec.for_features(in_features)
    key = (kind, compute_dtype, spec, in_features, out_features % 16)
    if key not in _checked:
        why = known_bad(kind, in_features, compute_dtype) or _probe(kind, spec, in_features, out_features,
                                                                     compute_dtype)  # fmt: skip
        _checked[key] = why
        if why is not None:
            dtype = str(compute_dtype).removeprefix("torch.")
            _logger.info(
                "hf_dsinfer: CPU quantized kind %r not used for %s at K=%d (%s compute): %s; packing as %r instead "
                "(exact, slower)", kind, spec, in_features, dtype, why, FALLBACK_KIND,
            )  # fmt: skip
    return _checked[key]


def _probe(kind: str, spec: QuantSpec, k: int, n: int, compute_dtype: torch.dtype) -> str | None:
    """Pack a seeded random weight of ``16 + n % 16`` rows and ``k`` columns as ``kind`` and compare a few rows with
    :func:`~.quant_format.quant_matmul_reference`; None when it agrees, else what went wrong."""
    from .quant_format import quant_matmul_reference, quantize_weight

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16 + n % 16, k, generator=gen) / k**0.5  # [N', K]
    q, s, z = quantize_weight(w, spec, scale_dtype=torch.float32)
    try:
        packed = _pack(q, s, z, spec, k, kind, compute_dtype)
        for m in _PROBE_ROWS:
            x = torch.randn(m, k, generator=gen)  # [M, K]
            want = quant_matmul_reference(x.to(compute_dtype).float(), q, s, z, spec, k)  # [M, N']
            got = cpu_quant_matmul(x, packed)
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
            if not err <= _PROBE_TOLERANCE[compute_dtype]:  # NaN fails too
                return f"a {m}x{k} probe differed from the dequantized reference by {err:.3g} (relative)"
    except Exception as e:  # noqa: BLE001 - an op missing or refusing this shape: the kind is simply not used
        return f"a probe raised {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return None


def cpu_quant_matmul(x: torch.Tensor, packed: CpuPackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ dequant(w).T (+ bias) -> [..., N]`` in ``x.dtype`` with a :func:`pack_for_cpu` weight."""
    if x.shape[-1] != packed.in_features:
        raise ValueError(f"x must be [..., in_features={packed.in_features}], got {tuple(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.in_features)  # [M, K]
    if packed.fused and _fuse_dequant(packed, x2.shape[0]):
        # int8 weights packed for fbgemm, decoding under torch.compile: the stored integers read directly (1 byte per
        # weight against the fp16 pack's 2; measured faster on SmolLM2's shapes, docs/performance.md).
        y = _fused_matmul(x2, *packed.fused, packed.group, packed.in_features)
    elif packed.kind.startswith("fp16gemm"):
        xf = x2.to(torch.float32).contiguous()
        m, n, groups = xf.shape[0], packed.out_features, packed.spec.n_groups(packed.in_features)
        if packed.scales is None:  # fp16gemm with groups: the weight holds the scales
            y = _fp16_weight_linear(xf, packed.weight, n)
        elif groups == 1:
            y = _fp16_weight_linear(xf, packed.weight, n) * packed.scales  # [M, N] times the row scales
        elif m * groups <= FP16GEMM_MAX_EXPANDED_ROWS:
            # Group g's partial sums are x masked to g's columns times the integer weight: G * M rows through one
            # GEMM that still reads the weight once (decoding is bound by those bytes, not by the rows).
            xe = (xf[None] * packed.zeros[:, None, :]).reshape(groups * m, -1)  # [G * M, K]
            ye = _fp16_weight_linear(xe, packed.weight, n).view(groups, m, n)  # [G, M, N]
            y = (ye * packed.scales[:, None, :]).sum(0)  # [M, N]: per-group scales, then the sum over groups
        else:  # many rows (prefill): dequantize once for all of them
            dequant = _pack(*packed.source, packed.spec, packed.in_features, "dequant", torch.float32)
            return cpu_quant_matmul(x, dequant, bias)
    elif packed.kind == "dequant" and _fuse_dequant(packed, x2.shape[0]):
        fused = fused_nibble_matmul if packed.nibbles else _fused_matmul  # int4 two codes per byte, or one
        y = fused(x2, packed.weight, packed.scales, packed.zeros, packed.group, packed.k_padded)
    elif packed.kind == "dequant":
        n, groups = packed.out_features, packed.scales.shape[1]
        if packed.nibbles:  # u * s - z * s: the reference's (u - z) * s up to one rounding
            u = unpack_nibbles(packed.weight, packed.group, torch.float32)  # [N, K_pad] fp32 codes
            w = u.view(n, groups, packed.group).mul_(packed.scales).sub_(packed.zeros.view(n, groups, 1))
        else:
            q = packed.weight.view(n, groups, packed.group).to(torch.float32)  # [N, G, gs]
            w = (q - packed.zeros if packed.zeros is not None else q) * packed.scales
        w = w.view(n, packed.k_padded).to(packed.compute_dtype)  # [N, K_pad], the reference's
        xc = x2.to(packed.compute_dtype)
        if packed.k_padded != packed.in_features:
            xc = F.pad(xc, (0, packed.k_padded - packed.in_features))
        y = F.linear(xc, w)  # [M, N]
    elif packed.kind == "int8pack":
        y = torch._weight_int8pack_mm(x2.to(packed.compute_dtype).contiguous(), packed.weight, packed.scales)
    else:
        xc = x2.to(packed.compute_dtype)
        if packed.k_padded != packed.in_features:
            xc = F.pad(xc, (0, packed.k_padded - packed.in_features))  # [M, K_pad], zeros meet the padded columns
        y = torch._weight_int4pack_mm_for_cpu(xc.contiguous(), packed.weight, packed.group, packed.scales)
        y = y[:, : packed.out_features]  # [M, N]
    if bias is not None:
        y = y.float() + bias.float()
    return y.to(x.dtype).reshape(*lead, packed.out_features)
