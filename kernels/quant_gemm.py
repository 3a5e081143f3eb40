"""Weight-only int8 / int4 GEMMs (w8a16, w4a16): ``y = x @ dequant(qweight).T (+ bias)`` with the weights
dequantized in registers and fp32 accumulation.

The storage format is :mod:`.quant_format`'s (row-wise groups along ``K``; int4 two columns per byte, low nibble
first). One Triton kernel serves both launch shapes:

* decode (``M <= 16`` rows): a GEMV-like launch over output-feature tiles whose ``K`` range is split over programs
  when the tiles alone would leave SMs idle. Each split writes fp32 partial sums to a workspace and a second small
  kernel adds them in a fixed order (atomic-free, so results are deterministic), adds the bias and casts;
* prefill: ``BLOCK_M x BLOCK_N`` output tiles, ``tl.dot`` on the dequantized weight tile.

Groups: when a ``K`` tile never straddles two groups (``BLOCK_K`` divides ``group_size``, or one group per row), the
kernel multiplies ``x`` by the integer weights ``q - z`` (exact in fp16/bf16: at most 255 in magnitude) and applies
the group scale to the fp32 partial product, so no weight is rounded to the activation dtype. Other group sizes
dequantize per element in fp32 and round the weight to the activation dtype for the dot.

Nothing reads a device value on the host, so a launch can be captured in a CUDA graph.
:func:`quant_matmul` dispatches: Triton on CUDA (or under the interpreter), else the packed CPU path of
:mod:`.quant_cpu` when the caller packed the weight for it, else :func:`.quant_format.quant_matmul_reference`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._arch import Target, target_of
from ._checks import FLOAT_DTYPES, check_tensor
from ._triton import tl, triton
from .backend import interpreter_enabled, use_triton
from .norms import cast_rne, needs_bf16_fix
from .prefill_attention import _dot
from .quant_format import QuantSpec, quant_matmul_reference

if TYPE_CHECKING:
    from .quant_cpu import CpuPackedWeight

__all__ = ["DECODE_MAX_ROWS", "check_quant_args", "quant_matmul", "quant_matmul_triton", "quant_tiles"]

DECODE_MAX_ROWS = 16  # up to this many rows take the decode (split-K) launch


@triton.jit
def _quant_gemm_kernel(
    x_ptr,  # [M, K] activations (row stride stride_xm, unit column stride)
    qw_ptr,  # int8 [N, K] or uint8 [N, ceil(K / 2)] (int4, low nibble = even column); unit column stride
    s_ptr,  # [N, G] scales, unit column stride
    z_ptr,  # [N, G] zeros (read when ASYM), unit column stride
    bias_ptr,  # [N] (read when HAS_BIAS and not SPLIT)
    out_ptr,  # SPLIT: [splits, M, N] fp32 partial sums; else [M, N] in the activation dtype
    M,
    N,
    K,
    k_per_split,  # columns of K per program along grid axis 2 (a multiple of BLOCK_K)
    group_size,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    INT4: tl.constexpr,
    ASYM: tl.constexpr,
    ALIGNED: tl.constexpr,  # no K tile straddles two groups: one scale per (row, tile)
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    FP32: tl.constexpr,
    UPCAST: tl.constexpr,
    FIX_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    row_mask = rows < M
    col_mask = cols < N
    # int64 row offsets: N * K (a large vocabulary head) and M * K (long prefills) can pass 2^31 elements.
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    x_rows = x_ptr + rows64[:, None] * stride_xm  # [BLOCK_M, 1]
    q_rows = qw_ptr + cols64[:, None] * stride_qn  # [BLOCK_N, 1]
    s_rows = s_ptr + cols64 * stride_sn  # [BLOCK_N]
    z_rows = z_ptr + cols64 * stride_zn  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = ks < k_end
        a = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if INT4:
            # k0 is even (a multiple of BLOCK_K): bytes k0/2 .. k0/2 + BLOCK_K/2 hold columns k0 .. k0 + BLOCK_K.
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BLOCK_K // 2]
            byte = tl.load(
                q_rows + kb[None, :], mask=col_mask[:, None] & (kb[None, :] < (k_end + 1) // 2), other=0
            )  # [BLOCK_N, BLOCK_K // 2] uint8
            # join puts (low, high) side by side; the reshape interleaves them: column 2j low, 2j + 1 high.
            q = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_N, BLOCK_K))  # [BLOCK_N, BLOCK_K] in [0, 15]
        else:
            q = tl.load(q_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0)  # [BLOCK_N, BLOCK_K]
        if ALIGNED:
            g = k0 // group_size
            s = tl.load(s_rows + g, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
            if ASYM:
                z = tl.load(z_rows + g, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
                # integers in [-255, 255]: exact in every activation dtype (a float zero point's fractions are
                # rounded to it, as every weight is on the unaligned path below)
                qz = q.to(tl.float32) - z[:, None]
            elif INT4:
                qz = q.to(tl.float32) - 8.0  # [-8, 7]
            else:
                qz = q.to(tl.float32)  # (int8 -> bf16 directly is wrong under the interpreter; via fp32 is exact)
            # Masked columns hold q - z finite and x = 0, so they add nothing.
            part = _dot(a, tl.trans(qz.to(a.dtype)), FP32, UPCAST)  # [BLOCK_M, BLOCK_N] fp32
            acc += part * s[None, :]
        else:
            g2 = (ks // group_size)[None, :]  # [1, BLOCK_K]
            gmask = col_mask[:, None] & k_mask[None, :]
            s2 = tl.load(s_rows[:, None] + g2, mask=gmask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
            if ASYM:
                z2 = tl.load(z_rows[:, None] + g2, mask=gmask, other=0.0).to(tl.float32)
            elif INT4:
                z2 = 8.0
            else:
                z2 = 0.0
            w = (q.to(tl.float32) - z2) * s2  # [BLOCK_N, BLOCK_K] dequantized in fp32
            acc += _dot(a, tl.trans(w.to(a.dtype)), FP32, UPCAST)
    out_mask = row_mask[:, None] & col_mask[None, :]
    offs = rows64[:, None] * N + cols64[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k.to(tl.int64) * M * N + offs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, cast_rne(acc, out_ptr.dtype.element_ty, FIX_BF16), mask=out_mask)


@triton.jit
def _splitk_reduce_kernel(
    part_ptr,  # [splits, M, N] fp32 partial sums (contiguous)
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] in the activation dtype (contiguous)
    N,
    splits,
    stride_split,  # M * N
    HAS_BIAS: tl.constexpr,
    FIX_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    p = part_ptr + row * N + cols
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for _ in range(0, splits):  # a fixed order: the sum is the same on every run
        acc += tl.load(p, mask=mask, other=0.0)
        p += stride_split
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, cast_rne(acc, out_ptr.dtype.element_ty, FIX_BF16), mask=mask)


def _pow2_divisor(n: int) -> int:
    return n & -n


def quant_tiles(
    m: int, n: int, k: int, dtype: torch.dtype, spec: QuantSpec, target: Target | None
) -> tuple[int, int, int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, aligned)`` for an ``[m, k] @ [k, n]`` launch.

    ``aligned``: every ``K`` tile lies inside one group (the scale is applied per tile). ``BLOCK_K`` is shrunk to the
    largest power of two dividing ``group_size`` (when >= 16) to get there; the per-element path covers the rest.
    """
    gs = spec.for_features(k).group_size
    if interpreter_enabled():
        bm, bn, bk, warps, stages = 16, 32, 32, 1, 1  # the interpreter's cost grows with the tile, not the grid
    elif m <= DECODE_MAX_ROWS:
        # Decode streams the weight once: wide K tiles (64 or 128 bytes of int8 / int4 per row) and a 16-row M tile,
        # the smallest tl.dot takes. fp32 dots run on FMA units with both operands in registers: narrower tiles.
        bm, bn, bk, warps, stages = (16, 32, 64, 4, 3) if dtype == torch.float32 else (16, 64, 128, 4, 3)
    elif dtype == torch.float32:
        bm, bn, bk, warps, stages = 32, 64, 32, 4, 2
    elif m <= 64:
        bm, bn, bk, warps, stages = 64, 64, 64, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 64, 64, 8, 3
    aligned = gs >= k  # one group per row
    if not aligned:
        p2 = _pow2_divisor(gs)
        if p2 >= 16:
            bk = min(bk, p2)
            aligned = True
    return bm, bn, bk, warps, stages, aligned


def _num_splits(m_tiles: int, n_tiles: int, k: int, block_k: int, target: Target | None) -> int:
    """Split ``K`` over programs until the grid covers the GPU about twice, keeping >= 2 K tiles per split."""
    if target is None:
        return 1
    k_tiles = triton.cdiv(k, block_k)
    splits = 1
    while m_tiles * n_tiles * splits < 2 * target.sm_count and splits * 2 * 2 <= k_tiles:
        splits *= 2
    return splits


def check_quant_args(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    spec: QuantSpec,
    in_features: int,
    bias: torch.Tensor | None,
) -> QuantSpec:
    """Validate a quantized matmul's arguments (shapes, dtypes, devices); returns ``spec`` clamped to the row."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a QuantSpec, got {type(spec).__name__}")
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"x must be [..., in_features={in_features}], got {tuple(x.shape)}")
    spec = spec.for_features(in_features)
    wdt = torch.int8 if spec.num_bits == 8 else torch.uint8
    check_tensor("qweight", qweight, ndim=2, dtypes=(wdt,), device=x.device, last_dim_contiguous=True)
    n = qweight.shape[0]
    if qweight.shape[1] != spec.packed_cols(in_features):
        raise ValueError(
            f"qweight must be [N, {spec.packed_cols(in_features)}] for {spec.num_bits}-bit weights with "
            f"in_features={in_features}, got {tuple(qweight.shape)}"
        )
    groups = spec.n_groups(in_features)
    check_tensor("scales", scales, ndim=2, dtypes=FLOAT_DTYPES, device=x.device, last_dim_contiguous=True)
    if tuple(scales.shape) != (n, groups):
        raise ValueError(f"scales must be [N={n}, n_groups={groups}] (group_size {spec.group_size}), got "
                         f"{tuple(scales.shape)}")  # fmt: skip
    if spec.symmetric != (zeros is None):
        raise ValueError("zeros must be None for symmetric quantization and a tensor for asymmetric "
                         f"(spec.symmetric={spec.symmetric})")  # fmt: skip
    if zeros is not None:
        check_tensor("zeros", zeros, ndim=2, dtypes=FLOAT_DTYPES, device=x.device, last_dim_contiguous=True)
        if zeros.shape != scales.shape:
            raise ValueError(f"zeros must have the scales' shape {tuple(scales.shape)}, got {tuple(zeros.shape)}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
        if bias.shape[0] != n:
            raise ValueError(f"bias must be [N={n}], got {tuple(bias.shape)}")
    return spec


def quant_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    spec: QuantSpec,
    in_features: int,
    bias: torch.Tensor | None = None,
    *,
    splits: int | None = None,
) -> torch.Tensor:
    """Triton launcher for :func:`quant_matmul`. ``splits`` forces the split-K count of a decode launch (tests);
    by default it follows the GPU's SM count (1 off CUDA). Never reads device values on the host."""
    spec = check_quant_args(x, qweight, scales, zeros, spec, in_features, bias)
    n, k = qweight.shape[0], in_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.numel() and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    target = target_of(x)
    bm, bn, bk, warps, stages, aligned = quant_tiles(m, n, k, x.dtype, spec, target)
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    if splits is None:
        splits = _num_splits(m_tiles, n_tiles, k, bk, target) if m <= DECODE_MAX_ROWS else 1
    k_tiles = triton.cdiv(k, bk)
    k_per_split = triton.cdiv(k_tiles, max(1, min(int(splits), k_tiles))) * bk
    splits = triton.cdiv(k, k_per_split)  # no empty split
    split = splits > 1
    dest = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if split else out
    fix = needs_bf16_fix(x.dtype)
    _quant_gemm_kernel[(m_tiles, n_tiles, splits)](
        x2, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, dest,
        m, n, k, k_per_split, spec.group_size, x2.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        INT4=spec.num_bits == 4, ASYM=zeros is not None, ALIGNED=aligned, HAS_BIAS=bias is not None, SPLIT=split,
        FP32=x.dtype == torch.float32, UPCAST=interpreter_enabled() and x.dtype != torch.float32, FIX_BF16=fix,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split:
        block = min(1024, triton.next_power_of_2(n)) if not interpreter_enabled() else 32
        _splitk_reduce_kernel[(m, triton.cdiv(n, block))](
            dest, bias if bias is not None else dest, out, n, splits, m * n,
            HAS_BIAS=bias is not None, FIX_BF16=fix, BLOCK_N=block, num_warps=4,
        )  # fmt: skip
    return out.reshape(*lead, n)


def quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    spec: QuantSpec,
    in_features: int,
    bias: torch.Tensor | None = None,
    cpu_packed: CpuPackedWeight | None = None,
) -> torch.Tensor:
    """``x [..., K] @ dequant(qweight).T (+ bias) -> [..., N]`` in ``x.dtype``, accumulated in fp32.

    ``qweight``/``scales``/``zeros`` in :mod:`.quant_format`'s layout, ``K = in_features``. Dispatches on
    ``HF_DSINFER_BACKEND``: the Triton kernel on CUDA (or under ``TRITON_INTERPRET=1``); on CPU,
    :func:`.quant_cpu.cpu_quant_matmul` when ``cpu_packed`` (from :func:`.quant_cpu.pack_for_cpu`, built once at
    load) is given, else :func:`.quant_format.quant_matmul_reference`.
    """
    if use_triton(x):
        return quant_matmul_triton(x, qweight, scales, zeros, spec, in_features, bias)
    if cpu_packed is not None and x.device.type == "cpu":
        from .quant_cpu import cpu_quant_matmul

        return cpu_quant_matmul(x, cpu_packed, bias)
    check_quant_args(x, qweight, scales, zeros, spec, in_features, bias)
    return quant_matmul_reference(x, qweight, scales, zeros, spec, in_features, bias)
