"""Memory-bandwidth benchmark of the Triton kernels against their torch references.

Run as ``python -m hf_dsinfer.kernels.bench [--dtype bf16] [--json PATH]`` on a CUDA machine. All these kernels
are bandwidth bound, so each row reports achieved GB/s and its share of the device's copy bandwidth, measured in the
same run (a large device-to-device tensor copy) so the ceiling and the kernels see the same clocks. Shapes are
Llama-3-8B's (hidden 4096, 32 query heads, 8 KV heads, head dim 128, intermediate 14336) at decode and prefill token
counts. When ``kernels/bench_attention.py`` exists its ``run_attention_benchmarks(copy_gbs)`` rows are merged in, and
the weight-only int8/int4 GEMMs (``run_quant_benchmarks``) are measured against the dense ``F.linear``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable

import torch

from .bench_attention import bench_row, run_attention_benchmarks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOKENS = (1, 8, 32, 4096)
HIDDEN, N_HEADS, N_KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336
COLUMNS = ("kernel", "shape", "dtype", "triton_ms", "ref_ms", "triton_gbs", "ref_gbs", "pct_copy_bw", "sdpa_ms")


def _bench_ms(fn: Callable[[], object]) -> float:
    """Mean milliseconds per call via triton.testing.do_bench (which flushes L2 between calls)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100))


def measure_copy_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in GB/s (bytes read + bytes written), from a ``nbytes`` tensor copy."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def _row(kernel: str, shape: str, dtype: torch.dtype, nbytes: int, triton_fn, ref_fn, copy_gbs: float) -> dict:
    return bench_row(kernel, shape, dtype, nbytes, _bench_ms(triton_fn), _bench_ms(ref_fn), copy_gbs)


def run_benchmarks(
    dtype: torch.dtype, copy_gbs: float, tokens: tuple[int, ...] = TOKENS, device: str | torch.device = "cuda"
) -> list[dict]:
    """Benchmark rms_norm (with residual), rotary and act_and_mul at each token count; one dict per row."""
    from .activations import act_and_mul_torch, act_and_mul_triton
    from .norms import rms_norm_torch, rms_norm_triton
    from .rotary import apply_rotary_torch, apply_rotary_triton

    dev = torch.device(device)
    es = torch.empty((), dtype=dtype).element_size()
    rows = []
    for n in tokens:
        # RMSNorm fused with the residual add: reads x, residual, weight; writes out and the new residual.
        x = torch.randn(n, HIDDEN, dtype=dtype, device=dev)
        res = torch.randn_like(x)
        w = torch.randn(HIDDEN, dtype=dtype, device=dev)
        nbytes = (4 * n * HIDDEN + HIDDEN) * es
        rows.append(_row("rms_norm+residual", f"[{n}, {HIDDEN}]", dtype, nbytes,
                         functools.partial(rms_norm_triton, x, w, 1e-5, res),
                         functools.partial(rms_norm_torch, x, w, 1e-5, res),
                         copy_gbs))  # fmt: skip

        # Rotary in place on q/k viewed out of a fused QKV projection output (strided, like the real model).
        qkv = torch.randn(n, (N_HEADS + 2 * N_KV_HEADS) * HEAD_DIM, dtype=dtype, device=dev)
        q = qkv[:, : N_HEADS * HEAD_DIM].view(n, N_HEADS, HEAD_DIM)
        k = qkv[:, N_HEADS * HEAD_DIM : (N_HEADS + N_KV_HEADS) * HEAD_DIM].view(n, N_KV_HEADS, HEAD_DIM)
        max_pos = 8192
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=dev, dtype=torch.float32) / HEAD_DIM))
        ang = torch.arange(max_pos, device=dev, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = ang.cos(), ang.sin()
        pos = torch.randint(0, max_pos, (n,), device=dev)
        nbytes = 2 * n * (N_HEADS + N_KV_HEADS) * HEAD_DIM * es + n * HEAD_DIM * 4 + n * 8
        rows.append(_row("rotary", f"q[{n}, {N_HEADS}, {HEAD_DIM}] k[{n}, {N_KV_HEADS}, {HEAD_DIM}]", dtype, nbytes,
                         functools.partial(apply_rotary_triton, q, k, cos, sin, pos),
                         functools.partial(apply_rotary_torch, q, k, cos, sin, pos),
                         copy_gbs))  # fmt: skip

        # SiLU-and-mul on the fused gate_up output: reads [n, 2I], writes [n, I].
        gu = torch.randn(n, 2 * INTERMEDIATE, dtype=dtype, device=dev)
        nbytes = 3 * n * INTERMEDIATE * es
        rows.append(_row("act_and_mul(silu)", f"[{n}, {2 * INTERMEDIATE}]", dtype, nbytes,
                         functools.partial(act_and_mul_triton, gu, "silu"),
                         functools.partial(act_and_mul_torch, gu, "silu"),
                         copy_gbs))  # fmt: skip
        del x, res, qkv, gu
    return rows


QUANT_SHAPES = (("o_proj", HIDDEN, HIDDEN), ("gate_up", 2 * INTERMEDIATE, HIDDEN), ("down", HIDDEN, INTERMEDIATE))


def run_quant_benchmarks(
    dtype: torch.dtype, copy_gbs: float, tokens: tuple[int, ...] = (1, 8, 32), device: str | torch.device = "cuda"
) -> list[dict]:
    """Weight-only int8 (per channel) and int4 (group 128) GEMMs on Llama-3-8B's projections.

    GB/s counts the bytes of the quantized weight and its scales (what a decode step must read); the reference
    column is ``F.linear`` over the dense weight in ``dtype`` (cuBLAS), its GB/s over the dense weight's bytes, so
    ``ref_ms / triton_ms`` is the speedup over the unquantized layer.
    """
    if dtype == torch.float32:
        return []  # the quantized layers run with fp16/bf16 activations on GPU
    from .quant_format import QuantSpec, quantize_weight
    from .quant_gemm import quant_matmul_triton

    dev = torch.device(device)
    rows = []
    for name, n, k in QUANT_SHAPES:
        w = torch.randn(n, k, dtype=dtype, device=dev) / k**0.5
        for label, spec in (("int8", QuantSpec(8, k)), ("int4 g128", QuantSpec(4, 128))):
            q, s, z = quantize_weight(w, spec)
            nbytes = q.numel() * q.element_size() + s.numel() * s.element_size()
            for m in tokens:
                x = torch.randn(m, k, dtype=dtype, device=dev)
                row = _row(f"quant_gemm {label}", f"{name} [{m}, {k}] x [{n}, {k}]", dtype, nbytes,
                           functools.partial(quant_matmul_triton, x, q, s, z, spec, k),
                           functools.partial(torch.nn.functional.linear, x, w), copy_gbs)  # fmt: skip
                row["ref_gbs"] = w.numel() * w.element_size() / row["ref_ms"] / 1e6
                rows.append(row)
            del q, s, z
        del w
    return rows


def _fmt(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if value < 10 else f"{value:.1f}"
    return str(value)


def format_table(rows: list[dict], copy_gbs: float, device_name: str) -> str:
    """Markdown table of all rows, headed by the device and its measured copy bandwidth."""
    cols = [c for c in COLUMNS if c != "sdpa_ms" or any(r.get("sdpa_ms") is not None for r in rows)]
    lines = [
        f"Device: {device_name}; copy bandwidth {copy_gbs:.1f} GB/s (read + write)",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" for _ in cols) + "|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m hf_dsinfer.kernels.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype (default bf16)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and the copy bandwidth as JSON")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts to benchmark")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("hf_dsinfer.kernels.bench needs a CUDA device; none found, nothing measured.", file=sys.stderr)
        return 1  # a benchmark that measured nothing must not pass
    dtype = DTYPES[args.dtype]
    dev = torch.device("cuda")
    copy_gbs = measure_copy_gbs(dev)
    groups = {
        "norms / rotary / activations": lambda: run_benchmarks(dtype, copy_gbs, tuple(args.tokens)),
        "attention": lambda: run_attention_benchmarks(copy_gbs, dtype=dtype),
        "quant_gemm": lambda: run_quant_benchmarks(dtype, copy_gbs),
    }
    rows, failed = [], {}
    for group, run in groups.items():  # a group that raises is reported; the others still run
        try:
            rows += run()
        except Exception as e:  # noqa: BLE001
            failed[group] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    name = torch.cuda.get_device_name(dev)
    print(format_table(rows, copy_gbs, name))
    for group, error in failed.items():
        print(f"**FAILED:** {group}: {error}")
    if args.json:
        with open(args.json, "w") as f:
            report = {"device": name, "dtype": args.dtype, "copy_gbs": copy_gbs, "rows": rows, "failed": failed}
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
