"""Which CPU kind of :mod:`.quant_cpu` is fastest, measured: ``python -m hf_dsinfer.kernels.quant_cpu_bench
[--threads 1] [--repeats 3] [--shapes NxK,...] [--json PATH]`` (figures in docs/kernels.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant_cpu import cpu_quant_matmul, pack_for_cpu, supported_kinds
from .quant_format import QuantSpec, quantize_weight

BENCH_SHAPES = ((512, 512), (1408, 512), (512, 1408), (4096, 4096))  # (N out, K in): small llama, 8B-like
BENCH_ROWS = (1, 4, 8)


def _time_calls(fns: list, min_seconds: float = 0.2) -> float:
    """Seconds per call, cycling through ``fns`` (one per weight copy, so weights come from memory, not cache)."""
    import time

    for fn in fns[:2]:
        fn()
    calls, t0 = 0, time.perf_counter()
    while True:
        for fn in fns:
            fn()
        calls += len(fns)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return elapsed / calls


def benchmark(shapes=BENCH_SHAPES, rows=BENCH_ROWS, repeats: int = 3, fp32_bytes: int = 128 << 20) -> list[dict]:
    """Per shape and row count: microseconds per call (min and max over ``repeats``) of fp32 ``F.linear`` over a
    K-major weight (what :func:`hf_dsinfer.modules.linear.gemm_layout` gives on CPU) and of every packed kind for
    int8 per channel and int4 group 128, fp32 and bf16 compute. Each candidate cycles through as many weight copies
    as make ``fp32_bytes`` of fp32 weights (a model's worth: more than the last-level cache), each copy stored in
    its own format, so a quantized model's smaller footprint counts as it would in a decode step. The repeats go
    round robin over the candidates."""
    out = []
    for n, k in shapes:
        copies = max(2, -(-fp32_bytes // (4 * n * k)))
        gen = torch.Generator().manual_seed(0)
        ws = [torch.randn(n, k, generator=gen) / k**0.5 for _ in range(copies)]
        cands: dict[str, list] = {"fp32 F.linear": []}
        for w in ws:
            wk = torch.empty(k, n).t()  # [N, K] K-major
            wk.copy_(w)
            cands["fp32 F.linear"].append(("linear", wk))
        for label, spec in (("int8", QuantSpec(8, k, True)), ("int4 g128", QuantSpec(4, 128, True))):
            qs = [quantize_weight(w, spec, scale_dtype=torch.float32) for w in ws]
            for kind in supported_kinds(spec, k):
                for cd in (torch.float32, torch.bfloat16):
                    if (kind == "dequant" or kind.startswith("fp16gemm")) and cd == torch.bfloat16:
                        continue  # fp32 compute only
                    if kind == "fp16gemm_exact" and spec.n_groups(k) == 1:
                        continue  # per channel it is fp16gemm
                    name = f"{label} {kind} {'fp32' if cd == torch.float32 else 'bf16'}"
                    packs = [pack_for_cpu(*q, spec, k, kind=kind, compute_dtype=cd) for q in qs]
                    if packs[0].kind != kind:  # rejected by check_kind: the row times the fallback, and says so
                        name += f" (checked: {packs[0].kind})"
                    cands[name] = [("packed", p) for p in packs]
        del ws
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            fns = {
                name: [
                    (lambda w=w, x=x: F.linear(x, w)) if how == "linear" else (lambda p=w, x=x: cpu_quant_matmul(x, p))
                    for how, w in items
                ]
                for name, items in cands.items()
            }
            times: dict[str, list[float]] = {name: [] for name in cands}
            for _ in range(repeats):  # round robin: a load spike on a shared machine hits every candidate alike
                for name, calls in fns.items():
                    times[name].append(_time_calls(calls) * 1e6)
            row = {"shape": f"{n}x{k}", "M": m, "copies": copies}
            row.update({name: (min(ts), max(ts)) for name, ts in times.items()})
            out.append(row)
    return out


def format_benchmark(rows: list[dict]) -> str:
    """Markdown table: min microseconds per call and the speedup of each kind over fp32 ``F.linear``."""
    names = list(dict.fromkeys(c for r in rows for c in r if c not in ("shape", "M", "copies")))  # every shape's
    lines = ["| shape (N x K) | M | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in rows:
        base = r["fp32 F.linear"][0]
        cells = [
            "-" if c not in r else f"{r[c][0]:.0f} us" + ("" if c == "fp32 F.linear" else f" ({base / r[c][0]:.2f}x)")
            for c in names
        ]
        lines.append(f"| {r['shape']} | {r['M']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: print (and optionally save) :func:`benchmark`'s table."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m hf_dsinfer.kernels.quant_cpu_bench", description=benchmark.__doc__)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in BENCH_SHAPES), help="NxK,...")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = benchmark(shapes, repeats=args.repeats)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} thread(s), min of {args.repeats} repeats")  # fmt: skip
    print(format_benchmark(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
