"""How much weight-only quantization costs on a real model: perplexity on real prose and greedy agreement.

``python -m hf_dsinfer.quant_quality`` loads SmolLM2-135M-Instruct (:mod:`hf_dsinfer.real_model`) in fp32 and then
quantized (``--quant int8,int4``, through ``from_pretrained(..., inference_config=...)`` like a user), and reports

* perplexity over the first ``--tokens`` tokens of a prose text every Debian/Ubuntu machine has
  (``/usr/share/common-licenses/GPL-3``; elsewhere the license text CPython ships), in non-overlapping windows of
  ``--window`` tokens, and its change against fp32;
* greedy agreement over a few chat prompts (the tokenizer's chat template): the fraction of generated tokens equal
  to fp32's, position by position up to the first difference, and how many continuations are identical.

The built-in calibration text of GPTQ (``hf_dsinfer/integration/quant_calibration.py``) is other license texts, never
the evaluation text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHAT_PROMPTS", "greedy_continuations", "perplexity", "prose_text", "quality_report"]

#: Evaluation text: Debian's base-files ships it on every Debian/Ubuntu machine.
PROSE_FILE = Path("/usr/share/common-licenses/GPL-3")
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colors.",
    "Explain what a compiler does in one sentence.",
)
QUANTS: dict[str, dict[str, Any] | None] = {
    "fp32": None,
    "int8": {"enabled": True, "weight": {"num_bits": 8}},
    "int4": {"enabled": True, "weight": {"num_bits": 4}},
    "int4-asym": {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric"}},
    "int4-gptq": {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric", "calibration": "gptq"}},
    # issue 27's exactness check: the Q4_1 checkpoint's own grid (groups of 32, exact min/max)
    "int4-g32-float-zero": {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric", "group_size": 32,
                                                        "zero_point": "float"}},  # fmt: skip
    # the tied embedding / LM head quantized too (one table): int8, int4 (GPTQ body, round-to-nearest head), an int8
    # head under an int4 body (lm_head_bits=8, as llama.cpp's Q4 files), and the llama.cpp bench's int4 format
    "int8-head": {"enabled": True, "weight": {"num_bits": 8, "lm_head": True}},
    "int4-gptq-head": {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric", "calibration": "gptq",
                                                   "lm_head": True}},  # fmt: skip
    "int4-gptq-head8": {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric", "calibration": "gptq",
                                                    "lm_head": True, "lm_head_bits": 8}},  # fmt: skip
    "int4-g32-float-zero-head8": {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric", "group_size": 32,
                                                              "zero_point": "float", "lm_head": True,
                                                              "lm_head_bits": 8}},  # fmt: skip
}


def prose_text() -> tuple[str, str]:
    """``(text, where it came from)``: the GPL-3 text of Debian's base-files, else the license CPython ships."""
    if PROSE_FILE.is_file():
        return PROSE_FILE.read_text(encoding="utf-8"), str(PROSE_FILE)
    fallback = Path(os.__file__).parent / "LICENSE.txt"
    if fallback.is_file():
        return fallback.read_text(encoding="utf-8"), str(fallback)
    raise FileNotFoundError(f"no prose text found: neither {PROSE_FILE} nor {fallback} exists")


@torch.no_grad()
def perplexity(model: torch.nn.Module, input_ids: torch.Tensor, window: int = 512) -> float:
    """exp(mean next-token NLL) of ``input_ids [1, T]`` in non-overlapping windows of ``window`` tokens (each window
    predicts its own tokens 2..n; windows do not see each other)."""
    nll, count = 0.0, 0
    for start in range(0, input_ids.shape[1], window):
        chunk = input_ids[:, start : start + window]  # [1, n]
        if chunk.shape[1] < 2:
            break
        logits = model(input_ids=chunk, use_cache=False).logits.float()  # [1, n, vocab]
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum")
        nll += loss.item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count)


@torch.no_grad()
def greedy_continuations(model: torch.nn.Module, tokenizer: Any, prompts, new_tokens: int) -> list[list[int]]:
    """Greedy continuation (token ids) of each chat prompt, run one prompt at a time (no padding)."""
    out = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        gen = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
        out.append(gen[0, ids["input_ids"].shape[1] :].tolist())
    return out


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[float, int]:
    """``(fraction of tokens equal to want's up to each row's first difference, rows identical)``."""
    same, total, identical = 0, 0, 0
    for g, w in zip(got, want):
        prefix = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        same += prefix
        total += len(w)
        identical += g == w
    return same / max(total, 1), identical


def quality_report(
    quants: tuple[str, ...] = ("fp32", "int8", "int4"),
    tokens: int = 2048,
    window: int = 512,
    prompts: tuple[str, ...] = CHAT_PROMPTS,
    new_tokens: int = 24,
    path: str | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Perplexity and greedy agreement of each of ``quants`` (keys of :data:`QUANTS`, fp32 always measured first).

    ``overrides``: a ``quant`` section per name, replacing :data:`QUANTS`'s (e.g. other groups or methods).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .real_model import smollm2_path

    path = path or smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    text, source = prose_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]  # [1, T]
    sections = {**QUANTS, **(overrides or {})}
    names = ["fp32"] + [q for q in quants if q != "fp32"]
    rows, reference = [], None
    for name in names:
        if name not in sections:
            raise ValueError(f"unknown quantization {name!r}; choose from {', '.join(sections)}")
        cfg: dict[str, Any] = {"dtype": "fp32"}
        if sections[name] is not None:
            cfg["quant"] = sections[name]
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
        load_s = time.perf_counter() - start
        ppl = perplexity(model, ids, window)
        cont = greedy_continuations(model, tokenizer, prompts, new_tokens)
        if reference is None:
            reference = (ppl, cont)
        frac, identical = agreement(cont, reference[1])
        rows.append(dict(name=name, quant=sections[name], perplexity=round(ppl, 3),
                         ppl_change_pct=round(100 * (ppl / reference[0] - 1), 2), greedy_agreement=round(frac, 3),
                         identical=identical, load_s=round(load_s, 1)))  # fmt: skip
        del model
    return dict(text=source, tokens=int(ids.shape[1]), window=window, prompts=len(prompts), new_tokens=new_tokens,
                rows=rows)  # fmt: skip


def markdown_table(report: dict[str, Any]) -> str:
    """The report as a markdown table."""
    lines = [
        f"Perplexity over the first {report['tokens']} tokens of {report['text']} (windows of {report['window']}); "
        f"greedy agreement over {report['prompts']} chat prompts x {report['new_tokens']} tokens.",
        "",
        "| weights | perplexity | vs fp32 | greedy agreement | identical continuations | load s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        agree = f"{100 * r['greedy_agreement']:.0f}% | {r['identical']}/{report['prompts']}"
        lines.append(f"| {r['name']} | {r['perplexity']:.3f} | {r['ppl_change_pct']:+.2f}% | {agree} | {r['load_s']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m hf_dsinfer.quant_quality``: print the table (and ``--json`` the raw report)."""
    p = argparse.ArgumentParser(prog="python -m hf_dsinfer.quant_quality", description=__doc__.splitlines()[0])
    p.add_argument("--quant", default="int8,int4", help="comma-separated names of QUANTS (fp32 always runs)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of prose scored")
    p.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    p.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per chat prompt")
    p.add_argument("--path", default=None, help="an HF model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    ns = p.parse_args(argv)
    report = quality_report(tuple(q.strip() for q in ns.quant.split(",") if q.strip()), ns.tokens, ns.window,
                            new_tokens=ns.new_tokens, path=ns.path)  # fmt: skip
    print(markdown_table(report), end="")
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
