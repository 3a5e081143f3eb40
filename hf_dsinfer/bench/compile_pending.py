"""``hf-dsinfer bench --compile-pending``: how fast ``generate`` decodes while the CPU decode step compiles.

Issue 36 asks that no ``generate`` call be slower than plain HF eager while a compile is pending. Each run is a fresh
process with an empty compile cache (``TORCHINDUCTOR_CACHE_DIR`` in a temporary folder) holding SmolLM2 twice: HF's
eager model and hf_dsinfer's with ``cpu_compile=True`` (the compile starts at its first decode step, in the
background). The child first times HF eager alone (the reference: what the user gets without hf_dsinfer, nothing
compiling), then alternates one hf_dsinfer call and one HF call until the compile is done and a few calls after it,
bounded in calls and seconds. Every call is a greedy ``generate`` of ``--new-tokens`` tokens (EOS masked) on the same
``--prompt-len`` random token ids; its figure is the whole call's ms per new token.

Variants (``--pending-variants``) name what the background compile does differently (see ``VARIANTS``); given
several, the runs alternate them so each sees the same machine.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

#: Variant name -> environment of the child (read by hf_dsinfer.generation.compiled_cpu) and the child's settings of
#: module constants: of compiled_cpu, or of compile_gate for names prefixed ``gate.``.
VARIANTS: dict[str, tuple[dict[str, str], dict[str, float]]] = {
    "default": ({}, {}),  # nice 19, eager steps on one thread fewer, the compile parked during steps
    "nice-all-threads": ({}, {"LEAVE_A_CORE_AT_NICE": 0}),  # the compile at nice 19, steps on torch's threads
    "normal-priority": ({"HF_DSINFER_COMPILE_NICE": "0"}, {}),  # the compile at the caller's priority (one fewer)
    "unparked": ({}, {"PARK_COMPILE": 0}),  # as default, but the compile's Python is never parked during steps
    "full-gc-as-usual": ({}, {"gate.GC_FULL_THRESHOLD": 0}),  # gc's full collections at the caller's threshold
}
MAX_CALLS = 60  # per process: hf_dsinfer calls (each beside an HF call), bounded
MAX_SECONDS = 900.0  # per process: the compile of SmolLM2 takes 1-3 minutes on 2 cores
CALLS_AFTER = 2  # hf_dsinfer calls after the compile is done (the compiled step), each beside an HF call
REFERENCE_CALLS = 3  # HF eager calls before anything compiles


def _ms_per_token(model: Any, ids: Any, new_tokens: int) -> float:
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens)  # fmt: skip
    assert out.shape[1] == ids.shape[1] + new_tokens
    return (time.perf_counter() - t0) * 1e3 / new_tokens


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def child(prompt_len: int, new_tokens: int, threads: int | None, variant: str) -> dict[str, Any]:
    """One run (this process): the reference HF calls, then hf_dsinfer and HF alternating while the compile runs."""
    import torch
    import transformers

    import hf_dsinfer  # noqa: F401 - registers inference_config

    from ..generation import compile_gate, compiled_cpu
    from ..generation.api import GEN_ATTR
    from ..real_model import smollm2_path

    for name, value in VARIANTS[variant][1].items():
        module, name = (compile_gate, name[5:]) if name.startswith("gate.") else (compiled_cpu, name)
        setattr(module, name, value)

    if threads:
        torch.set_num_threads(threads)
    path = smollm2_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = {"dtype": "fp32", "max_batch_size": 1, "max_out_tokens": prompt_len + new_tokens + 8,
              "cpu_compile": True}  # fmt: skip
    ours = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=config).eval()
    compiled = getattr(ours, GEN_ATTR).step.compiled
    ids = torch.randint(3, hf.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    _ms_per_token(hf, ids, 4)  # warm-up: first-call allocations (both models; ours with compiling off, read per step)
    os.environ["HF_DSINFER_CPU_COMPILE"] = "0"
    _ms_per_token(ours, ids, 4)
    os.environ["HF_DSINFER_CPU_COMPILE"] = "1"
    calls: list[dict[str, Any]] = []
    for _ in range(REFERENCE_CALLS):
        calls.append(dict(who="hf", state="alone", ms=_ms_per_token(hf, ids, new_tokens), load=_load()))
    t_start = time.monotonic()
    full_gcs: list[list[float]] = []  # [start s, end s] (from t_start) of each full collection, in any thread

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                full_gcs.append([time.monotonic() - t_start, float("nan")])
            elif full_gcs:
                full_gcs[-1][1] = time.monotonic() - t_start

    gc.callbacks.append(on_gc)
    slow_steps = _watch_steps(t_start)
    after = 0
    for _ in range(MAX_CALLS):
        before = compiled.pending or not compiled.compile_s
        t0 = time.monotonic() - t_start
        ms = _ms_per_token(ours, ids, new_tokens)
        state = "pending" if compiled.pending else ("swap" if before else "compiled")
        calls.append(dict(who="ours", state=state, ms=ms, load=_load(), t=[t0, time.monotonic() - t_start]))
        hf_before = compiled.pending
        ms = _ms_per_token(hf, ids, new_tokens)
        calls.append(dict(who="hf", state="pending" if hf_before and compiled.pending else "alone", ms=ms,
                          load=_load()))  # fmt: skip
        after += state == "compiled"
        if after >= CALLS_AFTER or time.monotonic() - t_start > MAX_SECONDS or compiled.failed:
            break
    # compile_s None: still compiling after the last call (the child then exits without waiting for it)
    from ..generation.compile_gate import GATE

    gc.callbacks.remove(on_gc)
    return dict(calls=calls, compile_s=compiled.compile_s.get(1), failed=compiled.failed,
                threads=torch.get_num_threads(), parked_s=round(GATE.parked_s, 1),
                lent_s=round(GATE.lent_s, 1), full_gcs=full_gcs, slow_steps=slow_steps)  # fmt: skip


def _watch_steps(t_start: float) -> list[dict[str, Any]]:
    """Times every decode step (inside the gate, so without the slice lent after it); for a step over 1.5x the median
    of the 30 before it, keeps where the compile thread stands right after it: parked at its next Python call, its
    stack names what it ran last (a long C call that no park can split shows up here). Diagnostics, in the JSON."""
    import contextlib
    import traceback

    from ..generation.compile_gate import GATE

    durations: list[float] = []
    slow: list[dict[str, Any]] = []
    gate_step = GATE.step

    @contextlib.contextmanager
    def step():
        with gate_step():
            t0 = time.perf_counter()
            try:
                yield
            finally:
                ms = (time.perf_counter() - t0) * 1e3
                recent = durations[-30:]
                if len(recent) >= 10 and ms > 1.5 * statistics.median(recent):
                    stacks = {}
                    frames = sys._current_frames()
                    for th in threading.enumerate():
                        frame = frames.get(th.ident) if th.name.startswith("hf_dsinfer-compile") else None
                        if frame is not None:
                            rows = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                                    for f in traceback.extract_stack(frame) if "compile_gate" not in f.filename]
                            stacks[th.name] = rows[-8:]
                    slow.append(dict(t=round(time.monotonic() - t_start, 3), ms=round(ms, 1),
                                     median_ms=round(statistics.median(recent), 1), compile_stacks=stacks))
                durations.append(ms)

    GATE.step = step  # the instance's attribute: compiled_cpu calls GATE.step()
    return slow


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    ref = statistics.median(c["ms"] for c in run["calls"] if c["who"] == "hf" and c["state"] == "alone")
    pending = [c["ms"] for c in run["calls"] if c["who"] == "ours" and c["state"] == "pending"]
    hf_pending = [c["ms"] for c in run["calls"] if c["who"] == "hf" and c["state"] == "pending"]
    compiled = [c["ms"] for c in run["calls"] if c["who"] == "ours" and c["state"] == "compiled"]
    # each hf_dsinfer call against the HF call right after it (the same machine state; what counts under a load)
    calls = run["calls"]
    beside = [a["ms"] / b["ms"] for a, b in zip(calls, calls[1:]) if a["who"] == "ours" and a["state"] == "pending"]
    # ms of full garbage collections (one C call holding the GIL, in whichever thread) inside each of our pending calls
    gcs = run.get("full_gcs", [])
    in_calls = [sum(max(0.0, min(c["t"][1], e) - max(c["t"][0], s)) * 1e3 for s, e in gcs if e == e)
                for c in calls if c["who"] == "ours" and c["state"] == "pending" and "t" in c]
    return dict(full_gc_ms=[round((e - s) * 1e3) for s, e in gcs if e == e],
                full_gc_in_pending_ms=[round(x) for x in in_calls],
                hf_alone_ms=round(ref, 1), ours_pending_ms=[round(x, 1) for x in pending],
                slower_than_hf=sum(x > ref for x in pending), hf_pending_ms=[round(x, 1) for x in hf_pending],
                ours_compiled_ms=[round(x, 1) for x in compiled], ratio_to_next_hf=[round(x, 2) for x in beside],
                slower_than_next_hf=sum(x > 1 for x in beside))  # fmt: skip


def run_pending_bench(runs: int, prompt_len: int, new_tokens: int, threads: int | None,
                      variants: list[str]) -> dict[str, Any]:  # fmt: skip
    """``runs`` fresh processes per variant, variants alternating; returns every call of every run."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--pending-variants: unknown {unknown}; choose among {', '.join(VARIANTS)}")
    results = []
    for i in range(runs):
        for variant in variants:
            with tempfile.TemporaryDirectory(prefix="hf_dsinfer-pending-") as tmp:
                env = {**os.environ, **VARIANTS[variant][0], "HF_DSINFER_CPU_COMPILE": "1",
                       "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}  # fmt: skip
                out = os.path.join(tmp, "run.json")
                cmd = [sys.executable, "-m", "hf_dsinfer.bench.compile_pending", out, str(prompt_len),
                       str(new_tokens), str(threads or 0), variant]  # fmt: skip
                load0 = _load()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=MAX_SECONDS * 2 + 300)
                if proc.returncode != 0:
                    raise RuntimeError(f"run {i} ({variant}) failed:\n{proc.stderr[-3000:]}")
                with open(out, encoding="utf-8") as f:
                    run = json.load(f)
            run.update(variant=variant, run=i, load_at_start=load0, **_summary(run))
            results.append(run)
            print(_row(run), flush=True)
    return dict(mode="compile-pending", prompt_len=prompt_len, new_tokens=new_tokens, runs=results)


def _row(r: dict[str, Any]) -> str:
    loads = [c["load"] for c in r["calls"]]
    return (f"| {r['run']} | {r['variant']} | {r['threads']} | {_compile_text(r)} | {r['hf_alone_ms']} | "
            f"{', '.join(f'{x:.0f}' for x in r['ours_pending_ms'])} | {r['slower_than_hf']} of "
            f"{len(r['ours_pending_ms'])} | {', '.join(f'{x:.0f}' for x in r['hf_pending_ms'])} | "
            f"{', '.join(f'{x:.0f}' for x in r['ours_compiled_ms'])} | {_median(r['ratio_to_next_hf'])} | "
            f"{r['slower_than_next_hf']} of {len(r['ratio_to_next_hf'])} | {r.get('parked_s', '-')} / "
            f"{r.get('lent_s', '-')} | {_gc_text(r)} | {min(loads):.1f}-{max(loads):.1f} |")


def _gc_text(r: dict[str, Any]) -> str:
    """Full collections during the run (ms each), and the ms of them inside our calls while compiling (each call)."""
    if "full_gc_ms" not in r:
        return "-"
    inside = [f"call {i + 1}: {x}" for i, x in enumerate(r["full_gc_in_pending_ms"]) if x]
    return f"{', '.join(map(str, r['full_gc_ms'])) or 'none'}; in our calls: {', '.join(inside) or 'none'}"


def _compile_text(r: dict[str, Any]) -> str:
    if r["failed"]:
        return "failed"
    return f"{r['compile_s']:.0f}" if r["compile_s"] is not None else "not done"


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}" if xs else "-"


HEADER = ("| run | variant | threads | compile s | HF eager alone, ms/token (median) | hf_dsinfer while compiling, "
          "each call | slower than HF alone | HF eager while compiling, each call | hf_dsinfer compiled | "
          "hf_dsinfer / the HF call after it, median | slower than the HF call after it | compile parked / lent, s | "
          "full GCs, ms | load |\n|---|---|---:|---:|---:|---|---|---|---|---:|---|---|---|---|")  # fmt: skip


def pending_main(ns) -> dict[str, Any]:
    """``bench --compile-pending``: ``--repeats`` runs per variant; writes ``compile-pending.json`` / ``.md``."""
    from .report import write_report

    variants = [v.strip() for v in str(getattr(ns, "pending_variants", "default")).split(",") if v.strip()]
    print(HEADER, flush=True)
    report = run_pending_bench(ns.repeats, ns.prompt_len, ns.new_tokens, ns.threads, variants)
    table = "\n".join([HEADER, *(_row(r) for r in report["runs"])]) + "\n"
    write_report(report, table, ns.out, "compile-pending")
    return report


if __name__ == "__main__":  # the child: python -m hf_dsinfer.bench.compile_pending OUT PROMPT NEW THREADS VARIANT
    _out, _prompt, _new, _threads, _variant = sys.argv[1:6]
    _res = child(int(_prompt), int(_new), int(_threads) or None, _variant)
    with open(_out, "w", encoding="utf-8") as _f:
        json.dump(_res, _f)
    os._exit(0)  # not the exit-time wait for a compile still running: its time is not measured here
