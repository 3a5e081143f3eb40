"""Weight-only int8 / int4 quantization: the storage format and its plain-torch reference.

One format serves every path (Triton GEMMs on GPU, torch's packed CPU ops, the reference below, save/reload):

- A weight ``w [N, K]`` (``N`` = out features, ``K`` = in features) is cut along ``K`` into groups of
  ``group_size`` columns (the last group may be shorter); ``n_groups = ceil(K / group_size)``. Per-channel
  quantization is ``group_size = K`` (one group per row).
- ``scales [N, n_groups]`` and, for asymmetric quantization, ``zeros [N, n_groups]`` (both floating, the dtype the
  caller picks, usually the activation dtype). Dequantization is ``w[n, k] = (q[n, k] - z[n, g]) * s[n, g]`` with
  ``g = k // group_size``.
- int8: ``qweight [N, K]`` int8. Symmetric: ``q`` in [-127, 127], ``z = 0`` (``zeros`` is None).
  Asymmetric: ``q`` in [-128, 127] and ``z`` an integer-valued float.
- int4: ``qweight [N, ceil(K / 2)]`` uint8, two columns per byte: column ``k`` is byte ``k // 2``, the low nibble
  when ``k`` is even and the high nibble when odd (a padding nibble is 0 when ``K`` is odd). Nibbles are unsigned
  ``u`` in [0, 15]. Symmetric: ``z = 8`` implicitly (``zeros`` is None, ``u - 8`` in [-8, 7], scale ``absmax / 7``).
  Asymmetric: ``z`` in [0, 15], an integer-valued float. :func:`quantize_weight` rounds int4 scales up to 8
  (symmetric) or 7 (asymmetric) significant bits, so ``(q - z) * s`` is exact in fp16 (the CPU's fbgemm fp16-weight
  GEMM then computes exactly); the format itself takes any scale.
- ``QuantSpec.float_zero`` (asymmetric): the quantizer stores the exact ``z = lo - min / s`` (any float, so
  ``w = min + (q - lo) * s``: the layout of GGUF's Q4_1 / Q8_1, reproduced to rounding) in fp32 ``zeros`` whatever
  the scales' dtype, and keeps scales unrounded.
  The same tensors and dequantization; only the values differ (CPU packs that need integer ``q - z`` are not used).

Everything is row-wise (groups and packing run along ``K``), so concatenating quantized weights along ``N`` (packing
q/k/v into one qkv weight) is a plain ``torch.cat`` of ``qweight``, ``scales`` and ``zeros``, and slicing rows for
column-parallel tensor parallelism slices the three alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QuantSpec", "dequantize_weight", "gptq_codes", "quant_matmul_reference", "quantize_weight"]


@dataclass(frozen=True)
class QuantSpec:
    """How a weight is quantized: ``num_bits`` (8 or 4), ``group_size`` (columns per scale; clamp with
    :meth:`for_features`), ``symmetric`` and, asymmetric only, ``float_zero`` (the quantizer's zero point is the
    exact ``-min / scale`` instead of an integer; the stored format is the same)."""

    num_bits: int
    group_size: int
    symmetric: bool = True
    float_zero: bool = False

    def __post_init__(self) -> None:
        if self.num_bits not in (4, 8):
            raise ValueError(f"quant num_bits must be 8 or 4, got {self.num_bits}")
        if self.group_size < 1:
            raise ValueError(f"quant group_size must be >= 1, got {self.group_size}")
        if self.float_zero and self.symmetric:
            raise ValueError("quant float_zero needs an asymmetric spec (a symmetric grid has no zero point)")

    def for_features(self, in_features: int) -> QuantSpec:
        """The spec with ``group_size`` clamped to the row length ``in_features``."""
        g = min(self.group_size, in_features)
        return self if g == self.group_size else QuantSpec(self.num_bits, g, self.symmetric, self.float_zero)

    def n_groups(self, in_features: int) -> int:
        return -(-in_features // min(self.group_size, in_features))

    def packed_cols(self, in_features: int) -> int:
        """Columns of ``qweight`` for ``in_features`` inputs (int4 packs two per byte)."""
        return in_features if self.num_bits == 8 else -(-in_features // 2)


def _grouped(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """``t [N, K] -> [N, n_groups, group_size]``, the ragged last group padded by repeating the row's last column
    (so padding never changes a group's min/max)."""
    n, k = t.shape
    pad = -k % group_size
    if pad:
        t = torch.cat([t, t[:, -1:].expand(n, pad)], dim=1)
    return t.reshape(n, -1, group_size)


#: int4 scales keep at most this many significant bits (symmetric, asymmetric), so every dequantized weight
#: ``(q - z) * s`` has at most 11 and is exact in fp16: ``|q - 8| <= 8`` needs 3 bits (8 itself 1), ``|q - z| <= 15``
#: needs 4. CPU decoding then runs fbgemm's fp16-weight GEMM with no rounding.
INT4_SCALE_BITS = {True: 8, False: 7}


def _round_up_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` (fp32, > 0) rounded up to ``bits`` significant bits."""
    mant, exp = torch.frexp(x)  # x = mant * 2**exp, mant in [0.5, 1)
    return torch.ldexp(torch.ceil(mant * 2.0**bits), (exp - bits).to(torch.float32))


def _stored_scale(scale: torch.Tensor, dtype: torch.dtype, num_bits: int = 8, symmetric: bool = True) -> torch.Tensor:
    """``scale`` (fp32, > 0) as it will be stored in ``dtype``, back in fp32: rounded *up* to a value of ``dtype`` (so
    the group's range still fits the integer grid) and never 0 (fp16 underflows where fp32 does not). int4 scales are
    then rounded up to :data:`INT4_SCALE_BITS` significant bits where ``dtype`` holds the result (not in its subnormal
    range): steps at most 2^-7 (symmetric) / 2^-6 (asymmetric) coarser, for exact fp16 dequantization."""
    if dtype != torch.float32:
        info = torch.finfo(dtype)
        stored = (scale * (1.0 + info.eps)).to(dtype).float()  # nearest of a value one ulp up: never below ``scale``
        scale = stored.clamp_min(info.tiny * info.eps)  # the smallest subnormal; exactly representable in ``dtype``
    if num_bits != 4:
        return scale
    short = _round_up_bits(scale, INT4_SCALE_BITS[symmetric])
    held = short.to(dtype).float() == short
    if dtype != torch.float16:  # exact in fp16 too, or the fp16 products would round anyway
        held &= short.to(torch.float16).float() == short
    return torch.where(held, short, scale)


def _group_params(
    g: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest ranges of groups ``g [N, G, gs]``: ``(scale [N, G], zero [N, G] or None)`` in fp32, the scale
    already rounded as it will be stored (:func:`_stored_scale`)."""
    tiny = torch.finfo(torch.float32).tiny
    if spec.symmetric:
        qmax = 127.0 if spec.num_bits == 8 else 7.0
        return _stored_scale((g.abs().amax(dim=-1) / qmax).clamp_min(tiny), scale_dtype, spec.num_bits, True), None
    lo, hi = _code_range(spec)
    if spec.float_zero:  # the grid spans exactly [min, max]: w = min + (q - lo) * scale (GGUF Q4_1's layout)
        wmin, wmax = g.amin(dim=-1), g.amax(dim=-1)
        # The step is at least 2^-12 of the group's magnitude, so |z| <= 2^12 + 15: a group of (nearly) one value far
        # from 0 keeps a finite zero point, and fp32 holds z to 2^-11 of a step (zeros are stored in fp32).
        step = torch.maximum((wmax - wmin) / (hi - lo), torch.maximum(wmin.abs(), wmax.abs()) * 2.0**-12)
        # no int4 scale-bit rounding: a fractional zero makes (q - z) * s inexact in fp16 anyway
        scale = _stored_scale(step.clamp_min(tiny), scale_dtype)
        return scale, lo - wmin / scale  # [N, G] each
    wmin = g.amin(dim=-1).clamp(max=0.0)  # include 0 so it stays exactly representable
    wmax = g.amax(dim=-1).clamp(min=0.0)
    scale = _stored_scale(((wmax - wmin) / (hi - lo)).clamp_min(tiny), scale_dtype, spec.num_bits, False)
    zero = (lo - torch.round(wmin / scale)).clamp_(lo, hi)  # [N, G], an integer
    return scale, zero


#: Range shrink factors GPTQ's clipping search tries for each group (1.0, the min/max range, is always a candidate):
#: 0.975 down to 0.4 in steps of 0.025. On SmolLM2-135M (docs/quantization.md, whole evaluation text) the search took
#: GPTQ int4 g128 from +13.6% perplexity over fp32 to +5.8%; stopping the grid at 0.6 gave +7.7%, at 0.75 (steps of
#: 0.05) +9.4%.
CLIP_RATIOS = tuple(round(1.0 - 0.025 * i, 3) for i in range(1, 25))


def _clipped_group_params(
    g: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype, importance: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like :func:`_group_params`, but each group's range is shrunk by the factor of :data:`CLIP_RATIOS` (or 1) that
    minimizes its rounding error weighted by ``importance [N or 1, G, gs]`` (GPTQ: the inputs' energy ``diag(H)`` of
    each column): clipping a few large weights buys a finer step for all the others."""
    scale, zero = _group_params(g, spec, scale_dtype)

    def error(s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:  # [N, G]
        return ((_decoded(_codes(g, s, z, spec), s, z, spec) - g).square_() * importance).sum(-1)

    best = error(scale, zero)
    for ratio in CLIP_RATIOS:
        s, z = _group_params(g * ratio, spec, scale_dtype)
        e = error(s, z)
        better = e < best
        best = torch.where(better, e, best)
        scale = torch.where(better, s, scale)
        if zero is not None:
            zero = torch.where(better, z, zero)
    return scale, zero


def _code_range(spec: QuantSpec) -> tuple[float, float]:
    """The stored codes' range: symmetric int8 [-127, 127], int4 nibbles [0, 15], asymmetric int8 [-128, 127]."""
    if spec.num_bits == 4:
        return 0.0, 15.0
    return (-127.0, 127.0) if spec.symmetric else (-128.0, 127.0)


def _codes(g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """Stored codes of ``g [..., gs]`` against ``scale``/``zero`` ``[...]`` (symmetric int4: the nibble ``q + 8``)."""
    lo, hi = _code_range(spec)
    offset = zero if zero is not None else (8.0 if spec.num_bits == 4 else 0.0)
    if not isinstance(offset, float):
        offset = offset[..., None]
    if spec.float_zero:  # a fractional zero point: round the shifted value (an integer one commutes with rounding)
        return torch.round(g / scale[..., None] + offset).clamp_(lo, hi)
    return (torch.round(g / scale[..., None]) + offset).clamp_(lo, hi)


def _decoded(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """The weights codes ``q [..., gs]`` stand for (the inverse of :func:`_codes`, up to rounding)."""
    offset = zero[..., None] if zero is not None else (8.0 if spec.num_bits == 4 else 0.0)
    return (q - offset) * scale[..., None]


def _pack(q: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Codes ``q [N, K]`` (float) as the stored ``qweight`` (int8, or int4 nibbles two per byte)."""
    if spec.num_bits == 8:
        return q.to(torch.int8).contiguous()
    n, k = q.shape
    u = q.to(torch.uint8)
    if k % 2:
        u = torch.cat([u, torch.zeros(n, 1, dtype=torch.uint8, device=u.device)], dim=1)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()  # [N, ceil(K/2)]


def quantize_weight(
    weight: torch.Tensor,
    spec: QuantSpec,
    scale_dtype: torch.dtype | None = None,
    hessian: torch.Tensor | None = None,
    damp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``weight [N, K]``. Returns ``(qweight, scales, zeros)`` in the module's format; ``scales``/``zeros``
    in ``scale_dtype`` (default: the weight's dtype). Computed in fp32.

    Without ``hessian``: round to nearest, each group's range its min/max. With ``hessian [K, K]`` (``X^T X / n`` of
    the layer's inputs on calibration data): GPTQ (Frantar et al. 2022), see :func:`gptq_codes`; ``damp`` is its
    dampening, a fraction of the mean diagonal.
    """
    if weight.ndim != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_weight takes a 2-d floating weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    spec = spec.for_features(k)
    scale_dtype = scale_dtype or weight.dtype
    if hessian is not None:
        q, scale, zero = gptq_codes(weight.detach().float(), hessian, spec, scale_dtype, damp)
    else:
        g = _grouped(weight.detach().float(), spec.group_size)  # [N, G, gs]
        scale, zero = _group_params(g, spec, scale_dtype)  # [N, G]
        q = _codes(g, scale, zero, spec).reshape(n, -1)[:, :k]  # [N, K]
    # q was computed against the stored scale (see _stored_scale), so dequantization uses exactly what is stored.
    zero_dtype = torch.float32 if spec.float_zero else scale_dtype  # fractional zero points need fp32's precision
    zeros = None if zero is None else zero.to(zero_dtype).contiguous()
    return _pack(q, spec), scale.to(scale_dtype).contiguous(), zeros


@torch.no_grad()
def gptq_codes(
    weight: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype, damp: float = 0.01
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ (Frantar et al. 2022): quantize ``weight [N, K]`` (fp32) column by column, each column's rounding error
    spread over the columns not yet quantized so that the layer's output on the calibration inputs
    (``hessian [K, K] = X^T X / n``) changes least.

    Columns go in order of decreasing ``hessian`` diagonal (the inputs with the most energy first, "act order"), and
    each group's scale and zero are fixed up front ("static groups"), so the result stays in the plain grouped format
    (no column permutation is stored). On SmolLM2-135M this pair beat GPTQ in column order with ranges taken from the
    corrected weights (docs/quantization.md). Each group's range is its min/max shrunk by the factor that minimizes
    the rounding error weighted by the ``hessian`` diagonal (:func:`_clipped_group_params`).

    Returns ``(codes [N, K], scale [N, G], zero [N, G] or None)`` (fp32). Rows are independent given ``hessian``, so
    slicing rows (column-parallel TP) quantizes the same as the whole.
    """
    n, k = weight.shape
    h = hessian.to(torch.float32, copy=True)
    if h.shape != (k, k):
        raise ValueError(f"the GPTQ hessian must be [{k}, {k}] for a weight [{n}, {k}], got {tuple(h.shape)}")
    w = weight.clone()
    dead = torch.diagonal(h) == 0  # inputs that were 0 on every calibration token: keep their weights' rounding
    h[dead, dead] = 1.0
    energy = torch.diagonal(h).clone()  # [K]; the ragged last group's padding columns weigh nothing
    importance = torch.cat([energy, energy.new_zeros(-k % spec.group_size)]).reshape(1, -1, spec.group_size)
    scale, zero = _clipped_group_params(_grouped(w, spec.group_size), spec, scale_dtype, importance)  # fixed up front
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)  # [K]
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype, device=h.device)
    # upper Cholesky factor of H^-1: row j says how column j's error moves the columns after it
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # [K, K]
    group_of = (order // spec.group_size).tolist()
    codes = torch.empty_like(w)
    block_cols = 128  # columns corrected together before the rest of the matrix is updated (one GEMM per block)
    for b0 in range(0, k, block_cols):
        b1 = min(b0 + block_cols, k)
        block = w[:, b0:b1]  # [N, B] view, corrected in place
        err = torch.empty_like(block)
        ub = u[b0:b1, b0:b1]
        for j in range(b1 - b0):
            gi = group_of[b0 + j]
            s1, z1 = scale[:, gi], None if zero is None else zero[:, gi]  # [N]
            col = block[:, j : j + 1]  # [N, 1]
            q = _codes(col, s1, z1, spec)  # [N, 1]
            codes[:, b0 + j : b0 + j + 1] = q
            e = (col - _decoded(q, s1, z1, spec)) / ub[j, j]  # [N, 1]
            block[:, j:] -= e * ub[j, j:][None, :]
            err[:, j : j + 1] = e
        w[:, b1:] -= err @ u[b0:b1, b1:]  # the block's errors, spread over the columns after it
    return codes[:, torch.argsort(order)], scale, zero


def unpack_int4(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """``qweight [N, ceil(K/2)]`` uint8 -> ``[N, K]`` uint8 nibbles in [0, 15]."""
    lo, hi = qweight & 0xF, qweight >> 4
    return torch.stack([lo, hi], dim=-1).reshape(qweight.shape[0], -1)[:, :in_features]


def dequantize_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    spec: QuantSpec,
    in_features: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The float weight ``[N, K]`` (in ``dtype``, default the scales' dtype) that ``qweight``/``scales``/``zeros``
    stand for; the reference every quantized path is compared with."""
    spec = spec.for_features(in_features)
    q = (unpack_int4(qweight, in_features) if spec.num_bits == 4 else qweight).float()  # [N, K]
    col_group = torch.arange(in_features, device=q.device) // spec.group_size  # [K]
    s = scales.float()[:, col_group]  # [N, K]
    if zeros is not None:
        z = zeros.float()[:, col_group]
    else:
        z = 8.0 if spec.num_bits == 4 else 0.0
    return ((q - z) * s).to(dtype or scales.dtype)


def quant_matmul_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    spec: QuantSpec,
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] @ dequant(w).T (+ bias) -> [..., N]`` in ``x.dtype``, accumulated in fp32."""
    w = dequantize_weight(qweight, scales, zeros, spec, in_features, dtype=torch.float32)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
