"""The fused dequantize-and-reduce decode matmuls of :mod:`.quant_cpu` (compiled CPU decode step, a few rows).

Inside ``torch.compile`` a matmul of up to ``FUSED_DEQUANT_MAX_ROWS`` rows is written as one reduction over the
stored integers, which inductor turns into a single C++ loop that reads each weight byte once and writes no fp32
weight. Two storages:

* one byte per code (int8, and int4 of an odd group size): :func:`fused_matmul`;
* int4 as nibbles, two codes per byte (:func:`pack_nibbles`): in each group of ``gs`` codes, byte ``j`` holds code
  ``j`` in its low nibble and code ``j + gs / 2`` in its high nibble, so the unpack is ``b & 15`` / ``b >> 4`` of the
  same byte and the two halves meet the two contiguous halves of the group's activations (:func:`fused_nibble_matmul`,
  half the bytes of the one-byte storage). llama.cpp's Q4_0 / Q4_1 blocks use the same split.

Eagerly these expressions would materialize ``[M, N, K]`` temporaries: they are for compiled graphs only (eager calls
unpack with :func:`unpack_nibbles` and run one ``F.linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fused_matmul", "fused_nibble_matmul", "pack_nibbles", "unpack_nibbles"]


def _materialize(x: torch.Tensor) -> torch.Tensor:
    # A barrier (``hf_dsinfer::materialize``, defined in quant_cpu): without it inductor inlines the producer of x (the
    # RMSNorm, even the embedding gather) into the reduction and recomputes it for every output row: 2x slower steps
    # on SmolLM2 (docs/performance.md).
    return torch.ops.hf_dsinfer.materialize(x)


def fused_matmul(
    x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, gs: int, k_pad: int
) -> torch.Tensor:
    """``x [M, K] @ ((q - z) * s).T -> [M, N]`` fp32 as one reduction per output that dequantizes as it reads
    (``q [N, K_pad]`` int8, ``s`` / ``z [N, G, 1]`` fp32), for decoding under torch.compile only.

    With groups each product is ``x`` times the reference's own weight value (``(q - z) * s`` in fp32); per channel
    the sum of ``x * (q - z)`` is scaled once (as the fbgemm path does): the reference up to fp32 rounding order.
    """
    n, groups = q.shape[0], s.shape[1]
    w = q.view(1, n, groups, gs).to(torch.float32)  # [1, N, G, gs]
    if z is not None:
        w = w - z
    # Per channel the row's scale multiplies the sum, as the fbgemm path does: one multiply fewer per weight (the 120
    # matmuls of a SmolLM2 step, 1 thread, load 2.7-2.8: 8.9-9.1 ms against 9.2-9.6, six alternating rounds).
    row_scale = groups == 1
    if not row_scale:
        w = w * s  # [1, N, G, gs] (never materialized: fused into the reduction)
    xc = x.to(torch.float32)
    if k_pad != x.shape[1]:
        xc = F.pad(xc, (0, k_pad - x.shape[1]))
    xc = _materialize(xc)
    y = (w * xc.view(-1, 1, groups, gs)).sum(dim=(-2, -1))  # [M, N]
    return y * s.view(1, n) if row_scale else y


def pack_nibbles(u: torch.Tensor, gs: int) -> torch.Tensor:
    """int4 codes ``u [N, K_pad]`` (values in [0, 15], ``K_pad`` whole groups of an even ``gs``) ->
    ``[N, K_pad / 2]`` uint8: per group, byte ``j`` = code ``j`` | code ``j + gs / 2`` << 4."""
    n, k_pad = u.shape
    if gs % 2 or k_pad % gs:
        raise ValueError(f"pack_nibbles needs whole groups of an even size, got K_pad={k_pad}, group_size={gs}")
    halves = u.to(torch.uint8).view(n, k_pad // gs, 2, gs // 2)  # [N, G, 2, gs / 2]
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k_pad // 2).contiguous()


def unpack_nibbles(b: torch.Tensor, gs: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: ``[N, K_pad / 2]`` uint8 -> ``[N, K_pad]`` codes in [0, 15] as ``dtype``.

    Each half is written straight into the output (a ``torch.cat`` of uint8 halves, then a cast, was 9x slower for an
    fp32 weight: SmolLM2's MLP shape, 1 thread, 4.2-4.7 ms against 0.43-0.52)."""
    n = b.shape[0]
    halves = b.view(n, -1, gs // 2)  # [N, G, gs / 2]
    out = torch.empty(n, halves.shape[1], 2, gs // 2, dtype=dtype, device=b.device)  # [N, G, 2, gs / 2]
    out[:, :, 0] = halves & 15
    out[:, :, 1] = halves >> 4
    return out.view(n, -1)


def fused_nibble_matmul(
    x: torch.Tensor, b: torch.Tensor, s: torch.Tensor, zs: torch.Tensor, gs: int, k_pad: int
) -> torch.Tensor:
    """``x [M, K] @ ((u - z) * s).T -> [M, N]`` fp32 over :func:`pack_nibbles` codes ``b [N, K_pad / 2]`` uint8, for
    decoding under torch.compile only. ``s [N, G, 1]`` fp32 scales, ``zs [N, G]`` fp32 the products ``z * s`` (8 * s
    when symmetric).

    Written as Q4_1's dot product: ``sum_g s_g * sum_j u_j x_j - sum_g zs_g * sum_j x_j``. The first term is one
    reduction over the bytes (two codes each, one multiply by ``s`` per pair); the second a small ``[M, G] x [N, G]``
    reduction over group sums of ``x`` computed once per call. Equal to the reference up to fp32 rounding order
    (``u * s * x`` and ``z * s * x`` are summed apart instead of ``(u - z) * s * x``: relative differences ~1e-6).
    """
    n, groups = b.shape[0], s.shape[1]
    half = gs // 2
    xc = x.to(torch.float32)
    if k_pad != x.shape[1]:
        xc = F.pad(xc, (0, k_pad - x.shape[1]))  # [M, K_pad]; padding columns hold code 0 and meet zeros
    m = xc.shape[0]
    xg = xc.view(m, groups, 2, half)  # [M, G, 2, gs / 2]
    # The low and high halves of every group, each contiguous in the byte order (one materialized [2, M, K_pad / 2]):
    # the reduction then reads x_lo, x_hi and the bytes with the same flat index.
    xs = _materialize(xg.permute(2, 0, 1, 3).reshape(2, m, 1, groups, half))  # [2, M, 1, G, gs / 2]
    xsum = xc.view(m, groups, gs).sum(-1)  # [M, G]
    # Widened to int32 before the unpack: inductor's vector code has no 8-bit shift (at::vec emulates ``>>`` on uint8
    # lanes with shuffles and blends), while an int32 lane shifts in one instruction and converts to fp32 in one more.
    # Same values; 30 layers of SmolLM2's matmuls, 1 thread: 9.6-9.7 ms against 13.2-13.4 on uint8 (perf_h2_41).
    w = b.view(1, n, groups, half).to(torch.int32)  # [1, N, G, gs / 2]
    lo = (w & 15).to(torch.float32)
    hi = (w >> 4).to(torch.float32)
    pair = lo * xs[0] + hi * xs[1]  # [M, N, G, gs / 2], never materialized: fused into the reduction
    if groups == 1:  # per channel: the row's scale multiplies the sum once
        y = pair.sum(dim=(-2, -1)) * s.view(1, n)
    else:
        y = (pair * s).sum(dim=(-2, -1))  # [M, N]
    return y - (xsum.view(m, 1, groups) * zs.view(1, n, groups)).sum(-1)  # [M, N]
