"""Time a decode step's GEMMs on CPU: ``F.linear`` over plain weights against oneDNN's prepacked linear
(``modules/cpu_packed.py``), summed over SmolLM2-135M's shapes (30 layers of qkv, o, gate/up and down, and the LM
head; random weights), for each dtype and row count. Every repeat is printed (median of them last); products are
compared bit for bit on the first layer's weights.

    python scripts/bench_cpu_packed_gemm.py --dtypes fp32,bf16 --rows 1,4,8,16,32,64,128 --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in]: fused qkv, o, fused gate/up, down
HEAD = (49152, 576)


def _time(fn, repeats: int) -> list[float]:
    fn()  # warm-up: oneDNN builds its primitive for this shape and row count
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--rows", default="1,4,8,16,32,64,128")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, AMX {amx}, load {os.getloadavg()[0]:.2f}")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        g = torch.Generator().manual_seed(0)
        weights = [(torch.randn(s, generator=g) * 0.02).to(dtype) for s in LAYER * 30 + [HEAD]]  # [out, in] each
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        mib = sum(w.numel() * w.element_size() for w in weights) / 2**20
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in (576, 1536)}  # [M, in]

            def plain(ws=weights, xs=xs):
                for w in ws:
                    F.linear(xs[w.shape[1]], w)

            def prepacked(ws=weights, ps=packed, xs=xs):
                for w, p in zip(ws, ps):
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

            runs_plain, runs_packed = _time(plain, args.repeats), _time(prepacked, args.repeats)
            equal = all(
                torch.equal(F.linear(xs[w.shape[1]], w), torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None,
                                                                                            "none", [], ""))
                for w, p in zip(weights[:4], packed[:4])
            )  # fmt: skip
            fmt = ", ".join
            print(f"{name} {mib:.0f} MiB rows {rows:4d}: F.linear {fmt(f'{t:.1f}' for t in runs_plain)} "
                  f"(median {statistics.median(runs_plain):.1f}) | packed {fmt(f'{t:.1f}' for t in runs_packed)} "
                  f"(median {statistics.median(runs_packed):.1f}) ms | bitwise equal {equal}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
