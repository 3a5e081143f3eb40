"""``hf-dsinfer generate``: load a model with an inference config, chat with it (or continue raw text), stream the
reply and report the call's speed.

A tokenizer with a chat template gets its prompts formatted as chat turns (``--system`` adds a system turn;
``--no-chat`` sends the raw text). A single prompt's reply is streamed as it is generated (transformers'
``TextStreamer``). The model argument may be a folder, a hub id or a name of :mod:`hf_dsinfer.real_model`
(``smollm2``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``hf-dsinfer generate``."""
    p.add_argument("model", help="model folder, hub id, or 'smollm2' (the offline SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="format each prompt with the tokenizer's chat template when it has one (default: on; "
                   "--no-chat sends the raw text)")  # fmt: skip
    p.add_argument("--system", help="a system message before each prompt (needs a chat template)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", help="fp16, bf16 or fp32 (the config's dtype)")
    p.add_argument("--threads", type=int, help="torch CPU threads (the config's threads; default: torch's)")
    p.add_argument("--config", help="an inference config JSON file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an inference config field")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print a single prompt's reply as it is generated (default: on; not with --json)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print texts and timings as one JSON object")
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first make a short warm-up call (2 new tokens) and report its time apart; it starts the CPU decode "
        "step's compile (in the background) or captures CUDA graphs (default: on)",
    )
    p.add_argument("--wait-compile", action="store_true",
                   help="compile the CPU decode step in the warm-up call and wait for it, so that every decode step "
                   "of the timed call runs compiled (default: cpu_compile='auto', which compiles in the background "
                   "only once eager steps have run long enough to pay for it)")  # fmt: skip


def parse_set(pairs: list[str]) -> dict:
    """``--set key=value`` pairs as a dict (values parsed as JSON where they are JSON, else kept as strings)."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        key, raw = pair.split("=", 1)
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def setup_threads(threads: int | None) -> None:
    """``--threads``: set torch's CPU threads now (loading runs on them too), then warn once if the machine is busy."""
    from .generation.threads import apply_threads, warn_if_busy

    if threads is not None and threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {threads}")
    apply_threads(threads)
    warn_if_busy(threads, how="--threads 1")


def chat_prompts(tokenizer: Any, prompts: list[str], chat: bool, system: str | None) -> tuple[list[str], bool]:
    """``(texts to tokenize, whether they are chat-formatted)``: each prompt as a user turn (after ``system``) through
    the tokenizer's chat template, with the assistant's turn opened; the raw prompts when ``chat`` is off or the
    tokenizer has no template. ``system`` without a template to put it in is refused (it would be ignored)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if system is not None and not (chat and has_template):
        why = "--no-chat was given" if not chat else "this tokenizer has no chat template"
        raise SystemExit(f"--system needs a chat template, but {why}; put the instructions in --prompt instead.")
    if not (chat and has_template):
        return list(prompts), False
    head = [{"role": "system", "content": system}] if system is not None else []
    turns = [[*head, {"role": "user", "content": p}] for p in prompts]
    texts = [tokenizer.apply_chat_template(t, tokenize=False, add_generation_prompt=True) for t in turns]
    return texts, True


def generation_report(
    texts: list[str],
    prompt_tokens: int,
    stats: object | None,
    wall_s: float,
    new_tokens: int,
    warmup_s: float | None = None,
) -> dict:
    """What ``hf-dsinfer generate`` prints: the texts and the call's speed (``new_tokens``: per prompt).

    ``stats`` is the ``GenerateStats`` hf_dsinfer's generate recorded (time to first token measured inside the loop);
    without it (a generate path that records none) only the wall-clock rate is known and TTFT is None.
    ``warmup_s``: the wall time of the warm-up call made before it (which starts compiling the CPU decode step or
    captures CUDA graphs on a model's first call), None when none was made.
    """
    batch = len(texts)
    if stats is not None:
        speed = {
            "time_to_first_token_ms": round(stats.ttft_ms, 2),
            "tokens_per_s": round(stats.tokens_per_s, 2),
            "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
            "path": stats.path,
        }
    else:
        speed = {
            "time_to_first_token_ms": None,
            "tokens_per_s": round(batch * new_tokens / wall_s, 2) if wall_s > 0 else None,
            "decode_tokens_per_s": None,
            "path": "unknown",
        }
    return {
        "texts": texts,
        "batch_size": batch,
        "prompt_tokens": prompt_tokens,
        "new_tokens": batch * new_tokens,
        **speed,
        "total_ms": round(wall_s * 1e3, 2),
        "warmup_ms": None if warmup_s is None else round(warmup_s * 1e3, 2),
        "includes_warmup": warmup_s is None,
        "compiled_steps": None,  # decode steps that ran the compiled CPU step (None: no compiled step on this path)
        "eager_steps_while_compiling": 0,
        "notes": [],
    }


def print_generation(report: dict, texts_printed: bool = False) -> None:
    """The text form of a report: the texts (unless streamed already), then ``--`` lines with the figures."""
    if not texts_printed:
        for text in report["texts"]:
            print(text)
    ttft, decode = report["time_to_first_token_ms"], report["decode_tokens_per_s"]
    if report["warmup_ms"] is not None:
        ms = report["warmup_ms"]
        warmup = f"warm-up call {ms:.0f} ms (one-off costs: CUDA graphs, a --wait-compile compile; not counted below)"
    else:
        warmup = "no warm-up call (--no-warmup): the figures include the first call's compile / capture"
    print(f"-- {warmup}")
    compiling, eager, done = "", report.get("eager_steps_while_compiling", 0), report.get("compiled_steps")
    if done == 0 and not eager:
        compiling = ", eager decode steps: --wait-compile compiles them"
    elif done is not None:
        compiling = f", {done} decode steps compiled" + (f", {eager} eager while compiling" if eager else "")
    print(
        f"-- prompt tokens: {report['prompt_tokens']}, new tokens: {report['new_tokens']} "
        f"(batch {report['batch_size']}), time to first token: {'n/a' if ttft is None else f'{ttft:.1f} ms'}, "
        f"decode {'n/a' if decode is None else decode} tokens/s, overall {report['tokens_per_s']} tokens/s "
        f"(total {report['total_ms']:.0f} ms, path {report['path']}{compiling})"
    )
    for note in report.get("notes", []):
        print(f"-- note: {note}")


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


def empty_reply_note(first_tokens: list[int], eos: set[int], chat: bool, has_template: bool) -> str | None:
    """The advice when a row's first new token is end-of-sequence (the model answered nothing), else None."""
    rows = [i for i, t in enumerate(first_tokens) if t in eos]
    if not rows:
        return None
    which = "" if len(first_tokens) == 1 else f" (prompt {', '.join(str(i + 1) for i in rows)})"
    if has_template and not chat:
        advice = "this model has a chat template: drop --no-chat so that the prompt is sent as a chat turn"
    elif chat:
        advice = "rephrase the prompt, set the assistant's role with --system, or sample (--temperature 0.7)"
    else:
        advice = (
            "its tokenizer has no chat template, so the prompt went in as raw text: give it text to continue "
            "(e.g. 'The capital of France is'), or sample (--temperature 0.7)"
        )
    return f"the model ended its reply immediately (EOS as the first token){which}; {advice}."


def _compiled_step(model: Any) -> Any:
    from .generation.api import GEN_ATTR

    step = getattr(getattr(model, GEN_ATTR, None), "step", None)
    return getattr(step, "compiled", None)


def generate_main(args: argparse.Namespace) -> None:
    """``hf-dsinfer generate`` (``args`` from :func:`add_generate_arguments`'s parser)."""
    setup_threads(args.threads)
    if args.wait_compile and os.environ.get("HF_DSINFER_CPU_COMPILE", "1").strip().lower() not in ("0", "false"):
        os.environ["HF_DSINFER_CPU_COMPILE"] = "sync"  # the first decode step compiles and waits (the notice says so)
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    from .generation.stats import last_generate_stats
    from .integration.config import InferenceConfig
    from .real_model import resolve_model_name

    overrides = parse_set(args.set)
    if args.dtype:
        overrides["dtype"] = args.dtype
    if args.threads is not None:
        overrides["threads"] = args.threads
    cfg = InferenceConfig.from_any(args.config, **overrides)
    path = resolve_model_name(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts_in, chat = chat_prompts(tok, args.prompt, args.chat, args.system)
    model = AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
    # a chat template writes its own special tokens (BOS, turn markers): the tokenizer must not add them again
    enc = tok(texts_in, return_tensors="pt", padding=True, add_special_tokens=not chat).to(model.device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0, pad_token_id=tok.pad_token_id)
    if args.temperature > 0:
        gen.update(temperature=args.temperature, top_p=args.top_p)
    warmup_s = None
    if args.warmup:  # the first call starts the CPU decode step's compile (or captures CUDA graphs): timed apart
        start = time.perf_counter()
        model.generate(**enc, **{**gen, "max_new_tokens": min(2, args.max_new_tokens)})
        warmup_s = time.perf_counter() - start
    compiled = _compiled_step(model)
    eager_before = compiled.eager_while_compiling if compiled is not None else 0
    replays_before = compiled.runner.stats.replays if compiled is not None and compiled.runner is not None else 0
    stream = args.stream and not args.json and len(texts_in) == 1
    streamer = None
    if stream:
        print("" if chat else args.prompt[0], end="", flush=True)  # raw text: the reply continues the prompt
        streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    before = last_generate_stats(model)
    start = time.perf_counter()
    out = model.generate(**enc, **gen, streamer=streamer)
    wall_s = time.perf_counter() - start
    stats = last_generate_stats(model)
    new = out[:, enc["input_ids"].shape[1] :]
    replies = [tok.decode(row, skip_special_tokens=True) for row in new]
    texts = replies if chat else [f"{p}{r}" for p, r in zip(args.prompt, replies)]
    report = generation_report(
        texts, int(enc["attention_mask"].sum()), stats if stats is not before else None, wall_s, new.shape[1], warmup_s
    )
    report["chat"] = chat
    if compiled is not None:
        report["eager_steps_while_compiling"] = compiled.eager_while_compiling - eager_before
        if compiled.runner is not None:  # None: the step never ran (cpu_compile off by environment, GPU, ...)
            report["compiled_steps"] = compiled.runner.stats.replays - replays_before
    has_template = bool(getattr(tok, "chat_template", None))
    note = empty_reply_note(new[:, 0].tolist() if new.shape[1] else [], _eos_ids(model, tok), chat, has_template)
    if note is not None:
        report["notes"].append(note)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_generation(report, texts_printed=stream)
    sys.stdout.flush()
