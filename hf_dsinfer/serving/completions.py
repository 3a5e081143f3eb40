"""``POST /v1/chat/completions`` and ``POST /v1/completions`` of ``hf-dsinfer serve``: validate a request
(:mod:`.protocol`), submit one engine request per choice (:mod:`.engine_requests`), and answer with one JSON body or a
stream of server-sent events (:mod:`.responses`).

Every choice is its own engine request, so concurrent HTTP requests are continuously batched on the fused layers and
identical prompt prefixes share KV blocks. This layer parses, validates, streams and counts; the engine decides every
token. A client that goes away cancels its engine requests: a stream when its connection closes, a non-streaming
request as soon as the server sees the disconnect (a task waits for it while the choices run), so generation stops
within one engine step.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations (``request: Request``) at runtime.
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..log import access_logger, logger
from .detokenizer import IncrementalDetokenizer
from .engine import ServingEngine
from .engine_requests import (
    PromptSet,
    chat_prompt,
    completion_prompts,
    fit_context,
    model_sampling_defaults,
    sampling_params,
)
from .handle import RequestHandle
from .http_common import RequestError, json_body, model_not_found
from .protocol import ParsedRequest, parse_request
from .responses import ChoiceState, chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from .tool_output import ToolOutput, constraint_for, tool_parser_for

__all__ = ["CompletionService"]


@dataclass
class _Job:
    """One HTTP request in flight: its parsed fields, prompts and one :class:`ChoiceState` per choice."""

    req: ParsedRequest
    rid: str
    prompts: PromptSet
    choices: list[ChoiceState]
    params: list[Any]
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)
    tools: list[ToolOutput | None] = field(default_factory=list)
    adapter: str | None = None  # the LoRA adapter the request's ``model`` names (None: the base model)

    @property
    def chat(self) -> bool:
        return self.req.chat

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts.ids)  # once per prompt, whatever n is
        completion = 0 if self.req.get("max_tokens") == 0 else sum(c.consumed for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class CompletionService:
    """Chat completions and completions over one :class:`ServingEngine`.

    Args:
        engine: the engine (its lifecycle is the server's).
        tokenizer: the model's tokenizer (a chat template is needed for chat completions).
        model_name: the id clients pass as ``model``.
        default_max_tokens: new tokens of a chat completion that sets no ``max_tokens`` (completions default to 16,
            as OpenAI's API does); capped by what is left of the context.
        max_choices: the largest ``n`` times the number of prompts one request may ask for.
        max_model_len: the longest request (prompt + new tokens); None: the engine's limit.
        tool_call_parser: the name of the tool-call parser (``--tool-call-parser``); None: chosen for the model.
    """

    def __init__(self, engine: ServingEngine, tokenizer: Any, model_name: str, *, default_max_tokens: int = 256,
                 max_choices: int = 16, max_model_len: int | None = None,
                 tool_call_parser: str | None = None):  # fmt: skip
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.default_max_tokens, self.max_choices = default_max_tokens, max_choices
        limit = engine.runner.max_positions
        self.max_model_len = limit if max_model_len is None else min(int(max_model_len), limit)
        if tool_call_parser is not None:
            from .tool_calls import TOOL_PARSERS

            if tool_call_parser not in TOOL_PARSERS:
                raise ValueError(f"tool_call_parser={tool_call_parser!r}: pick one of {sorted(TOOL_PARSERS)}")
        self.tool_call_parser = tool_call_parser
        config = engine.generation_config
        self.defaults = model_sampling_defaults(config)
        if self.defaults:
            logger.info("hf_dsinfer serving: default sampling settings from the model's generation config: %s",
                        self.defaults)  # fmt: skip
        eos = getattr(config, "eos_token_id", None)
        eos = [*(eos if isinstance(eos, (list, tuple)) else [eos]), getattr(tokenizer, "eos_token_id", None)]
        self.eos_token_ids = frozenset(int(e) for e in eos if e is not None and int(e) >= 0)

    def register(self, app: Any) -> None:
        """Add the routes to the FastAPI ``app``."""
        from fastapi import Request
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        async def handle(request: Request, chat: bool) -> Any:
            job = await self._prepare(await json_body(request), chat)
            if job.req.stream:
                return StreamingResponse(self._stream(job), media_type="text/event-stream")
            body = await self._complete(job, request)
            return Response(status_code=499) if body is None else JSONResponse(body)  # 499: the client went away

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Any:
            return await handle(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await handle(request, chat=False)

    # -- preparing ---------------------------------------------------------------------------------------------------

    async def _prepare(self, body: dict, chat: bool) -> _Job:
        """Parse and validate ``body``, render the prompts and build each choice's engine settings (400s here)."""
        req = parse_request(body, chat)
        adapters = self.engine.lora.names() if self.engine.lora is not None else []  # --enable-lora
        if req.model is not None and req.model != self.model_name and req.model not in adapters:
            also = f" and the LoRA adapters {adapters}" if adapters else ""
            raise model_not_found(req.model, self.model_name, also)
        prompts = chat_prompt(req, self.tokenizer) if chat else completion_prompts(req, self.tokenizer)
        if len(prompts.ids) * req.n > self.max_choices:
            raise RequestError(f"'n'={req.n} with {len(prompts.ids)} prompt(s): at most {self.max_choices} choices in "
                               "all per request", param="n")  # fmt: skip
        max_tokens = fit_context(req, prompts, self.max_model_len, self.default_max_tokens if chat else 16)
        vocab = self.engine.runner.vocab
        # Compiling a grammar can take a while: off the event loop, so other requests keep streaming meanwhile.
        constraint = await asyncio.to_thread(constraint_for, req, self.tokenizer, vocab, self.eos_token_ids)
        params = [
            sampling_params(req, index=i, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids, vocab=vocab,
                            defaults=self.defaults, constraint=constraint)
            for i in range(req.n)
        ]  # fmt: skip
        stops = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
        enders = frozenset(req.stop_token_ids or ()) | (frozenset() if req.ignore_eos else self.eos_token_ids)
        choices = [
            ChoiceState(index=p * req.n + i, prompt_index=p, tokenizer=self.tokenizer, stops=tuple(stops),
                        include_stop=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
                        stop_token_ids=enders, min_tokens=req.min_tokens)
            for p in range(len(prompts.ids)) for i in range(req.n)
        ]  # fmt: skip
        rid = req.request_id or uuid.uuid4().hex
        job = _Job(req, f"{'chatcmpl' if chat else 'cmpl'}-{rid}", prompts, choices, params)
        job.tools = [tool_parser_for(req, self.tokenizer, self.tool_call_parser) for _ in choices]
        job.adapter = req.model if req.model in adapters and req.model != self.model_name else None
        return job

    def _submit(self, job: _Job) -> asyncio.Queue:
        """Submit one engine request per choice; updates arrive on the returned queue as choice indices (None: the
        client went away)."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def on_update(index: int) -> Any:
            def notify(handle: RequestHandle, new_tokens: list[int], finished: bool) -> None:
                # Runs on the engine's stepping thread: it must never raise (a raise there fails every request).
                try:
                    loop.call_soon_threadsafe(updates.put_nowait, index)
                except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
                    pass

            return notify

        n = job.req.n
        try:
            for c in job.choices:
                c.handle = self.engine.submit(
                    job.prompts.ids[c.prompt_index], sampling_params=job.params[c.index % n],
                    request_id=f"{job.rid}-{c.index}", on_update=on_update(c.index), adapter=job.adapter,
                )  # fmt: skip
        except ValueError as e:  # settings or a length the engine refuses, named in the message
            self._cancel(job)
            raise RequestError(str(e)) from e
        except RuntimeError as e:  # the engine stopped after an error
            self._cancel(job)
            raise RequestError(str(e), status=503) from e
        return updates

    @staticmethod
    def _cancel(job: _Job) -> None:
        for c in job.choices:
            if c.handle is not None and not c.handle.done:
                c.handle.cancel()

    def _access_log(self, job: _Job, outcome: str | None = None) -> None:
        """The access-log line of one request."""
        usage = job.usage()
        reasons = outcome or ",".join(sorted({str(c.finish_reason) for c in job.choices}))
        access_logger.info("hf_dsinfer request %s %s: prompt_tokens=%d completion_tokens=%d latency=%.3fs finish=%s%s",
                    job.rid, "chat" if job.chat else "completion", usage["prompt_tokens"], usage["completion_tokens"],
                    time.perf_counter() - job.started, reasons, " stream" if job.req.stream else "")  # fmt: skip

    @staticmethod
    def _failure(job: _Job) -> RequestError | None:
        failed = [c for c in job.choices if c.finish_reason in ("error", "abort")]
        if not failed:
            return None
        return RequestError(f"generation failed: {failed[0].error or 'the server is shutting down'}", status=503)

    # -- one JSON answer -----------------------------------------------------------------------------------------

    async def _complete(self, job: _Job, request: Any) -> dict | None:
        """Wait for every choice; None when the client disconnected first (its engine requests are cancelled)."""
        updates = self._submit(job)

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            updates.put_nowait(None)

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            while not all(c.done for c in job.choices):
                index = await updates.get()
                if index is None:
                    self._access_log(job, "client_disconnected")
                    return None
                job.choices[index].advance()
        finally:
            watcher.cancel()
            self._cancel(job)
        error = self._failure(job)
        self._access_log(job, "error" if error else None)
        if error is not None:
            raise error
        return self._chat_body(job) if job.chat else self._completion_body(job)

    def _chat_body(self, job: _Job) -> dict:
        req, tok = job.req, self.tokenizer
        out = []
        for c, tools in zip(job.choices, job.tools):
            message: dict[str, Any] = {"role": "assistant", "content": job.prompts.echo_prefix + c.text}
            finish = c.finish_reason
            if tools is not None:
                content, calls = tools.parse(c.text)
                message["content"] = (job.prompts.echo_prefix + content) or None
                if calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            choice = {"index": c.index, "message": message, "finish_reason": finish, "stop_reason": c.stop_reason,
                      "logprobs": chat_logprobs(tok, c.logprob_entries(), req.return_tokens_as_token_ids)
                      if req.logprobs else None}  # fmt: skip
            if req.return_token_ids:
                choice["token_ids"] = c.tokens
            out.append(choice)
        body = {"id": job.rid, "object": "chat.completion", "created": job.created,
                "model": job.adapter or self.model_name, "choices": out, "usage": job.usage()}  # fmt: skip
        if req.return_token_ids:
            body["prompt_token_ids"] = job.prompts.ids[0]
        if req.prompt_logprobs is not None:
            entries = job.choices[0].handle.prompt_logprobs
            body["prompt_logprobs"] = vllm_prompt_logprobs(tok, job.prompts.ids[0], entries)
        return body

    def _completion_body(self, job: _Job) -> dict:
        req, tok = job.req, self.tokenizer
        out = []
        for c in job.choices:
            prefix = job.prompts.texts[c.prompt_index] if req.echo else ""
            scored_only = req.max_tokens == 0  # echo with max_tokens 0: the prompt alone
            text = prefix + ("" if scored_only else c.text)
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(job, c, 0, 0 if scored_only else c.consumed, echo=req.echo)
            choice = {"index": c.index, "text": text, "finish_reason": "length" if scored_only else c.finish_reason,
                      "stop_reason": c.stop_reason, "logprobs": logprobs}  # fmt: skip
            if req.return_token_ids:
                choice["prompt_token_ids"] = job.prompts.ids[c.prompt_index]
                choice["token_ids"] = [] if scored_only else c.tokens
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tok, job.prompts.ids[c.prompt_index],
                                                                 c.handle.prompt_logprobs)  # fmt: skip
            out.append(choice)
        return {"id": job.rid, "object": "text_completion", "created": job.created,
                "model": job.adapter or self.model_name, "choices": out, "usage": job.usage()}  # fmt: skip

    def _completion_logprobs(self, job: _Job, c: ChoiceState, start: int, end: int, echo: bool) -> dict:
        """Completions log-probs of tokens ``[start, end)`` of ``c``; with ``echo`` the prompt's come first."""
        base = len(job.prompts.texts[c.prompt_index]) if job.req.echo else 0
        prompt, offsets = None, []
        if echo:
            ids = job.prompts.ids[c.prompt_index]
            entries = c.handle.prompt_logprobs or [None] * len(ids)
            prompt = list(zip(ids, entries))
            detok, at = IncrementalDetokenizer(self.tokenizer, job.req.skip_special_tokens), 0
            for token in ids:
                offsets.append(at)
                at += len(detok.step(token))
        offsets += c.offsets(start, end, base)
        return completion_logprobs(self.tokenizer, c.logprob_entries(start, end), offsets,
                                   job.req.return_tokens_as_token_ids, prompt)  # fmt: skip

    # -- streaming -----------------------------------------------------------------------------------------------

    async def _stream(self, job: _Job) -> AsyncIterator[str]:
        """Server-sent events: per choice its pieces of text (with their tokens' log-probs), its finish, then usage
        (when asked) and ``[DONE]``."""
        req = job.req
        head = {"id": job.rid, "object": "chat.completion.chunk" if job.chat else "text_completion",
                "created": job.created, "model": job.adapter or self.model_name}  # fmt: skip
        every = bool((req.stream_options or {}).get("continuous_usage_stats"))

        def event(choice: dict, extra: dict | None = None) -> str:
            usage = {"usage": job.usage()} if every else {}
            return f"data: {json.dumps({**head, 'choices': [choice], **(extra or {}), **usage})}\n\n"

        try:
            updates = self._submit(job)
        except RequestError as e:  # headers are sent already: report the error as an event
            yield f"data: {json.dumps(e.body())}\n\ndata: [DONE]\n\n"
            return
        outcome = "client_disconnected"
        try:
            for first, extra in self._first_events(job):
                yield event(first, extra)
            while not all(c.done for c in job.choices):
                index = await updates.get()
                c = job.choices[index]
                if c.done:
                    continue  # a late update of a choice already cut at a stop string
                c.advance()
                if c.finish_reason in ("error", "abort"):
                    yield f"data: {json.dumps(self._failure(job).body())}\n\n"
                    break
                piece = c.pending(req.stream_interval)
                if piece is not None or c.done:
                    yield event(self._chunk(job, c, piece))
            if req.stream_options and req.stream_options.get("include_usage"):
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': job.usage()})}\n\n"
            yield "data: [DONE]\n\n"
            outcome = None
        finally:  # also when the client disconnects: free the engine's slots
            self._cancel(job)
            self._access_log(job, outcome)

    def _first_events(self, job: _Job) -> list[tuple[dict, dict | None]]:
        """The opening chunk of each choice: the assistant role (chat, with an echoed prefix), or the echoed prompt
        (completions); with ``return_token_ids`` it carries ``prompt_token_ids`` (vLLM's)."""
        req, out = job.req, []
        for c in job.choices:
            ids = {"prompt_token_ids": job.prompts.ids[c.prompt_index]} if req.return_token_ids else None
            if job.chat:
                choice = {"index": c.index, "delta": {"role": "assistant", "content": job.prompts.echo_prefix},
                          "logprobs": None, "finish_reason": None}  # fmt: skip
            elif req.echo or ids:
                logprobs = None
                if req.echo and req.logprobs is not None:
                    logprobs = self._completion_logprobs(job, c, 0, 0, echo=True)
                text = job.prompts.texts[c.prompt_index] if req.echo else ""
                choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": None}
            else:
                continue
            out.append((choice, ids))
        return out

    def _chunk(self, job: _Job, c: ChoiceState, piece: Any) -> dict:
        """One streamed chunk of ``c``: the new text ``piece`` (may be None at the finish) and its tokens."""
        req = job.req
        text, start, end = ("", c.sent_tokens, c.sent_tokens) if piece is None else (piece.text, piece.start, piece.end)
        finish = c.finish_reason if c.done else None
        if job.chat:
            delta: dict[str, Any] = {}
            tools = job.tools[c.index]
            if tools is not None:
                content, calls = tools.feed(text, final=c.done)
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = calls
                if finish == "stop" and tools.called:
                    finish = "tool_calls"
            elif text:
                delta["content"] = text
            logprobs = None
            if req.logprobs:
                logprobs = chat_logprobs(self.tokenizer, c.logprob_entries(start, end), req.return_tokens_as_token_ids)
            choice = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(job, c, start, end, echo=False)
            choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = c.stop_reason
        if req.return_token_ids:
            choice["token_ids"] = c.handle.tokens[start:end]
        return choice
