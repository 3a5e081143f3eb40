"""``hf-dsinfer bench --prefill``: prefill / forward-only scoring throughput, hf_dsinfer against HF sdpa.

What lm-eval's log-likelihoods, reward models and a batch's log-probs run is one forward over long inputs with every
position's logits. This benchmark times exactly that, ``model(input_ids, attention_mask)`` with all logits, at each
point (batch, length), on HF's model with ``attn_implementation="sdpa"`` and on hf_dsinfer's injected model built
from the same weights, alternating the two in every round; each round is reported with the load average beside it.
The first round also compares the two models' logits (max abs difference over max abs logit). Each run also records
the process CPU seconds of its forward (all threads): on a loaded machine that is steadier than wall time, since time
spent waiting for a core is not in it.

Inputs are seeded random token ids (a forward's cost does not depend on their values), full attention masks.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch

from ..log import logger
from .report import error_text

#: (batch, length) points measured by default: batch 1 and 8 at 512 tokens, batch 1 at 2048 (batch 8 at 2048 is
#: 16k tokens of full logits, minutes per forward on one CPU thread: ask for it with ``--prefill-points 8x2048``).
DEFAULT_POINTS = ((1, 512), (8, 512), (1, 2048))
CONTENDERS = ("HF sdpa", "hf_dsinfer")


def parse_points(text: str) -> tuple[tuple[int, int], ...]:
    """``"1x512,8x512"`` -> ``((1, 512), (8, 512))``; a clear error otherwise."""
    points = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            batch, length = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--prefill-points takes BATCHxLENGTH items such as 1x512,8x512; got {item!r}") from None
        if batch < 1 or length < 1:
            raise SystemExit(f"--prefill-points: batch and length must be >= 1, got {item!r}")
        points.append((batch, length))
    if not points:
        raise SystemExit("--prefill-points is empty; give e.g. 1x512,8x512,1x2048")
    return tuple(points)


def _models(preset: str):
    """``{"HF sdpa": model, "hf_dsinfer": model}`` of ``preset`` (trained weights for smollm2-real), fp32, eval."""
    from ..hf_compat import set_config_attn_implementation
    from ..integration.engine import init_inference
    from .decode import preset_config, preset_model

    config = preset_config(preset)
    set_config_attn_implementation(config, "sdpa")
    hf = preset_model(preset, config, torch.device("cpu"), torch.float32, seed=0)
    set_config_attn_implementation(hf.config, "sdpa")
    twin = preset_model(preset, config, torch.device("cpu"), torch.float32, seed=0)
    ours = init_inference(twin, dtype="fp32", replace_with_kernel_inject=True, keep_module_on_host=True,
                          max_out_tokens=config.max_position_embeddings).module  # fmt: skip
    return {"HF sdpa": hf, "hf_dsinfer": ours}, config


@torch.no_grad()
def _forward(model, ids: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """Wall seconds and process CPU seconds of one forward with every position's logits, and the last position's
    logits ``[B, V]``."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return seconds, cpu, out.logits[:, -1].float()


def run_prefill_bench(preset: str, points=DEFAULT_POINTS, rounds: int = 3, threads: int | None = None) -> dict:
    """Every point, ``rounds`` times, the two contenders alternating; returns the JSON-ready report."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        models, config = _models(preset)
        limit = getattr(config, "max_position_embeddings", None)
        too_long = [p for p in points if limit and p[1] > limit]
        if too_long:
            raise ValueError(f"{preset} takes at most {limit} positions; drop {too_long} from --prefill-points")
        runs, agreement = [], {}
        for batch, length in points:
            ids = torch.randint(3, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(length))
            last = {}
            for model in models.values():  # warm-up at this shape (allocator, oneDNN primitives)
                _forward(model, ids[:, : min(length, 64)])
            for r in range(rounds):
                for name, model in models.items():
                    load = os.getloadavg()[0]
                    try:
                        seconds, cpu, last[name] = _forward(model, ids)
                    except Exception as e:  # noqa: BLE001 - a failed contender is a row saying so
                        logger.debug("bench --prefill: %s failed", name, exc_info=True)
                        runs.append(dict(batch=batch, length=length, round=r + 1, name=name, load=round(load, 2),
                                         error=error_text(e)))  # fmt: skip
                        continue
                    runs.append(dict(batch=batch, length=length, round=r + 1, name=name, load=round(load, 2),
                                     seconds=round(seconds, 3), cpu_s=round(cpu, 3),
                                     tok_s=round(batch * length / seconds, 1), error=None))  # fmt: skip
            if len(last) == 2:
                ref = last["HF sdpa"]
                agreement[f"{batch}x{length}"] = float((last["hf_dsinfer"] - ref).abs().max() / ref.abs().max())
    finally:
        torch.set_num_threads(before)
    return dict(mode="prefill", preset=preset, rounds=rounds, threads=threads or before,
                points=[list(p) for p in points],
                device=f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
                versions={"torch": torch.__version__}, runs=runs, logits_rel_diff=agreement)  # fmt: skip


def prefill_table(report: dict) -> str:
    """Markdown: per point the median tokens/s of each contender, ours / sdpa (wall, and CPU seconds sdpa / ours),
    then every run with its load."""
    ok = [r for r in report["runs"] if r.get("error") is None]
    lines = [f"**{report['preset']}** forward-only (all logits), fp32, {report['threads']} thread(s), "
             f"{report['rounds']} rounds alternating; {report['device']}", "",
             "| batch x length | HF sdpa tok/s | hf_dsinfer tok/s | ours / sdpa | min-max ours / sdpa per round | "
             "CPU s sdpa / ours (median) | logits max diff (rel) |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for batch, length in report["points"]:
        rs = [r for r in ok if r["batch"] == batch and r["length"] == length]
        med = {n: statistics.median([r["tok_s"] for r in rs if r["name"] == n] or [float("nan")]) for n in CONTENDERS}
        per_round = [o["tok_s"] / h["tok_s"] for o in rs if o["name"] == "hf_dsinfer"
                     for h in rs if h["name"] == "HF sdpa" and h["round"] == o["round"]]  # fmt: skip
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}" if per_round else "n/a"
        cpu = {n: statistics.median([r["cpu_s"] for r in rs if r["name"] == n] or [float("nan")]) for n in CONTENDERS}
        cpu_ratio = cpu["HF sdpa"] / cpu["hf_dsinfer"]
        diff = report["logits_rel_diff"].get(f"{batch}x{length}")
        lines.append(f"| {batch}x{length} | {med['HF sdpa']:.0f} | {med['hf_dsinfer']:.0f} | "
                     f"{med['hf_dsinfer'] / med['HF sdpa']:.2f}x | {spread} | {cpu_ratio:.2f}x | "
                     f"{'n/a' if diff is None else f'{diff:.1e}'} |")  # fmt: skip
    lines += ["", "| batch x length | round | contender | load | seconds | CPU s | tok/s |",
              "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in report["runs"]:
        cells = (f"FAILED: {r['error']} |" if r.get("error")
                 else f"{r['seconds']:.2f} | {r['cpu_s']:.2f} | {r['tok_s']:.0f} |")  # fmt: skip
        lines.append(f"| {r['batch']}x{r['length']} | {r['round']} | {r['name']} | {r['load']:.2f} | {cells}")
    return "\n".join(lines) + "\n"


def prefill_main(ns) -> dict:
    """``bench --prefill``: run, print and write ``bench-prefill-<preset>.json`` / ``.md`` into ``--out``."""
    from .report import write_report

    report = run_prefill_bench(ns.preset, parse_points(ns.prefill_points), rounds=ns.repeats, threads=ns.threads)
    write_report(report, prefill_table(report), ns.out, f"bench-prefill-{ns.preset}")
    return report
