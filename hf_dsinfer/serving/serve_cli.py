"""``hf-dsinfer serve``: load a model with kernel injection and put :class:`~hf_dsinfer.serving.server.OpenAIServer`
in front of a :class:`~hf_dsinfer.serving.ServingEngine` on it (the command line's options and loading)."""

from __future__ import annotations

import json
import sys
from typing import Any

from .engine import ServingEngine
from .server import OpenAIServer

__all__ = ["add_serve_arguments", "load_for_serving", "serve", "serve_main"]


def load_for_serving(path: str, inference_config: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``path`` with kernel injection: a checkpoint saved with an inference config reloads
    with it; otherwise ``inference_config`` (an InferenceConfig, a dict or a JSON path; None: the defaults)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..integration.config import InferenceConfig

    saved = getattr(AutoConfig.from_pretrained(path), "quantization_config", None)
    saved_method = saved.get("quant_method") if isinstance(saved, dict) else getattr(saved, "quant_method", None)
    kwargs = {}
    if inference_config is not None or str(saved_method) != "dsinfer":
        kwargs["inference_config"] = InferenceConfig.from_any(inference_config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model, tokenizer


def serve(
    path: str,
    inference_config: Any = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    default_max_tokens: int = 256,
    **engine_kwargs: Any,
) -> None:
    """Load ``path``, build a :class:`ServingEngine` (``engine_kwargs``: block_size, num_blocks, max_batch_tokens,
    max_num_seqs, prefix_sharing) and serve it until interrupted. The model id is ``served_model_name`` or ``path``."""
    model, tokenizer = load_for_serving(path, inference_config)
    engine = ServingEngine(model, **engine_kwargs)
    name = served_model_name or path
    server = OpenAIServer(engine, tokenizer, name, default_max_tokens=default_max_tokens)
    print(f"hf_dsinfer: serving '{name}' on http://{host}:{port}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
    server.run(host, port)


def serve_main(args: Any) -> None:
    """``hf-dsinfer serve`` (``args`` from the CLI's parser)."""
    config = args.inference_config
    if config is not None and config.lstrip().startswith("{"):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            msg = f"--inference-config is not valid JSON ({e}); pass a JSON object or a JSON file path"
            raise SystemExit(msg) from e
    serve(
        args.model, config, host=args.host, port=args.port, served_model_name=args.served_model_name,
        default_max_tokens=args.default_max_tokens, block_size=args.block_size, num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs, prefix_sharing=args.prefix_sharing,
    )  # fmt: skip


def add_serve_arguments(parser: Any) -> None:
    """The options of ``hf-dsinfer serve``."""
    parser.add_argument("model", help="model folder or hub id (a folder saved with an inference config reloads it)")
    parser.add_argument("--inference-config", help="the inference config: a JSON object or a JSON file path")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the model id clients send (default: the model argument)")
    parser.add_argument("--default-max-tokens", type=int, default=256, help="chat completions without max_tokens")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--num-blocks", type=int, help="KV blocks (default: max_out_tokens x max_batch_size tokens)")
    parser.add_argument("--max-batch-tokens", type=int, default=256, help="token budget of one engine step")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    parser.add_argument("--no-prefix-sharing", dest="prefix_sharing", action="store_false",
                        help="do not share the KV blocks of identical prompt prefixes")  # fmt: skip
