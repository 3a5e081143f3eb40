"""``hf-dsinfer serve``: load a model with kernel injection and put :class:`~hf_dsinfer.serving.server.OpenAIServer`
in front of a :class:`~hf_dsinfer.serving.ServingEngine` on it (the command line's options and loading)."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from ..log import access_logger, logger
from .engine import ServingEngine
from .server import OpenAIServer
from .sizing import model_context_limit, parse_bytes, plan_kv_cache
from .speculation import SpeculativeConfig
from .tool_parsers import TOOL_PARSERS

__all__ = ["add_serve_arguments", "load_for_serving", "serve", "serve_main", "serving_inference_config"]

API_KEY_ENV = "HF_DSINFER_API_KEY"


def serving_inference_config(path: str, inference_config: Any = None, max_model_len: int | None = None) -> Any:
    """The InferenceConfig ``hf-dsinfer serve`` loads ``path`` with: ``inference_config`` (an InferenceConfig, a dict
    or a JSON path; None: the one saved with the checkpoint, else the defaults), with ``max_out_tokens`` (the context)
    set to ``max_model_len``, else to the config's own when it sets one, else to the model's limit
    (:func:`~.sizing.model_context_limit`). Raises ``ValueError`` naming the option on a conflict."""
    from transformers import AutoConfig

    from ..integration.config import InferenceConfig

    hf_config = AutoConfig.from_pretrained(path)
    saved = getattr(hf_config, "quantization_config", None)
    saved = saved.to_dict() if hasattr(saved, "to_dict") else saved
    from_user = inference_config is not None
    if from_user:
        cfg = InferenceConfig.from_any(inference_config)
    elif isinstance(saved, dict) and str(saved.get("quant_method")) == "dsinfer":
        cfg = InferenceConfig.from_any({k: v for k, v in saved.items() if k != "quant_method"})
    else:
        cfg = InferenceConfig()
    explicit = "max_out_tokens" in cfg.to_diff_dict()
    limit, source = model_context_limit(hf_config)
    if max_model_len is not None:
        if max_model_len < 1:
            raise ValueError(f"--max-model-len {max_model_len}: pass a positive number of tokens")
        if limit is not None and max_model_len > limit:
            raise ValueError(f"--max-model-len {max_model_len} is longer than the model's context, {limit} tokens "
                             f"({source}): lower it")  # fmt: skip
        if from_user and explicit and cfg.max_out_tokens != max_model_len:
            raise ValueError(f"--max-model-len {max_model_len} and the inference config's max_out_tokens "
                             f"{cfg.max_out_tokens} disagree: set the context in one place")  # fmt: skip
        cfg.max_out_tokens = max_model_len
    elif not explicit:
        if limit is None:
            limit = 2048
            logger.warning("hf_dsinfer serve: %s; using a context of %d tokens (set --max-model-len)", source, limit)
        cfg.max_out_tokens = limit
    return cfg


def load_for_serving(path: str, inference_config: Any = None, max_model_len: int | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``path`` with kernel injection and the context of :func:`serving_inference_config`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = serving_inference_config(path, inference_config, max_model_len)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
    return model, tokenizer


def build_server(
    path: str,
    inference_config: Any = None,
    *,
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float | None = None,
    block_size: int = 16,
    num_blocks: int | None = None,
    max_batch_tokens: int = 256,
    max_num_seqs: int = 64,
    prefix_sharing: bool = True,
    runner: str = "auto",
    pooler_config: dict | None = None,
    enable_lora: bool = False,
    lora_modules: dict[str, str] | None = None,
    max_loras: int | None = None,
    max_lora_rank: int = 16,
    speculative_config: Any = None,
    **server_kwargs: Any,
) -> OpenAIServer:
    """Load ``path`` and build the engine and server ``hf-dsinfer serve`` runs (not started); logs what it sized.
    ``server_kwargs`` go to :class:`OpenAIServer` (default_max_tokens, api_key, max_num_queued_reqs, ...).
    ``runner``: ``generate``, ``pooling`` (an embedding model: :func:`.embedding_routes.build_embedding_server`, with
    vLLM's ``pooler_config``) or ``auto`` (pooling for a sentence-transformers folder or a model without an LM head)."""
    from ..policies.injection import get_injection
    from .embeddings import detect_runner

    if runner not in ("auto", "generate", "pooling"):
        raise ValueError(f"--runner {runner!r}: pass generate, pooling or auto")
    speculative_config = SpeculativeConfig.parse(speculative_config)  # refused before loading the model
    if (detect_runner(path) if runner == "auto" else runner) == "pooling":
        from .embedding_routes import build_embedding_server

        return build_embedding_server(path, inference_config, served_model_name=served_model_name,
                                      max_model_len=max_model_len, pooler_config=pooler_config,
                                      **server_kwargs)  # fmt: skip

    model, tokenizer = load_for_serving(path, inference_config, max_model_len)
    record = get_injection(model)
    if record is None:
        raise ValueError(f"{path} loaded without fused layers (no kernel-injection policy applied): the serving "
                         "engine needs them; see the warning above for the reason")  # fmt: skip
    context = int(record.runtime.cache.max_tokens)
    plan = plan_kv_cache(model, block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=context,
                         max_batch_tokens=max_batch_tokens, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
                         gpu_memory_utilization=gpu_memory_utilization)  # fmt: skip
    if lora_modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    max_loras = max_loras or max(4, len(lora_modules or {}))
    engine = ServingEngine(model, block_size=block_size, num_blocks=plan.num_blocks, max_batch_tokens=max_batch_tokens,
                           max_num_seqs=max_num_seqs, prefix_sharing=prefix_sharing, enable_lora=enable_lora,
                           max_loras=max_loras, max_lora_rank=max_lora_rank,
                           speculative_config=speculative_config)  # fmt: skip
    for lora_name, lora_path in (lora_modules or {}).items():  # adapters served from the start (--lora-modules)
        engine.load_lora_adapter(lora_name, lora_path)
    name = served_model_name or os.path.basename(os.path.normpath(path)) or path
    aliases = tuple({path, os.path.abspath(path), os.path.normpath(path)} - {name})
    server = OpenAIServer(engine, tokenizer, name, model_aliases=aliases, **server_kwargs)
    logger.warning("hf_dsinfer serve: model '%s' (%s), context %d tokens, max_num_seqs %d; %s", name, path, context,
                   max_num_seqs, plan.describe(context))  # fmt: skip
    return server


def serve(path: str, inference_config: Any = None, host: str = "127.0.0.1", port: int = 8000, *,
          tensor_parallel_size: int = 1, threads: int | None = None, **kwargs: Any) -> None:  # fmt: skip
    """Load ``path``, build engine and server (:func:`build_server`'s ``kwargs``) and serve until SIGTERM / Ctrl-C,
    then drain for ``shutdown_timeout`` seconds and return.

    ``tensor_parallel_size`` N > 1: the model is split over N processes (:mod:`.tp_launch`): this one (rank 0) serves
    and starts the N - 1 workers itself, or, started by torchrun with ``WORLD_SIZE`` N, rank 0 serves and the other
    ranks run the workers' loop here; the workers stop with the server. ``threads``: each worker's CPU threads.
    """
    workers = None
    if tensor_parallel_size != 1:
        from .tp_launch import SERVE_TIMEOUT, TPWorkers, launched_rank, serve_worker

        inference_config = _tp_inference_config(path, inference_config, tensor_parallel_size, **kwargs)
        rank = launched_rank(tensor_parallel_size)
        if rank not in (None, 0):  # torchrun started this rank: a worker, no HTTP
            serve_worker(path, inference_config, threads)
            return
        from ..parallel.groups import init_distributed

        workers = TPWorkers.spawn(tensor_parallel_size, path, inference_config, threads) if rank is None else \
            TPWorkers([])  # fmt: skip
        workers.watch()
    server = None
    try:
        if workers is not None:
            init_distributed(timeout=SERVE_TIMEOUT)
        server = build_server(path, inference_config, **kwargs)
        if workers is not None:
            workers.engine = server.engine
        print(f"hf_dsinfer: serving '{server.model_name}' on http://{host}:{port}/v1 (Ctrl-C or SIGTERM stops)",
              file=sys.stderr, flush=True)  # fmt: skip
        server.run(host, port)
    finally:
        if workers is not None:
            workers.close(server.engine if server is not None else None)
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _tp_inference_config(path: str, inference_config: Any, size: int, **kwargs: Any) -> dict:
    """The inference config (a JSON-ready dict) every rank of a ``--tensor-parallel-size`` server loads ``path``
    with; refuses what the tensor-parallel engine does not serve, before anything starts."""
    from .embeddings import detect_runner

    if size < 1:
        raise ValueError(f"--tensor-parallel-size {size}: pass a positive number of processes")
    runner = kwargs.get("runner", "auto")
    if (detect_runner(path) if runner == "auto" else runner) == "pooling":
        raise ValueError("--tensor-parallel-size > 1 serves generating models only (--runner generate), not an "
                         "embedding model")  # fmt: skip
    cfg = serving_inference_config(path, inference_config, kwargs.get("max_model_len"))
    tp = cfg.tensor_parallel
    if tp.tp_size not in (1, size):
        raise ValueError(f"--tensor-parallel-size {size} and the inference config's tensor_parallel.tp_size "
                         f"{tp.tp_size} disagree: set it in one place")  # fmt: skip
    tp.tp_size, tp.enabled = size, True
    return {k: v for k, v in cfg.to_diff_dict().items() if k != "quant_method"}


def _list(text: str | None) -> list[str] | None:
    """A JSON list (vLLM's format) or comma-separated values."""
    if text is None:
        return None
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{text!r} is not a JSON list ({e}); pass e.g. '[\"https://a.example\"]' or a,b") from e
        return [str(v) for v in values]
    return [v.strip() for v in text.split(",") if v.strip()]


def _pooler_config(text: str | None) -> dict | None:
    """``--pooler-config``: a JSON object (vLLM's keys ``pooling_type``, ``use_activation``)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f'--pooler-config is not valid JSON ({e}); pass e.g. \'{{"pooling_type": "MEAN"}}\'') from e
    if not isinstance(value, dict):
        raise SystemExit('--pooler-config must be a JSON object, e.g. \'{"pooling_type": "MEAN"}\'')
    return value


def serve_main(args: Any) -> None:
    """``hf-dsinfer serve`` (``args`` from the CLI's parser)."""
    config = args.inference_config
    if config is not None and config.lstrip().startswith("{"):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            msg = f"--inference-config is not valid JSON ({e}); pass a JSON object or a JSON file path"
            raise SystemExit(msg) from e
    from ..generation.threads import apply_threads, warn_if_busy
    from ..real_model import resolve_model_name

    tp_size = getattr(args, "tensor_parallel_size", 1)
    threads = args.threads
    if tp_size > 1:  # the ranks share the machine's cores (CPU); --threads sets each rank's
        from .tp_launch import threads_per_rank

        threads = threads_per_rank(tp_size, args.threads)
    apply_threads(threads)  # before loading: torch's CPU threads, process-wide
    if not args.disable_log_requests:  # the access log, at info whatever transformers' verbosity
        access_logger.setLevel(logging.INFO)
    warn_if_busy(args.threads, how="--threads 1")
    path = resolve_model_name(args.model)  # "smollm2": the offline real model, served under the name given
    served_name = args.served_model_name or (args.model if path != args.model else None)
    try:
        kv_memory = parse_bytes(args.kv_cache_memory) if args.kv_cache_memory is not None else None
        serve(
            path, config, host=args.host, port=args.port, served_model_name=served_name,
            max_model_len=args.max_model_len, kv_cache_memory=kv_memory,
            gpu_memory_utilization=args.gpu_memory_utilization, default_max_tokens=args.default_max_tokens,
            block_size=args.block_size, num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens,
            max_num_seqs=args.max_num_seqs, prefix_sharing=args.prefix_sharing,
            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, allowed_origins=_list(args.allowed_origins),
            allowed_methods=_list(args.allowed_methods), allowed_headers=_list(args.allowed_headers),
            max_num_queued_reqs=args.max_num_queued_reqs, shutdown_timeout=args.shutdown_timeout,
            runner=getattr(args, "runner", "auto"), pooler_config=_pooler_config(getattr(args, "pooler_config", None)),
            enable_lora=args.enable_lora, lora_modules=_lora_modules(args.lora_modules), max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank, speculative_config=getattr(args, "speculative_config", None),
            tensor_parallel_size=tp_size, threads=threads,
            **({"tool_call_parser": args.tool_call_parser} if args.tool_call_parser else {}),
        )  # fmt: skip
    except ValueError as e:  # a setting that cannot work, named in the message
        raise SystemExit(f"hf-dsinfer serve: {e}") from e


def _lora_modules(items: list[str] | None) -> dict[str, str]:
    """``--lora-modules`` entries (``name=path`` or vLLM's JSON ``{"name": ..., "path": ...}``) as ``{name: path}``."""
    out: dict[str, str] = {}
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SystemExit(f"--lora-modules {item!r}: a JSON entry needs 'name' and 'path' ({e})") from e
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise SystemExit(f"--lora-modules {item!r}: pass name=path_to_peft_folder")
        if name in out:
            raise SystemExit(f"--lora-modules: the name {name!r} is given twice")
        out[name] = path
    return out


def add_serve_arguments(parser: Any) -> None:
    """The options of ``hf-dsinfer serve`` (vLLM's names where the option is the same)."""
    add = parser.add_argument
    add("model", help="model folder, hub id or 'smollm2' (a folder saved with an inference config reloads it)")
    add("--inference-config", help="the inference config: a JSON object or a JSON file path")
    add("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    add("--port", type=int, default=8000)
    add("--served-model-name", help="the model id clients send (default: the model folder's name; the path given "
        "is accepted too)")  # fmt: skip
    add("--max-model-len", type=int, help="context length: prompt plus new tokens of one request (default: the "
        "model's own, e.g. max_position_embeddings; sets the inference config's max_out_tokens)")  # fmt: skip
    add("--default-max-tokens", type=int, default=256, help="new tokens of chat completions without max_tokens")
    add("--threads", type=int, help="torch CPU threads for the process (default: torch's, one per core; with "
        "--tensor-parallel-size N on a CPU, the cores divided by N, for each rank)")  # fmt: skip
    add("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N", help="split the model over N processes "
        "(tensor parallelism; gloo on CPU, NCCL on GPU, one GPU a rank): the server starts the N - 1 workers itself, "
        "or under torchrun rank 0 serves and the others work (docs/tensor_parallel.md)")  # fmt: skip
    add("--tool-call-parser", choices=sorted(TOOL_PARSERS), help="how tool calls are read from the model's text "
        "(default: hermes when the chat template knows <tool_call>, else json)")  # fmt: skip
    add("--disable-log-requests", action="store_true", help="no access-log line per request (default: one line "
        "per request at info level: id, tokens, latency, finish reason)")  # fmt: skip
    add("--runner", choices=("auto", "generate", "pooling"), default="auto", help="generate (chat, completions) or "
        "pooling (an embedding model: /v1/embeddings); auto: pooling for a sentence-transformers folder or a model "
        "without an LM head (default)")  # fmt: skip
    add("--pooler-config", help="pooling runner, plain HF folders: a JSON object with pooling_type (CLS, MEAN, "
        "LAST) and use_activation (L2-normalize); default: CLS for BERT-family encoders, else LAST; "
        "normalized")  # fmt: skip
    kv = parser.add_argument_group("KV cache (the first given decides; see docs/serving.md, Deployment)")
    kv.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    kv.add_argument("--num-blocks", type=int, help="KV blocks, as many as this (default: from the options below; on "
                    "a CPU, --max-num-seqs x --max-model-len tokens, at most 1 GiB)")  # fmt: skip
    kv.add_argument("--kv-cache-memory", help="bytes for the KV cache, e.g. 2GiB or 2147483648")
    kv.add_argument("--gpu-memory-utilization", type=float, help="GPU only: the share of the device's memory this "
                    "server may use, weights included (default 0.9); the KV cache gets what is left")  # fmt: skip
    sched = parser.add_argument_group("scheduling")
    sched.add_argument("--max-batch-tokens", type=int, default=256, help="token budget of one engine step (default: "
                       "256; longer prompts are prefilled in chunks)")  # fmt: skip
    sched.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once (default: 64)")
    sched.add_argument("--max-num-queued-reqs", type=int, help="the most requests in flight, waiting plus running (n "
                       "choices count n); past it a request gets 429 with Retry-After (default: no limit)")  # fmt: skip
    sched.add_argument("--no-prefix-sharing", dest="prefix_sharing", action="store_false",
                       help="do not share the KV blocks of identical prompt prefixes")  # fmt: skip
    sched.add_argument("--speculative-config", metavar="JSON", help="speculative decoding (greedy and sampled "
                       'requests), vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
                       '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or a draft model \'{"model": PATH, '
                       '"num_speculative_tokens": 4}\' (default: off)')  # fmt: skip
    lora = parser.add_argument_group("LoRA adapters (docs/serving.md, Adapters)")
    lora.add_argument("--enable-lora", action="store_true", help="serve peft LoRA adapters: a request's model names "
                      "its adapter (or the base model)")  # fmt: skip
    lora.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", help="adapters to serve from the start: "
                      "name=peft_folder (or a JSON object with name and path)")  # fmt: skip
    lora.add_argument("--max-loras", type=int, help="adapters loaded at once (default: 4, or the number of "
                      "--lora-modules if more)")  # fmt: skip
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank (default: 16)")
    ops = parser.add_argument_group("operation")
    ops.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; "
                     "/health and /metrics stay open)")  # fmt: skip
    ops.add_argument("--allowed-origins", help="CORS: origins allowed from browsers, a JSON list or a,b (default: "
                     "none, same-origin only)")  # fmt: skip
    ops.add_argument("--allowed-methods", help="CORS: allowed methods (default: all, once origins are allowed)")
    ops.add_argument("--allowed-headers", help="CORS: allowed headers (default: all, once origins are allowed)")
    ops.add_argument("--shutdown-timeout", type=float, default=20.0, help="seconds running requests may take to "
                     "finish after SIGTERM / Ctrl-C before they are cancelled (default: 20)")  # fmt: skip
