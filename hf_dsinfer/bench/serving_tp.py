"""Tensor-parallel serving benchmark: continuous batching against padded batches, both on ``--tp`` gloo ranks (CPU).

``hf-dsinfer bench --serve-tp 2`` (or ``python -m hf_dsinfer.bench.serving_tp --tp 2``) saves a random-weight model of
a :mod:`~hf_dsinfer.bench.decode` preset, starts ``--tp`` processes (torchrun's environment on 127.0.0.1), each loading
it with ``tensor_parallel.tp_size = tp`` and fused layers, and times on the same ranks, contenders alternating within
every round (one warm-up run each first):

* ``cb``: the paged engine (:class:`~hf_dsinfer.serving.ServingEngine` on rank 0, :func:`~hf_dsinfer.serving.tp_worker.
  run_worker` on the others): every request arrives at once with its own number of new tokens;
* ``padded``: what ``generate_batch`` did under TP before: fused ``generate`` on left-padded batches of 8 on every
  rank, each batch decoding until its longest request is done (each request counts only its own tokens).

Reported per run: seconds, generated tokens/s, the 1-minute load average; and whether both contenders produced the
same greedy tokens for every request.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

PADDED_BATCH = 8


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hf_dsinfer.bench.serving_tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--preset", default="tiny", help="model shape, random weights (default: tiny)")
    p.add_argument("--requests", type=int, default=16, help="requests per run (default: 16)")
    p.add_argument("--max-prompt", type=int, default=128, help="prompts of 16..N tokens (default: 128)")
    p.add_argument("--max-new", type=int, default=64, help="16..N new tokens per request (default: 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every contender (default: 3)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank (default: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the ranks may take (default: 1800)")
    return p.parse_args(argv)


def _workload(n: int, seed: int, vocab: int, max_prompt: int, max_new: int) -> list[tuple[list[int], int]]:
    from .serving import mixed_workload

    return mixed_workload(n, seed, vocab, max_prompt=max_prompt, max_new=max_new)


def _greedy(new_tokens: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def _run_cb(model: Any, engine: Any, work: list, rank: int) -> dict:
    """The paged engine: rank 0 submits everything and steps; the other ranks follow the steps."""
    from ..serving.tp_worker import run_worker

    if rank != 0:
        run_worker(model)
        return {}
    engine.reset_stats()
    engine.clear_prefix_cache()
    t0 = time.perf_counter()
    handles = [engine.submit(prompt, _greedy(new)) for prompt, new in work]
    engine.run_until_idle()
    seconds = time.perf_counter() - t0
    engine.stop_workers()
    stats = engine.stats
    return {"seconds": seconds, "tokens": sum(len(h.tokens) for h in handles), "steps": stats.steps,
            "preemptions": stats.preemptions, "outputs": [list(h.tokens) for h in handles]}  # fmt: skip


def _run_padded(model: Any, work: list) -> dict:
    """Left-padded batches of :data:`PADDED_BATCH` through the fused ``generate`` (every rank makes the same calls)."""
    from ..serving.padded import padded_generate_batch

    t0 = time.perf_counter()
    outputs = []
    for start in range(0, len(work), PADDED_BATCH):
        chunk = work[start : start + PADDED_BATCH]
        out = padded_generate_batch(model.generate, [p for p, _ in chunk], _greedy(max(n for _, n in chunk)),
                                    rows=PADDED_BATCH, device=model.device)  # fmt: skip
        outputs += [out[f"req_{i}"].generated_tokens[:n] for i, (_, n) in enumerate(chunk)]
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": sum(n for _, n in work), "outputs": outputs}


def worker(job_path: str) -> None:
    """One rank: load the model split over the group, run every round, rank 0 writes the runs."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_dsinfer  # noqa: F401 - registers inference_config=

    from ..parallel.groups import init_distributed
    from ..serving import ServingEngine

    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(job["threads"])
    init_distributed()
    rank = dist.get_rank()
    cfg = {"dtype": "fp32", "replace_with_kernel_inject": True, "tensor_parallel": {"tp_size": job["tp"]},
           "max_out_tokens": job["max_prompt"] + job["max_new"], "max_batch_size": PADDED_BATCH}  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(job["path"], inference_config=cfg)
    work = _workload(job["requests"], job["seed"], model.config.vocab_size, job["max_prompt"], job["max_new"])
    engine = None
    if rank == 0:  # cache room for every request at once: the comparison is about batching, not preemption
        tokens = sum(len(p) + n for p, n in work)
        engine = ServingEngine(model, max_num_seqs=len(work), num_blocks=-(-tokens // 16) + len(work))
    runs = []
    order = ["cb", "padded"]
    with torch.no_grad():
        for round_ in range(job["rounds"] + 1):  # round 0: warm-up of each contender, not reported
            for name in order if round_ % 2 == 0 else order[::-1]:
                dist.barrier()
                result = _run_cb(model, engine, work, rank) if name == "cb" else _run_padded(model, work)
                if rank == 0:
                    runs.append({"round": round_, "contender": name, "load_1min": os.getloadavg()[0], **result})
    if rank == 0:
        with open(os.path.join(os.path.dirname(job_path), "runs.json"), "w") as f:
            json.dump(runs, f)
    dist.barrier()
    dist.destroy_process_group()


def _launch(job: dict, directory: str, timeout: float) -> list[dict]:
    """Start the ranks (``python -m hf_dsinfer.bench.serving_tp worker JOB``) and return rank 0's runs."""
    import socket

    job_path = os.path.join(directory, "job.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(job["tp"]):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(job["tp"]),
               "LOCAL_WORLD_SIZE": str(job["tp"]), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": str(job["threads"]), "CUDA_VISIBLE_DEVICES": "", "HF_DSINFER_CPU_COMPILE": "sync"}
        log = open(os.path.join(directory, f"log{rank}.txt"), "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, "-m", "hf_dsinfer.bench.serving_tp", "worker", job_path],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        for proc, _ in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()
    path = os.path.join(directory, "runs.json")
    if not os.path.exists(path):
        with open(os.path.join(directory, "log0.txt")) as f:
            raise RuntimeError(f"the benchmark ranks failed:\n{f.read()[-4000:]}")
    with open(path) as f:
        return json.load(f)


def report(runs: list[dict], job: dict) -> dict:
    """The summary: every reported run, each contender's median tokens/s, the speed-up, token agreement."""
    shown = [r for r in runs if r["round"] > 0]
    rates: dict[str, list[float]] = {}
    for r in shown:
        rates.setdefault(r["contender"], []).append(r["tokens"] / r["seconds"])
    median = {k: statistics.median(v) for k, v in rates.items()}
    first = {r["contender"]: r["outputs"] for r in runs if r["round"] == 0}
    same = first.get("cb") == first.get("padded")
    return {
        "job": {k: v for k, v in job.items() if k != "path"},
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in shown],
        "median_tokens_per_s": median,
        "cb_over_padded": median["cb"] / median["padded"] if median.get("padded") else None,
        "same_tokens": same,
        "torch": torch.__version__,
    }


def markdown(summary: dict) -> str:
    job = summary["job"]
    lines = [f"TP={job['tp']} on gloo (CPU), preset {job['preset']}, {job['requests']} requests (prompts 16-"
             f"{job['max_prompt']}, 16-{job['max_new']} new tokens), {job['threads']} thread(s) per rank", "",
             "| round | contender | s | tokens/s | load (1 min) |", "|---|---|---|---|---|"]  # fmt: skip
    for r in summary["runs"]:
        lines.append(f"| {r['round']} | {r['contender']} | {r['seconds']:.2f} | {r['tokens'] / r['seconds']:.1f} | "
                     f"{r['load_1min']:.2f} |")  # fmt: skip
    ratio = summary["cb_over_padded"]
    lines += ["", "median tokens/s: " + ", ".join(f"{k} {v:.1f}" for k, v in summary["median_tokens_per_s"].items())
              + (f"; cb / padded {ratio:.2f}x" if ratio else "") + f"; same greedy tokens: {summary['same_tokens']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; prints the markdown table and returns the summary."""
    from .decode import build_random_model, preset_config

    args = _args(argv)
    if args.tp < 2:
        raise SystemExit("--tp: the tensor-parallel benchmark needs at least 2 ranks")
    with tempfile.TemporaryDirectory(prefix="hf_dsinfer_serving_tp_") as tmp:
        model = build_random_model(preset_config(args.preset), torch.device("cpu"), torch.float32, seed=args.seed)
        model.save_pretrained(os.path.join(tmp, "model"))
        del model
        job = {"path": os.path.join(tmp, "model"), "tp": args.tp, "preset": args.preset, "requests": args.requests,
               "max_prompt": args.max_prompt, "max_new": args.max_new, "rounds": args.rounds,
               "threads": args.threads, "seed": args.seed}  # fmt: skip
        summary = report(_launch(job, tmp, args.timeout), job)
    print(markdown(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        main(sys.argv[1:])
