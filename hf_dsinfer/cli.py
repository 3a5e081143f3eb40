"""``hf-dsinfer`` (also ``python -m hf_dsinfer``): ``info``, ``generate``, ``serve`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata

from .cli_generate import add_generate_arguments, generate_main


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


def passive_wait_when_busy(command: str | None) -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` for a command that computes (``generate``, ``serve``, ``bench``) when the machine
    is oversubscribed at its start (1-minute load average above the cores) and neither the user nor an earlier import
    of torch settled it; returns whether it did.

    OpenMP reads the variable once, when torch loads it: set here, before torch is imported, waiting threads sleep
    instead of spinning. Under contention that doubled HF eager's decode rate at 2 threads and ours too (docs/
    troubleshooting.md has the runs); on a quiet machine spinning is cheaper, so it is only set when busy.
    """
    if command not in ("generate", "serve", "bench") or "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ:
        return False
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if load <= cores:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hf-dsinfer`` command."""
    argv = sys.argv[1:] if argv is None else argv
    passive_wait_when_busy(argv[0] if argv else None)
    parser = argparse.ArgumentParser(
        prog="hf-dsinfer", description="fused-kernel inference for HF models with DeepSpeed-Inference's API"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, device, kernel path, supported architectures")
    p_info.add_argument("--json", action="store_true", help="print the report as JSON")
    p_gen = sub.add_parser("generate", help="load a model with an inference config, chat with it, stream the reply")
    add_generate_arguments(p_gen)
    p_serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching on fused layers)")
    p_bench = sub.add_parser("bench", help="HF eager vs HF static+compile vs hf_dsinfer generate, random weights")
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
        generate_main(args)
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
