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


def info_report() -> dict:
    """Versions, device, kernel path and supported architectures, as a dict."""
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
        "kernels": describe(),
        "architectures": architecture_paths(),
    }


def _print_info(report: dict) -> None:
    print(f"hf_dsinfer {report['hf_dsinfer']} (python {report['python']})")
    for name, version in report["versions"].items():
        print(f"  {name:<13} {version}")
    print(f"device: {report['device']}")
    k = report["kernels"]
    print(
        f"kernels: backend={k['backend']} path={k['kernel_path']} triton_installed={k['triton_installed']} "
        f"interpreter={k['interpreter']}"
    )
    print("architectures (replace_with_kernel_inject=True):")
    for model_type, path in report["architectures"].items():
        print(f"  {model_type:<10} {path}")
    print("any other architecture: HF modules with one warning")


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
    texts: list[str], prompt_tokens: int, stats: object | None, wall_s: float, new_tokens: int
) -> dict:
    """What ``hf-dsinfer generate`` prints: the texts and the call's speed (``new_tokens``: per prompt).

    ``stats`` is the ``GenerateStats`` hf_dsinfer's generate recorded (time to first token measured inside the loop);
    without it (a generate path that records none) only the wall-clock rate is known and TTFT is None.
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
    }


def _print_generation(report: dict) -> None:
    for text in report["texts"]:
        print(text)
    ttft = report["time_to_first_token_ms"]
    print(
        f"-- prompt tokens: {report['prompt_tokens']}, new tokens: {report['new_tokens']} "
        f"(batch {report['batch_size']}), time to first token: "
        f"{'n/a' if ttft is None else f'{ttft:.1f} ms'}, {report['tokens_per_s']} tokens/s "
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
    before = last_generate_stats(model)
    start = time.perf_counter()
    out = model.generate(**enc, **gen)
    wall_s = time.perf_counter() - start
    stats = last_generate_stats(model)
    new = out[:, enc["input_ids"].shape[1] :]
    texts = [f"{prompt}{tok.decode(row, skip_special_tokens=True)}" for prompt, row in zip(args.prompt, new)]
    report = generation_report(
        texts, int(enc["attention_mask"].sum()), stats if stats is not before else None, wall_s, new.shape[1]
    )
    print(json.dumps(report, indent=2)) if args.json else _print_generation(report)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hf-dsinfer`` command."""
    parser = argparse.ArgumentParser(prog="hf-dsinfer", description="DeepSpeed-Inference-class speed for HF models")
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
    p_serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching on fused layers)")
    p_bench = sub.add_parser("bench", help="HF eager vs HF static+compile vs hf_dsinfer generate, random weights")
    argv = sys.argv[1:] if argv is None else argv
    if "bench" in argv:  # bench's options need torch (bench.py): `hf-dsinfer --help` stays free of it
        from .bench import add_bench_arguments

        add_bench_arguments(p_bench)
    if "serve" in argv:  # like bench: the server module is imported only when serving
        from .serving.server import add_serve_arguments

        add_serve_arguments(p_serve)
    args = parser.parse_args(argv)
    if args.command == "info":
        report = info_report()
        print(json.dumps(report, indent=2)) if args.json else _print_info(report)
    elif args.command == "generate":
        _generate(args)
    elif args.command == "serve":
        from .serving.server import serve_main

        serve_main(args)
    elif args.command == "bench":
        from .bench import bench_main, exit_code

        return exit_code(bench_main(args))  # 1 when an hf_dsinfer contender failed
    return 0


if __name__ == "__main__":
    sys.exit(main())
