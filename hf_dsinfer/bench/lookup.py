"""``hf-dsinfer bench --lookup``: prompt-lookup decoding on a copy-heavy request, on the real SmolLM2 model.

One chat request asks the model to repeat a paragraph word for word (what editing, correcting and summarizing
requests look like to a decoder: long runs copied from the prompt). Contenders, each timed ``repeats`` times in
turn, greedy and the same number of new tokens:

* ``hf-eager``: transformers' eager model, plain greedy;
* ``hf-eager-lookup``: the same with ``prompt_lookup_num_tokens`` (transformers' assisted loop);
* ``hf-compile``: transformers' static cache + ``torch.compile``, plain greedy;
* ``hf_dsinfer``: the fused model, plain greedy (the fast loop's compiled CPU decode step);
* ``hf_dsinfer-lookup``: the fused model with ``prompt_lookup_num_tokens`` (:mod:`hf_dsinfer.generation.speculative`).

Every contender must produce hf-eager's tokens (checked); the report gives new tokens/s (median, min-max) and the
ratios to hf-eager and hf-compile measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..log import logger

PARAGRAPH = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase funding for the public library, to repair the roads near the school, and to hire two new "
    "teachers. The chair thanked everyone for their work and closed the meeting at nine in the evening."
)
PEERS = ("hf-eager", "hf-eager-lookup", "hf-compile", "hf_dsinfer", "hf_dsinfer-lookup")


def _request(tokenizer: Any) -> torch.Tensor:
    messages = [{"role": "user", "content": "Repeat the following paragraph exactly, word for word:\n\n" + PARAGRAPH}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return enc["input_ids"]  # [1, P]


def run_lookup_bench(repeats: int = 3, new_tokens: int = 96, lookup: int = 10) -> dict[str, Any]:
    """Time every contender on the copy request; returns the report (rows, ratios, settings)."""
    import transformers
    from transformers import CompileConfig

    from ..hf_compat import compile_config_all_devices
    from ..real_model import smollm2_path

    path = smollm2_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = _request(tokenizer)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        path, inference_config={"dtype": "fp32", "max_out_tokens": ids.shape[1] + new_tokens + 8}
    ).eval()
    greedy = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    compile_kw = {"cache_implementation": "static", "compile_config": compile_config_all_devices(CompileConfig())}
    calls = {
        "hf-eager": lambda: hf.generate(ids, **greedy),
        "hf-eager-lookup": lambda: hf.generate(ids, prompt_lookup_num_tokens=lookup, **greedy),
        "hf-compile": lambda: hf.generate(ids, **greedy, **compile_kw),
        "hf_dsinfer": lambda: ours.generate(ids, **greedy),
        "hf_dsinfer-lookup": lambda: ours.generate(ids, prompt_lookup_num_tokens=lookup, **greedy),
    }
    outputs = {name: fn() for name, fn in calls.items()}  # warm-up: compiles, first-call costs
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for _ in range(repeats):  # interleaved: load changes hit every contender alike
            for name, fn in calls.items():
                t0 = time.perf_counter()
                outputs[name] = fn()
                times[name].append(time.perf_counter() - t0)
    want = outputs["hf-eager"]
    rows = []
    for name in calls:
        rates = [new_tokens / t for t in times[name]]
        rows.append({"peer": name, "tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
                     "same_tokens": bool(torch.equal(outputs[name], want))})  # fmt: skip
    base = {r["peer"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        r["vs_hf_eager"] = r["tokens_per_s"] / base["hf-eager"]
        r["vs_hf_compile"] = r["tokens_per_s"] / base["hf-compile"]
    copied = tokenizer.decode(want[0, ids.shape[1] :], skip_special_tokens=True)
    settings = {"model": "SmolLM2-135M-Instruct (fp32)", "prompt_tokens": int(ids.shape[1]), "new_tokens": new_tokens,
                "prompt_lookup_num_tokens": lookup, "repeats": repeats, "threads": torch.get_num_threads(),
                "transformers": transformers.__version__, "torch": torch.__version__}  # fmt: skip
    return {"settings": settings, "rows": rows, "output_starts": copied[:80]}


def lookup_table(report: dict[str, Any]) -> str:
    """The report as a markdown table."""
    s = report["settings"]
    lines = [
        f"Prompt lookup, copy request: {s['model']}, prompt {s['prompt_tokens']} tokens, {s['new_tokens']} new tokens, "
        f"k={s['prompt_lookup_num_tokens']}, {s['threads']} thread(s), {s['repeats']} repeats, transformers "
        f"{s['transformers']}, torch {s['torch']}",
        "",
        "| contender | new tokens/s, median (min-max) | vs HF eager | vs HF static+compile | tokens = HF eager's |",
        "|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        same = "yes" if r["same_tokens"] else "NO"
        lines.append(f"| {r['peer']} | {r['tokens_per_s']:.1f} ({r['min']:.1f}-{r['max']:.1f}) | "
                     f"{r['vs_hf_eager']:.2f}x | {r['vs_hf_compile']:.2f}x | {same} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def lookup_bench_main(repeats: int, new_tokens: int, out: str) -> dict[str, Any]:
    """Run, print and write ``<out>/bench-lookup.{json,md}``; exits non-zero when a contender's tokens differ."""
    from .report import write_report

    report = run_lookup_bench(repeats=repeats, new_tokens=new_tokens)
    write_report(report, lookup_table(report), out, "bench-lookup")
    wrong = [r["peer"] for r in report["rows"] if not r["same_tokens"]]
    if wrong:
        logger.error("bench --lookup: %s produced other tokens than HF eager", wrong)
        raise SystemExit(1)
    return report
