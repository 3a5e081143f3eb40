"""``hf-dsinfer`` (also ``python -m hf_dsinfer``): ``info``, ``generate``, ``serve`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib import metadata


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


#: Families without a policy, shown with the path they take (computed, not asserted: transformers may change them).
OTHER_EXAMPLES = ("smollm3", "helium", "mamba", "xglm")
#: The three paths a model can take (``hf-dsinfer info`` prints them; docs/models.md has the per-family table).
PATHS = {
    "fused": "hf_dsinfer's fused layers, static KV cache, fast generate loop (a kernel-injection policy)",
    "generic": "any other decoder-only causal LM whose attention calls transformers' AttentionInterface: HF's "
    "modules with hf_dsinfer's static-cache attention, fast loop and compiled CPU decode step (checked per model "
    "at load)",
    "hf": "everything else: HF's own modules and generate loop, config dtype applied, one warning",
}


def _path_label(model_type: str, policy_label: str) -> str:
    """``fused layers (XPolicy)``, ``generic (...)`` or ``HF modules (...)`` for ``model_type``."""
    from .policies.generic import inference_path

    path = inference_path(model_type)
    if path == "fused":
        return policy_label
    if path == "generic":
        return "generic: HF modules + static-cache attention, fast loop"
    return "HF modules, config dtype applied (one warning)"


def transformers_status() -> dict:
    """The installed transformers version and whether the test suite covers it."""
    from .hf_compat import NEWEST_TESTED, OLDEST_TESTED, in_tested_range, transformers_version

    return {
        "version": transformers_version(),
        "tested_range": [OLDEST_TESTED, NEWEST_TESTED],
        "in_tested_range": in_tested_range(),
    }


def info_report() -> dict:
    """Versions (and whether transformers is in the tested range), device, kernel path, and the path each
    architecture takes (fused / generic / HF modules), as a dict."""
    import torch

    from . import __version__
    from .integration.support import architecture_paths
    from .kernels import describe

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = f"cuda: {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
    else:
        device = "cpu (no CUDA device)"
    return {
        "hf_dsinfer": __version__,
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in ("torch", "transformers", "triton", "peft", "accelerate", "safetensors")},
        "device": device,
        "transformers": transformers_status(),
        "kernels": describe(),
        "architectures": {t: _path_label(t, label) for t, label in architecture_paths().items()},
        "other_examples": {t: _path_label(t, "") for t in OTHER_EXAMPLES},
        "paths": PATHS,
    }


def _print_info(report: dict) -> None:
    print(f"hf_dsinfer {report['hf_dsinfer']} (python {report['python']})")
    for name, version in report["versions"].items():
        print(f"  {name:<13} {version}")
    tf = report["transformers"]
    oldest, newest = tf["tested_range"]
    if tf["in_tested_range"]:
        print(f"transformers {tf['version']}: inside the tested range ({oldest} to {newest})")
    else:
        print(
            f"transformers {tf['version']}: OUTSIDE the tested range ({oldest} to {newest}); it may work, but nothing "
            f"here was tested on it: pip install 'transformers>={oldest},<={newest}' for a tested one"
        )
    print(f"device: {report['device']}")
    k = report["kernels"]
    print(
        f"kernels: backend={k['backend']} path={k['kernel_path']} triton_installed={k['triton_installed']} "
        f"interpreter={k['interpreter']}"
    )
    print("paths (replace_with_kernel_inject='auto', the default):")
    for name, meaning in report["paths"].items():
        print(f"  {name:<8} {meaning}")
    print("architectures with a policy or in the fidelity table:")
    for model_type, path in report["architectures"].items():
        print(f"  {model_type:<12} {path}")
    print("other causal LMs: generic when their attention calls AttentionInterface, else HF modules; e.g.")
    for model_type, path in report["other_examples"].items():
        print(f"  {model_type:<12} {path}")


def _parse_set(pairs: list[str]) -> dict:
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
    ``warmup_s``: the wall time of the warm-up call made before it (which compiles the CPU decode step or captures
    CUDA graphs on a model's first call), None when none was made: the figures then include that one-off cost.
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
    }


def _print_generation(report: dict) -> None:
    for text in report["texts"]:
        print(text)
    ttft, decode = report["time_to_first_token_ms"], report["decode_tokens_per_s"]
    if report["warmup_ms"] is not None:
        warmup = f"warm-up call {report['warmup_ms']:.0f} ms (compiles / captures the decode step; not counted below)"
    else:
        warmup = "no warm-up call (--no-warmup): the figures include the first call's compile / capture"
    print(f"-- {warmup}")
    print(
        f"-- prompt tokens: {report['prompt_tokens']}, new tokens: {report['new_tokens']} "
        f"(batch {report['batch_size']}), time to first token: {'n/a' if ttft is None else f'{ttft:.1f} ms'}, "
        f"decode {'n/a' if decode is None else decode} tokens/s, overall {report['tokens_per_s']} tokens/s "
        f"(total {report['total_ms']:.0f} ms, path {report['path']})"
    )


def _generate(args: argparse.Namespace) -> None:
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .generation.stats import last_generate_stats
    from .integration.config import InferenceConfig

    overrides = _parse_set(args.set)
    if args.dtype:
        overrides["dtype"] = args.dtype
    cfg = InferenceConfig.from_any(args.config, **overrides)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, inference_config=cfg)
    enc = tok(args.prompt, return_tensors="pt", padding=True).to(model.device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0, pad_token_id=tok.pad_token_id)
    if args.temperature > 0:
        gen.update(temperature=args.temperature, top_p=args.top_p)
    warmup_s = None
    if args.warmup:  # the first call compiles the CPU decode step (or captures CUDA graphs): timed apart
        start = time.perf_counter()
        model.generate(**enc, **{**gen, "max_new_tokens": min(2, args.max_new_tokens)})
        warmup_s = time.perf_counter() - start
    before = last_generate_stats(model)
    start = time.perf_counter()
    out = model.generate(**enc, **gen)
    wall_s = time.perf_counter() - start
    stats = last_generate_stats(model)
    new = out[:, enc["input_ids"].shape[1] :]
    texts = [f"{prompt}{tok.decode(row, skip_special_tokens=True)}" for prompt, row in zip(args.prompt, new)]
    report = generation_report(
        texts, int(enc["attention_mask"].sum()), stats if stats is not before else None, wall_s, new.shape[1], warmup_s
    )
    print(json.dumps(report, indent=2)) if args.json else _print_generation(report)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hf-dsinfer`` command."""
    parser = argparse.ArgumentParser(
        prog="hf-dsinfer", description="fused-kernel inference for HF models with DeepSpeed-Inference's API"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, device, kernel path, supported architectures")
    p_info.add_argument("--json", action="store_true", help="print the report as JSON")
    p_gen = sub.add_parser("generate", help="load a model with an inference config and generate text")
    p_gen.add_argument("model", help="model directory or hub id")
    p_gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p_gen.add_argument("--max-new-tokens", type=int, default=32)
    p_gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p_gen.add_argument("--top-p", type=float, default=1.0)
    p_gen.add_argument("--dtype", help="fp16, bf16 or fp32 (the config's dtype)")
    p_gen.add_argument("--config", help="an inference config JSON file")
    p_gen.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an inference config field")
    p_gen.add_argument("--json", action="store_true", help="print texts and timings as one JSON object")
    p_gen.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first make a short warm-up call (2 new tokens) and report its time apart, so that the decode "
        "tokens/s do not include compiling the CPU decode step / capturing CUDA graphs (default: on)",
    )
    p_serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching on fused layers)")
    p_bench = sub.add_parser("bench", help="HF eager vs HF static+compile vs hf_dsinfer generate, random weights")
    argv = sys.argv[1:] if argv is None else argv
    if "bench" in argv:  # bench's options need torch (bench.py): `hf-dsinfer --help` stays free of it
        from .bench.cli import add_bench_arguments

        add_bench_arguments(p_bench)
    if "serve" in argv:  # like bench: the server module is imported only when serving
        from .serving.serve_cli import add_serve_arguments

        add_serve_arguments(p_serve)
    args = parser.parse_args(argv)
    if args.command == "info":
        report = info_report()
        print(json.dumps(report, indent=2)) if args.json else _print_info(report)
    elif args.command == "generate":
        _generate(args)
    elif args.command == "serve":
        from .serving.serve_cli import serve_main

        serve_main(args)
    elif args.command == "bench":
        from .bench.cli import bench_main
        from .bench.report import exit_code

        return exit_code(bench_main(args))  # 1 when an hf_dsinfer contender failed
    return 0


if __name__ == "__main__":
    sys.exit(main())
