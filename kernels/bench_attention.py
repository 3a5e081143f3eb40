"""Attention rows for ``kernels/bench.py``: store_kv, decode and prefill attention at Llama-3-8B shapes.

Decode is bandwidth bound: its rows report GB/s of the K/V cache read (valid lengths only) plus q/out, against the
torch reference and torch SDPA on the same cache. Prefill is compute bound: its rows report TFLOP/s (causal,
counting only the unmasked half) in the shape column, and the time of SDPA (flash) on the same problem.
Needs CUDA; callers check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .decode_attention import decode_attention_torch, decode_attention_triton
from .kv_cache import store_kv_torch, store_kv_triton
from .prefill_attention import prefill_attention_torch, prefill_attention_triton

N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
DECODE_BATCHES = (1, 8, 32)
DECODE_LENS = (512, 2048, 4096, 8192)
PREFILL_BATCHES = (1, 8)
PREFILL_LENS = (512, 2048)
STORE_SHAPES = ((32, 1, 4096), (8, 2048, 4096))  # (B, T new tokens, S cache slots): a decode and a prefill step
DEVICE = "cuda"  # a module constant so a CPU smoke test can shrink and redirect the whole run


def _bench_ms(fn: Callable[[], object]) -> float:
    """Mean milliseconds per call (triton.testing.do_bench flushes L2 between calls)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100))


def _sdpa_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> Callable[[], object]:
    """SDPA on ``[B, H, T, D]`` inputs with GQA: native ``enable_gqa`` when this torch supports it, else KV repeated
    once up front (outside the timing, so SDPA is not charged for the copy)."""
    try:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        return functools.partial(
            F.scaled_dot_product_attention, q, k, v, is_causal=causal, scale=scale, enable_gqa=True
        )
    except (TypeError, RuntimeError):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal, scale=scale)


def bench_row(kernel: str, shape: str, dtype: torch.dtype, nbytes: int | None, t_ms: float, r_ms: float,
              copy_gbs: float, sdpa_ms: float | None = None) -> dict:  # fmt: skip
    """One table row: times in ms, GB/s from ``nbytes`` moved (None: compute-bound, no GB/s), share of copy BW."""
    t_gbs = nbytes / t_ms / 1e6 if nbytes else None
    return {
        "kernel": kernel,
        "shape": shape,
        "dtype": str(dtype).replace("torch.", ""),
        "triton_ms": t_ms,
        "ref_ms": r_ms,
        "triton_gbs": t_gbs,
        "ref_gbs": nbytes / r_ms / 1e6 if nbytes else None,
        "pct_copy_bw": 100.0 * t_gbs / copy_gbs if t_gbs else None,
        "sdpa_ms": sdpa_ms,
    }


def _store_rows(dtype: torch.dtype, copy_gbs: float) -> list[dict]:
    dev = torch.device(DEVICE)
    es = torch.empty((), dtype=dtype).element_size()
    rows = []
    for B, T, S in STORE_SHAPES:
        k = torch.randn(B, T, N_KV_HEADS, HEAD_DIM, dtype=dtype, device=dev)
        v = torch.randn_like(k)
        kc = torch.zeros(B, N_KV_HEADS, S, HEAD_DIM, dtype=dtype, device=dev)
        vc = torch.zeros_like(kc)
        lens = torch.full((B,), S - T, dtype=torch.int32, device=dev)
        start = torch.zeros(B, dtype=torch.int32, device=dev)
        nbytes = 4 * k.numel() * es  # read k, v; write both into the cache
        rows.append(bench_row("store_kv", f"[{B}, {T}, {N_KV_HEADS}, {HEAD_DIM}] -> S={S}", dtype, nbytes,
                         _bench_ms(functools.partial(store_kv_triton, k, v, kc, vc, lens, start)),
                         _bench_ms(functools.partial(store_kv_torch, k, v, kc, vc, lens, start)),
                         copy_gbs))  # fmt: skip
    return rows


def _decode_rows(dtype: torch.dtype, copy_gbs: float) -> list[dict]:
    dev = torch.device(DEVICE)
    es = torch.empty((), dtype=dtype).element_size()
    scale = HEAD_DIM**-0.5
    rows = []
    for B in DECODE_BATCHES:
        for L in DECODE_LENS:
            kc = torch.randn(B, N_KV_HEADS, L, HEAD_DIM, dtype=dtype, device=dev)
            vc = torch.randn_like(kc)
            q = torch.randn(B, N_HEADS, HEAD_DIM, dtype=dtype, device=dev)
            lens = torch.full((B,), L, dtype=torch.int32, device=dev)
            nbytes = (2 * kc.numel() + 2 * q.numel()) * es
            t_ms = _bench_ms(functools.partial(decode_attention_triton, q, kc, vc, lens, scale))
            r_ms = _bench_ms(functools.partial(decode_attention_torch, q, kc, vc, lens, scale))
            # Every row has the full length here, so SDPA needs no mask (one query sees all keys).
            s_ms = _bench_ms(_sdpa_fn(q[:, :, None], kc, vc, scale, causal=False))
            rows.append(bench_row("decode_attention", f"B={B} L={L} Hq={N_HEADS} Hk={N_KV_HEADS} D={HEAD_DIM}", dtype,
                             nbytes, t_ms, r_ms, copy_gbs, s_ms))  # fmt: skip
            del kc, vc
    return rows


def _prefill_rows(dtype: torch.dtype, copy_gbs: float) -> list[dict]:
    dev = torch.device(DEVICE)
    scale = HEAD_DIM**-0.5
    rows = []
    for B in PREFILL_BATCHES:
        for T in PREFILL_LENS:
            q = torch.randn(B, T, N_HEADS, HEAD_DIM, dtype=dtype, device=dev)
            kc = torch.randn(B, N_KV_HEADS, T, HEAD_DIM, dtype=dtype, device=dev)
            vc = torch.randn_like(kc)
            zeros = torch.zeros(B, dtype=torch.int32, device=dev)
            flops = 4.0 * B * N_HEADS * HEAD_DIM * T * (T + 1) / 2  # QK^T and PV over the causal half
            t_ms = _bench_ms(functools.partial(prefill_attention_triton, q, kc, vc, zeros, zeros, scale))
            # The fp32 reference materializes [B, H, T, T] scores: skip it where that would not fit comfortably.
            big = B * N_HEADS * T * T * 4 > 8 << 30
            r_ms = (
                float("nan")
                if big
                else _bench_ms(functools.partial(prefill_attention_torch, q, kc, vc, zeros, zeros, scale))
            )
            s_ms = _bench_ms(_sdpa_fn(q.transpose(1, 2), kc, vc, scale, causal=True))
            tflops = f"{flops / t_ms / 1e9:.0f} vs sdpa {flops / s_ms / 1e9:.0f} TFLOP/s"
            shape = f"B={B} T={T} Hq={N_HEADS} Hk={N_KV_HEADS} D={HEAD_DIM}: {tflops}"
            rows.append(bench_row("prefill_attention", shape, dtype, None, t_ms, r_ms, copy_gbs, s_ms))
            rows[-1]["triton_tflops"] = flops / t_ms / 1e9
            rows[-1]["sdpa_tflops"] = flops / s_ms / 1e9
            del q, kc, vc
    return rows


def run_attention_benchmarks(copy_gbs: float, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """All attention rows (store_kv, decode, prefill) at Llama-3-8B shapes; one dict per row, as ``bench.py`` prints.

    ``copy_gbs`` is the device copy bandwidth measured by the caller; ``pct_copy_bw`` is relative to it.
    """
    rows = _store_rows(dtype, copy_gbs)
    rows += _decode_rows(dtype, copy_gbs)
    rows += _prefill_rows(dtype, copy_gbs)
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.empty_cache()
    return rows
