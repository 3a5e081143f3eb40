"""Serving benchmark: continuous batching against transformers' ``generate_batch`` and our padded batches.

``python -m hf_dsinfer.bench.serving --preset small`` (a :mod:`hf_dsinfer.bench.decode` preset, random weights) runs:

* **mixed**: ``--requests`` requests (prompt 16-256 tokens, 16-128 new tokens, fixed seed), all arriving at once and
  with Poisson arrivals (``--rate`` requests/s), for three contenders: ``hf_cb`` (transformers' continuous batching on
  the HF model, its default attention), ``padded`` (hf_dsinfer's fused ``generate`` on left-padded batches of 8: every
  row decodes until the longest finishes) and ``cb`` (hf_dsinfer's continuous batching). Generated tokens/s (each
  request's own tokens) and time to first token p50 / p99.
* **grpo**: 8 prompts x 8 sampled completions on our engine with and without prefix sharing: prefill tokens computed
  and tokens/s.

Each figure is the median of ``--repeats`` runs after one warm-up run per contender; the report (JSON and markdown)
records the device, threads, versions and the machine load (``os.getloadavg``) so a disturbed run can be told apart.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from typing import Any

import torch
from torch import nn

PADDED_BATCH = 8


def mixed_workload(n: int, seed: int, vocab: int, max_prompt: int = 256, max_new: int = 128) -> list[tuple[list, int]]:
    """``n`` requests ``(prompt ids, new tokens)``: prompts of 16..max_prompt tokens, 16..max_new new tokens."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(16, max_prompt))], rng.randint(16, max_new))
        for _ in range(n)
    ]


def arrivals(n: int, rate: float | None, seed: int) -> list[float]:
    """Arrival offsets in seconds: all 0 (``rate`` None) or a Poisson process of ``rate`` requests/s."""
    if rate is None:
        return [0.0] * n
    rng, t, out = random.Random(seed + 1), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _greedy(new_tokens: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_manager(model: nn.Module, work: list[tuple[list, int]], offsets: list[float], cb_config: Any = None) -> dict:
    """Serve ``work`` through ``model.init_continuous_batching()`` (transformers' manager API: ours on an injected
    model, transformers' own otherwise), submitting each request at its offset; tokens/s and TTFT."""
    manager = model.init_continuous_batching(generation_config=_greedy(16), continuous_batching_config=cb_config)
    manager.start()
    submitted: dict[str, float] = {}
    t0 = time.perf_counter()

    def feed() -> None:
        for i, ((prompt, new), at) in enumerate(zip(work, offsets)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            submitted[f"r{i}"] = time.perf_counter()
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=new, record_timestamps=True)

    feeder = threading.Thread(target=feed)
    feeder.start()
    done: dict[str, Any] = {}
    while len(done) < len(work):
        out = manager.get_result(timeout=600)
        if out is None:
            raise RuntimeError(f"the manager stopped with {len(work) - len(done)} requests unanswered")
        if out.is_finished():
            done[out.request_id] = out
    elapsed = time.perf_counter() - t0
    feeder.join()
    manager.stop(block=True)
    tokens = sum(len(o.generated_tokens) for o in done.values())
    ttft = [o.timestamps[0] - submitted[rid] for rid, o in done.items() if o.timestamps]
    engine = getattr(manager, "engine", None)  # ours: how often the cache ran out
    extra = {"preemptions": engine.stats.preemptions} if engine is not None else {}
    return {"tokens": tokens, "seconds": elapsed, "ttft": ttft, **extra}


def run_padded(model: nn.Module, work: list[tuple[list, int]], offsets: list[float]) -> dict:
    """Fused ``generate`` on left-padded batches of :data:`PADDED_BATCH` in arrival order (a batch starts when its
    last request has arrived and the previous batch is done); each row counts only its own new tokens."""
    from ..generation.stats import last_generate_stats
    from ..serving.padded import padded_generate_batch

    t0 = time.perf_counter()
    tokens, ttft = 0, []
    for start in range(0, len(work), PADDED_BATCH):
        chunk = work[start : start + PADDED_BATCH]
        delay = t0 + offsets[start + len(chunk) - 1] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        began = time.perf_counter()
        padded_generate_batch(model.generate, [p for p, _ in chunk], _greedy(max(n for _, n in chunk)),
                              rows=PADDED_BATCH, device=model.device)  # fmt: skip
        first = began + last_generate_stats(model).ttft_ms / 1e3
        tokens += sum(n for _, n in chunk)
        ttft += [first - (t0 + offsets[start + i]) for i in range(len(chunk))]
    return {"tokens": tokens, "seconds": time.perf_counter() - t0, "ttft": ttft}


def run_grpo(model: nn.Module, sharing: bool, seed: int, vocab: int) -> dict:
    """8 prompts x 8 sampled completions (64 new tokens) on our engine; prefill tokens computed, tokens/s."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from ..serving.hf_api import last_batch_stats

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(64, 192))] for _ in range(8)]
    batch = [p for p in prompts for _ in range(8)]
    config = GenerationConfig(max_new_tokens=64, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=-1)
    cb = ContinuousBatchingConfig(allow_block_sharing=sharing)
    t0 = time.perf_counter()
    out = model.generate_batch(batch, generation_config=config, continuous_batching_config=cb)
    elapsed = time.perf_counter() - t0
    stats = last_batch_stats(model)
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"tokens": tokens, "seconds": elapsed, "prefill_computed": stats.prefill_tokens_computed,
            "prefill_requested": stats.prompt_tokens}  # fmt: skip


def _summary(runs: list[dict]) -> dict:
    rates = [r["tokens"] / r["seconds"] for r in runs]
    row = {"tokens_per_s": statistics.median(rates), "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates)}
    ttft = [t for r in runs for t in r.get("ttft", [])]
    if ttft:
        row.update(ttft_p50_ms=_percentile(ttft, 0.5) * 1e3, ttft_p99_ms=_percentile(ttft, 0.99) * 1e3)
    for key in ("prefill_computed", "prefill_requested", "preemptions"):
        if key in runs[0]:
            row[key] = runs[0][key]
    return row


def run_serve_bench(preset: str, requests: int, rate: float, repeats: int, threads: int | None, seed: int) -> dict:
    """Every contender on one model shape; returns the report (see the module docstring)."""
    import transformers

    from ..integration.engine import init_inference
    from .decode import preset_config, preset_model

    if threads is not None:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = "bf16" if device.type == "cuda" else "fp32"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = preset_config(preset)
    work = mixed_workload(requests, seed, config.vocab_size)
    longest = max(len(p) for p, _ in work) + max(n for _, n in work)  # a padded batch's width + new tokens
    hf = preset_model(preset, config, device, dtype, seed)
    ours = init_inference(
        preset_model(preset, config, device, dtype, seed), dtype=dtype_name, replace_with_kernel_inject=True,
        max_out_tokens=max(longest, 192 + 64), max_batch_size=PADDED_BATCH,
    ).module  # fmt: skip
    hf_cb = transformers.ContinuousBatchingConfig(num_blocks=requests * (longest // 16 + 2), page_size=16)
    contenders = {
        "hf_cb": lambda offs: run_manager(hf, work, offs, hf_cb),
        "padded": lambda offs: run_padded(ours, work, offs),
        "cb": lambda offs: run_manager(ours, work, offs),
    }
    report: dict[str, Any] = {
        "preset": preset, "device": str(device), "dtype": str(dtype), "threads": torch.get_num_threads(),
        "requests": requests, "rate": rate, "repeats": repeats, "seed": seed, "torch": torch.__version__,
        "transformers": transformers.__version__, "load_before": os.getloadavg(), "rows": [],
    }  # fmt: skip
    for arrival, offs in (
        ("at once", arrivals(requests, None, seed)),
        (f"poisson {rate}/s", arrivals(requests, rate, seed)),
    ):
        for name, run in contenders.items():
            runs = [run(offs) for _ in range(repeats + 1)][1:]  # the first run warms up (compile, allocation)
            report["rows"].append({"workload": f"mixed, {arrival}", "contender": name, **_summary(runs)})
    for sharing in (True, False):
        runs = [run_grpo(ours, sharing, seed, config.vocab_size) for _ in range(repeats + 1)][1:]
        report["rows"].append({"workload": "grpo 8x8", "contender": f"cb, prefix sharing {'on' if sharing else 'off'}",
                               **_summary(runs)})  # fmt: skip
    report["load_after"] = os.getloadavg()
    return report


def markdown(report: dict) -> str:
    """The report as a markdown table."""
    load = f"load {report['load_before'][0]:.1f} -> {report['load_after'][0]:.1f}"
    head = (
        f"{report['preset']} on {report['device']} ({report['dtype']}, {report['threads']} threads), "
        f"{report['requests']} requests, median of {report['repeats']}; {load}; torch {report['torch']}, "
        f"transformers {report['transformers']}"
    )
    columns = "| workload | contender | tokens/s (min-max) | TTFT p50 / p99 ms | prefill computed / requested |"
    lines = [head, "", columns, "|---|---|---|---|---|"]
    for r in report["rows"]:
        ttft = f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}" if "ttft_p50_ms" in r else ""
        prefill = f"{r['prefill_computed']} / {r['prefill_requested']}" if "prefill_computed" in r else ""
        lines.append(f"| {r['workload']} | {r['contender']} | {r['tokens_per_s']:.1f} ({r['tokens_per_s_min']:.1f}-"
                     f"{r['tokens_per_s_max']:.1f}) | {ttft} | {prefill} |")  # fmt: skip
    return "\n".join(lines)


def write_plot(report: dict, path: str) -> None:
    """A PNG of tokens/s per workload and contender (horizontal bars, min-max over the repeats as error bars)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [f"{r['workload']}: {r['contender']}" for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    err = [
        [v - r["tokens_per_s_min"] for v, r in zip(values, rows)],
        [r["tokens_per_s_max"] - v for v, r in zip(values, rows)],
    ]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    ax.barh(range(len(rows)), values, xerr=err, capsize=3)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("generated tokens/s")
    ax.set_title(f"{report['preset']} on {report['device']}, {report['threads']} threads", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hf_dsinfer.bench.serving", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny",
                   help="a hf_dsinfer.bench.decode preset (random weights; smollm2-real: SmolLM2-135M's trained "
                   "weights)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=8.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=".", help="directory for serve-<preset>.json / .md")
    a = p.parse_args(argv)
    report = run_serve_bench(a.preset, a.requests, a.rate, a.repeats, a.threads, a.seed)
    stem = os.path.join(a.out, f"serve-{a.preset}-t{report['threads']}")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    try:
        write_plot(report, stem + ".png")
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)")
    print(text)


if __name__ == "__main__":
    main()
