"""``POST /v1/embeddings`` of ``hf-dsinfer serve --runner pooling``: OpenAI's embeddings request with vLLM's extra
fields, on an :class:`~hf_dsinfer.serving.embeddings.Embedder`.

Requests arriving together are embedded together: one worker thread takes every request waiting in its queue (after
a wait of ``batch_wait_s`` for more to come) and runs their inputs as one length-sorted batch, so the event loop never
runs the model and concurrent clients share forwards. An input longer than the model's ``max_model_len`` is refused
(400) unless the request sets ``truncate_prompt_tokens``, as vLLM does.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations (``request: Request``) at runtime.
import asyncio
import base64
import queue
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

import torch

from ..log import logger
from .embeddings import Embedder
from .http_common import RequestError, json_body, model_not_found, param, unknown_field
from .tokenize_routes import chat_prompt_ids

__all__ = ["EmbeddingService", "build_embedding_server"]

# Fields of the request: OpenAI's, then vLLM's extras. Anything else is refused by name.
_FIELDS = {
    "input", "model", "encoding_format", "dimensions", "user",
    "messages", "truncate_prompt_tokens", "truncation_side", "add_special_tokens", "use_activation", "embed_dtype",
    "endianness", "request_id", "priority", "padding", "cache_salt", "mm_processor_kwargs", "media_io_kwargs",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
}  # fmt: skip
_EMBED_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class _Job:
    """One request's token lists and the future its vectors arrive on."""

    def __init__(self, token_lists: list[list[int]]):
        self.token_lists, self.future = token_lists, Future()


class EmbeddingService:
    """``POST /v1/embeddings`` over one :class:`Embedder`, with a worker thread that batches concurrent requests.

    Args:
        embedder: the model (its lifecycle is the server's: :meth:`start`, :meth:`stop`).
        model_name: the id clients pass as ``model``.
        max_batch_tokens: padded tokens of one forward (at least one input per forward).
        batch_wait_s: how long the worker waits for more requests before running what it has.
    """

    def __init__(self, embedder: Embedder, model_name: str, *, max_batch_tokens: int = 8192,
                 batch_wait_s: float = 0.002):  # fmt: skip
        self.embedder, self.model_name = embedder, model_name
        self.max_batch_tokens, self.batch_wait_s = max_batch_tokens, batch_wait_s
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.forwards = 0  # batches run (tests read it: concurrent requests share them)

    # -- the worker --------------------------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "EmbeddingService":
        if not self.is_running:
            self._thread = threading.Thread(target=self._work, daemon=True, name="hf_dsinfer-embed")
            self._thread.start()
        return self

    def stop(self, cancel_pending: bool = True, timeout: float = 30.0) -> None:
        """Stop the worker after the batch it runs; requests still queued get a 503 (``cancel_pending`` is the
        engine's argument: a stopped worker always answers what it leaves)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
            self._thread = None
        while not self._jobs.empty():  # jobs that arrived while stopping: answered, never left hanging
            job = self._jobs.get_nowait()
            if job is not None and not job.future.done():
                job.future.set_exception(RuntimeError("the server is shutting down"))

    def submit(self, token_lists: list[list[int]]) -> Future:
        """Queue one request's inputs; the future gives their pooled vectors ``[N, dimension]``."""
        if not self.is_running:
            raise RuntimeError("the embedding worker is not running (start the server first)")
        job = _Job(token_lists)
        self._jobs.put(job)
        return job.future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            jobs = [job]
            time.sleep(self.batch_wait_s)  # let requests sent together arrive
            budget = sum(len(t) for t in job.token_lists)
            stop = False
            while budget < self.max_batch_tokens:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                jobs.append(more)
                budget += sum(len(t) for t in more.token_lists)
            self._run(jobs)
            if stop:
                return

    def _run(self, jobs: list[_Job]) -> None:
        try:
            vectors = self.embedder.embed([t for j in jobs for t in j.token_lists], self.max_batch_tokens)
        except Exception as e:  # noqa: BLE001 - the requests get the error; the worker keeps serving
            logger.exception("hf_dsinfer embeddings: a batch failed")
            for j in jobs:
                j.future.set_exception(e)
            return
        self.forwards += 1
        start = 0
        for j in jobs:
            j.future.set_result(vectors[start : start + len(j.token_lists)])
            start += len(j.token_lists)

    # -- the route ---------------------------------------------------------------------------------------------------

    def register(self, app: Any, generating: bool = False) -> None:
        """Add ``POST /v1/embeddings`` to the FastAPI ``app``; unless the server also ``generating``, the completion
        routes answer 400 naming ``--runner`` (as vLLM answers them on an embedding model)."""
        from fastapi import Request

        if not generating:

            @app.post("/v1/chat/completions")
            @app.post("/v1/completions")
            async def not_generating(request: Request) -> dict:
                raise RequestError(
                    f"The model '{self.model_name}' is an embedding model (served with --runner pooling): it answers "
                    f"POST /v1/embeddings, not {request.url.path}; serve a generating model with --runner generate",
                    param="model",
                )  # fmt: skip

        @app.post("/v1/embeddings")
        async def embeddings(request: Request) -> dict:
            body = await json_body(request)
            token_lists, dimensions, normalize, encode = self._parse(body)
            try:
                future = self.submit(token_lists)
            except RuntimeError as e:
                raise RequestError(str(e), status=503) from e
            try:
                pooled = await asyncio.wrap_future(future)
            except RuntimeError as e:
                raise RequestError(f"embedding failed: {e}", status=503) from e
            except Exception as e:  # noqa: BLE001 - a model error: reported, the server keeps serving
                raise RequestError(f"embedding failed: {type(e).__name__}: {e}", status=500) from e
            vectors = self.embedder.finish(pooled, dimensions, normalize)
            data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)]
            n = sum(len(t) for t in token_lists)
            rid = body.get("request_id") or uuid.uuid4().hex
            return {"id": f"embd-{rid}", "object": "list", "created": int(time.time()), "model": self.model_name,
                    "data": data, "usage": {"prompt_tokens": n, "total_tokens": n}}  # fmt: skip

    def _parse(self, body: dict) -> tuple[list[list[int]], int | None, bool | None, Any]:
        """(token ids per input, dimensions, normalize, vector -> JSON value). Raises :class:`RequestError`."""
        if "normalize" in body:
            raise RequestError("'normalize' was removed from vLLM's API; use 'use_activation' (true: L2-normalize)",
                               param="normalize")  # fmt: skip
        for name in body:
            if name not in _FIELDS:
                raise unknown_field(name, "/v1/embeddings", _FIELDS)
        model = param(body, "model", str)
        if model is not None and model != self.model_name:
            raise model_not_found(model, self.model_name)
        for name in ("mm_processor_kwargs", "media_io_kwargs"):
            if body.get(name):
                raise RequestError(f"'{name}' is for multimodal models; this one takes text only", param=name)
        if param(body, "priority", int, 0) != 0:
            raise RequestError("'priority' needs priority scheduling, which this server does not have; leave it out",
                               param="priority")  # fmt: skip
        if param(body, "padding", str, "do_not_pad") != "do_not_pad":
            raise RequestError("'padding': only 'do_not_pad' is supported (inputs are embedded as they are)",
                               param="padding")  # fmt: skip
        param(body, "user", str), param(body, "request_id", str), param(body, "cache_salt", str)
        token_lists = self._inputs(body)
        dimensions = self._dimensions(body)
        normalize = param(body, "use_activation", bool)
        return token_lists, dimensions, normalize, self._encoder(body)

    def _inputs(self, body: dict) -> list[list[int]]:
        """Each input's token ids, truncated or refused at the model's length."""
        e = self.embedder
        has_messages = body.get("messages") is not None
        if has_messages == (body.get("input") is not None):
            raise RequestError("pass exactly one of 'input' (text or token ids) and 'messages' (a chat)", param="input")
        truncate = param(body, "truncate_prompt_tokens", int)
        if truncate is not None and not (truncate == -1 or 1 <= truncate <= e.max_model_len):
            raise RequestError(f"'truncate_prompt_tokens' must be -1 (the model's length, {e.max_model_len}) or "
                               f"between 1 and {e.max_model_len}, got {truncate}",
                               param="truncate_prompt_tokens")  # fmt: skip
        keep = e.max_model_len if truncate == -1 else truncate
        side = param(body, "truncation_side", str, "right")
        if side not in ("left", "right"):
            raise RequestError(f"'truncation_side' must be 'left' or 'right', got {side!r}", param="truncation_side")
        if has_messages:
            if body.get("chat_template") is not None:  # as the chat route (and vLLM without its trust flag)
                raise RequestError("'chat_template': a per-request Jinja template is refused, as by the chat route",
                                   param="chat_template")  # fmt: skip
            if getattr(e.tokenizer, "chat_template", None) is None:
                raise RequestError("this model's tokenizer has no chat template: embed 'input' (text) instead",
                                   param="messages")  # fmt: skip
            ids = chat_prompt_ids(
                self.embedder.tokenizer, body["messages"],
                add_generation_prompt=param(body, "add_generation_prompt", bool, False),  # vLLM's default here
                continue_final_message=param(body, "continue_final_message", bool, False),
                add_special_tokens=param(body, "add_special_tokens", bool, False),
                chat_template_kwargs=param(body, "chat_template_kwargs", dict),
            )  # fmt: skip
            items: list[tuple[list[int], list[int] | None]] = [(ids, None)]
        else:
            items = self._input_items(body["input"], param(body, "add_special_tokens", bool, True))
        out = []
        for i, (ids, special) in enumerate(items):
            if keep is not None and len(ids) > keep:
                ids = _truncate(ids, special, keep, side)
            if len(ids) > e.max_model_len:
                raise RequestError(
                    f"input {i} has {len(ids)} tokens; this model takes at most {e.max_model_len} (max_model_len): "
                    "shorten it, or set 'truncate_prompt_tokens' (-1 cuts it to the model's length)",
                    param="input", code="context_length_exceeded",
                )  # fmt: skip
            if not ids:
                raise RequestError(f"input {i} has no tokens: embed a non-empty text", param="input")
            out.append(ids)
        return out

    def _input_items(self, value: Any, add_special_tokens: bool) -> list[tuple[list[int], list[int] | None]]:
        """``(ids, special-token mask or None)`` per input of OpenAI's ``input``: a string, a list of strings, a list
        of token ids or a list of token-id lists."""

        def is_ids(v: Any) -> bool:
            return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

        if isinstance(value, str) or is_ids(value):
            value = [value]
        if not isinstance(value, list) or not value:
            raise RequestError("'input' must be a string, a list of strings, a list of token ids or a list of "
                               "token-id lists (not empty)", param="input")  # fmt: skip
        if len(value) > _MAX_INPUTS:
            raise RequestError(f"'input' has {len(value)} items; at most {_MAX_INPUTS} per request", param="input")
        vocab = len(self.embedder.tokenizer)
        items = []
        for i, v in enumerate(value):
            if isinstance(v, str):
                if not v:
                    raise RequestError(f"input {i} is an empty string: embed a non-empty text", param="input")
                items.append(self.embedder.tokenize(v, add_special_tokens))
            elif is_ids(v):
                if min(v) < 0 or max(v) >= vocab:
                    raise RequestError(f"input {i}: token ids must be in [0, {vocab})", param="input")
                items.append((v, None))
            else:
                raise RequestError(f"input {i} must be a non-empty string or list of token ids, and every item "
                                   "of one kind", param="input")  # fmt: skip
        return items

    def _dimensions(self, body: dict) -> int | None:
        dimensions = param(body, "dimensions", int)
        if dimensions is None:
            return None
        sizes = self.embedder.matryoshka
        if sizes is None:
            raise RequestError(f"'dimensions': the model '{self.model_name}' is not a Matryoshka model (its config "
                               "sets neither is_matryoshka nor matryoshka_dimensions), so its vectors cannot be "
                               "shortened; leave 'dimensions' out", param="dimensions")  # fmt: skip
        if not 1 <= dimensions <= self.embedder.dimension or (sizes and dimensions not in sizes):
            allowed = ", ".join(map(str, sizes)) if sizes else f"1 to {self.embedder.dimension}"
            raise RequestError(f"'dimensions' must be one of {allowed}, got {dimensions}", param="dimensions")
        return dimensions

    @staticmethod
    def _encoder(body: dict) -> Any:
        """vector -> its JSON value: a list of floats, or base64 of its bytes (``embed_dtype``, ``endianness``)."""
        fmt = param(body, "encoding_format", str, "float")
        dtype_name = param(body, "embed_dtype", str, "float32")
        endianness = param(body, "endianness", str, "native")
        if dtype_name not in _EMBED_DTYPES:
            raise RequestError(f"'embed_dtype' must be one of {', '.join(_EMBED_DTYPES)}, got {dtype_name!r}",
                               param="embed_dtype")  # fmt: skip
        if endianness not in ("native", "little", "big"):
            raise RequestError(f"'endianness' must be native, little or big, got {endianness!r}", param="endianness")
        if fmt == "float":
            return lambda v: v.tolist()
        if fmt != "base64":
            raise RequestError(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", param="encoding_format")
        dtype = _EMBED_DTYPES[dtype_name]
        swap = (sys.byteorder if endianness == "native" else endianness) != sys.byteorder

        def to_base64(v: torch.Tensor) -> str:
            raw = v.to(dtype).contiguous().view(torch.uint8).reshape(-1, dtype.itemsize)  # [D, bytes per value]
            if swap:
                raw = raw.flip(-1)
            return base64.b64encode(raw.numpy().tobytes()).decode("ascii")

        return to_base64


def _truncate(ids: list[int], special: list[int] | None, keep: int, side: str) -> list[int]:
    """``ids`` cut to ``keep`` tokens from ``side``. A tokenized text keeps its special tokens ([CLS] ... [SEP]) and
    loses content tokens, as a tokenizer's own truncation does; token ids given as such are cut as they are."""
    if special is None:
        return ids[:keep] if side == "right" else ids[len(ids) - keep :]
    content = [i for i, s in enumerate(special) if not s]
    drop = len(ids) - keep
    if drop > len(content):
        raise RequestError(f"'truncate_prompt_tokens'={keep} leaves no room for the text besides its special tokens",
                           param="truncate_prompt_tokens")  # fmt: skip
    gone = set(content[len(content) - drop :] if side == "right" else content[:drop])
    return [t for i, t in enumerate(ids) if i not in gone]


def build_embedding_server(path: str, inference_config: Any = None, *, served_model_name: str | None = None,
                           max_model_len: int | None = None, pooler_config: dict | None = None,
                           model_aliases: tuple[str, ...] = (), **server_kwargs: Any) -> Any:  # fmt: skip
    """``hf-dsinfer serve --runner pooling``: load ``path`` as an :class:`Embedder` and put an ``OpenAIServer`` (not
    started) in front of it. ``max_model_len`` may lower the folder's own input limit; ``server_kwargs`` go to the
    server (api_key, CORS, ...)."""
    import os

    from .server import OpenAIServer  # the server imports this module: imported here, when serving

    embedder = Embedder.from_pretrained(path, inference_config, pooler_config)
    if max_model_len is not None:
        if not 1 <= max_model_len <= embedder.max_model_len:
            limit = embedder.max_model_len
            raise ValueError(f"--max-model-len {max_model_len}: this embedding model takes at most {limit} tokens "
                             f"per input; pass 1 to {limit}")  # fmt: skip
        embedder.max_model_len = max_model_len
    name = served_model_name or os.path.basename(os.path.normpath(path)) or path
    aliases = tuple(({path, os.path.abspath(path), os.path.normpath(path)} | set(model_aliases)) - {name})
    server_kwargs.pop("default_max_tokens", None)  # a generating setting
    server = OpenAIServer(None, embedder.tokenizer, name, embedder=embedder, model_aliases=aliases, **server_kwargs)
    logger.warning("hf_dsinfer serve: embedding model '%s' (%s, --runner pooling), pooling %s%s, at most %d tokens "
                   "per input", name, path, "+".join(embedder.spec.modes), " + normalize" if embedder.spec.normalize
                   else "", embedder.max_model_len)  # fmt: skip
    return server
