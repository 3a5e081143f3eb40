"""N-gram speculation in the serving engine against plain decoding, on copy-heavy and on ordinary chat requests
(issue 33, point 4), with the real SmolLM2.

``python -m hf_dsinfer.bench.speculation [--model smollm2] [--rounds 3] [--new-tokens 64] [--json out.json]``
(also ``hf-dsinfer bench --speculation``).

Contenders, on the same model: ``plain`` (a :class:`~hf_dsinfer.serving.ServingEngine` without speculation) and
``ngram`` (``{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 2}``).
Workloads: ``copy`` (chat requests asking to repeat or lightly edit a passage given in the prompt), ``chat``
(ordinary questions, where proposals rarely match) and ``copy-sampled`` (the copy requests sampled at temperature
0.7 with a seed each: rejection sampling). Each request runs alone (one request's latency, as a single user sees it),
the contenders alternate request by request within each round, and every round is reported; the ratio is
plain seconds / ngram seconds per workload and round. The report also checks that both give the same tokens (greedy:
plain decoding's; seeded sampled: the same draw).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from .report import loadavg_text

PASSAGES = [
    "The quick brown fox jumps over the lazy dog near the river bank, while the old farmer watches from his porch "
    "and counts the clouds drifting over the hills.",
    "def area(radius):\n    return 3.14159 * radius * radius\n\n\ndef volume(radius, height):\n    return "
    "area(radius) * height\n",
    "Our office will be closed on Monday for the public holiday. Orders placed over the weekend will ship on Tuesday, "
    "and support will answer emails from Tuesday morning.",
]
COPY = ["Repeat this text exactly: {}", "Rewrite this text, changing nothing but the first word: {}"]
CHAT = ["What is the capital of France, and why is it famous?", "Give me three tips for sleeping better.",
        "Explain what a neural network is to a child.", "Write a short poem about autumn."]  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


def workloads(tok: Any) -> dict[str, list[list[int]]]:
    """Prompt ids per workload (the chat template with the generation prompt where the tokenizer has one)."""

    def ids(text: str) -> list[int]:
        if getattr(tok, "chat_template", None) is None:  # a base model's tokenizer (tests' tiny models)
            return tok(text)["input_ids"]
        chat = [{"role": "user", "content": text}]
        return tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]

    copy = [ids(q.format(p)) for p in PASSAGES for q in COPY]
    return {"copy": copy, "chat": [ids(q) for q in CHAT], "copy-sampled": copy}


def run(model: Any, tok: Any, rounds: int, new_tokens: int) -> dict:
    """Every round of both contenders on every workload; the report."""
    from transformers import GenerationConfig

    from hf_dsinfer.serving import ServingEngine

    greedy = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=tok.eos_token_id)
    sampled = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, temperature=0.7, top_p=1.0, top_k=0,
                               eos_token_id=tok.eos_token_id)  # fmt: skip
    engines = {"plain": ServingEngine(model), "ngram": ServingEngine(model, speculative_config=NGRAM)}
    work = workloads(tok)
    for engine in engines.values():  # warm-up (first-call costs), not timed
        engine.submit(work["copy"][0], greedy, max_new_tokens=4)
        engine.run_until_idle()
    rows, same = [], {}
    for r in range(rounds):
        for name, prompts in work.items():
            config = sampled if name.endswith("sampled") else greedy
            secs = {c: 0.0 for c in engines}
            tokens = {c: 0 for c in engines}
            before = {c: e.stats for c, e in engines.items()}
            for i, prompt in enumerate(prompts):
                order = list(engines) if (i + r) % 2 == 0 else list(engines)[::-1]  # alternate who goes first
                outs = {}
                for c in order:
                    t0 = time.perf_counter()
                    h = engines[c].submit(prompt, config, seed=i)
                    engines[c].run_until_idle()
                    secs[c] += time.perf_counter() - t0
                    tokens[c] += len(h.tokens)
                    outs[c] = h.tokens
                same.setdefault(name, []).append(outs["plain"] == outs["ngram"])
            after = engines["ngram"].stats
            drafted = after.spec_decode_num_draft_tokens - before["ngram"].spec_decode_num_draft_tokens
            accepted = after.spec_decode_num_accepted_tokens - before["ngram"].spec_decode_num_accepted_tokens
            rows.append({
                "round": r, "workload": name, "requests": len(prompts),
                **{f"{c}_s": round(secs[c], 3) for c in engines}, **{f"{c}_tokens": tokens[c] for c in engines},
                "speedup": round(secs["plain"] / secs["ngram"], 3),
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "steps_saved": (after.generated_tokens - before["ngram"].generated_tokens)
                - (after.steps - before["ngram"].steps),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return {
        "settings": {"rounds": rounds, "new_tokens": new_tokens, "threads": torch.get_num_threads(), "ngram": NGRAM},
        "rows": rows,
        "same_tokens": {k: all(v) for k, v in same.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    """Command line: load the model (fused, fp32 by default), run, print and optionally write the report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model folder, or 'smollm2' (the offline real model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dsinfer.real_model import resolve_model_name

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_name(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, inference_config={"dtype": args.dtype}).eval()
    t0, load = time.perf_counter(), loadavg_text()
    report = run(model, tok, args.rounds, args.new_tokens)
    report["settings"].update(model=path, wall_s=round(time.perf_counter() - t0, 1), loadavg_start=load,
                              loadavg_end=loadavg_text())  # fmt: skip
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
