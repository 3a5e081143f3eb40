"""``POST /v1/chat/completions`` and ``POST /v1/completions`` of ``hf-dsinfer serve``: parse a request, submit one
engine request per choice, and answer with one JSON body or a stream of server-sent events.

Every request becomes one engine request per choice, so concurrent HTTP requests are continuously batched on the
fused layers and identical prompt prefixes share KV blocks. This layer parses, validates, streams and counts; the
engine decides every token.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations (``request: Request``) at runtime.
import asyncio
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .engine import RequestHandle, ServingEngine
from .http_common import RequestError, json_body, param

__all__ = ["CompletionService"]

# OpenAI parameters this server cannot honour: refused when set to anything but their neutral value.
_UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}), "seed": (None,),
                "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "tools": (None, []),
                "best_of": (None, 1), "echo": (None, False), "suffix": (None, "")}  # fmt: skip


@dataclass
class _Choice:
    """One engine request behind one answer choice: its incremental text and stop strings."""

    index: int
    handle: RequestHandle | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # decoded text so far, cut at a stop string
    sent: int = 0  # characters of ``text`` already streamed
    finish_reason: str | None = None
    error: str | None = None


class CompletionService:
    """Chat completions and completions over one :class:`ServingEngine`.

    Args:
        engine: the engine (its lifecycle is the server's).
        tokenizer: the model's tokenizer (a chat template is needed for chat completions).
        model_name: the id clients pass as ``model``.
        default_max_tokens: new tokens of a chat completion that sets no ``max_tokens`` (completions default to 16,
            as OpenAI's API does); capped by what is left of the context.
        max_choices: the largest ``n`` times the number of prompts one request may ask for.
    """

    def __init__(self, engine: ServingEngine, tokenizer: Any, model_name: str, *, default_max_tokens: int = 256,
                 max_choices: int = 16):  # fmt: skip
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.default_max_tokens, self.max_choices = default_max_tokens, max_choices

    def register(self, app: Any) -> None:
        """Add the routes to the FastAPI ``app``."""
        from fastapi import Request
        from fastapi.responses import JSONResponse, StreamingResponse

        async def handle(request: Request, chat: bool) -> Any:
            body = await json_body(request)
            prompts, config, stops, n, stream, include_usage = self._parse(body, chat)
            if stream:
                return StreamingResponse(self._stream(prompts, config, stops, n, chat, include_usage),
                                         media_type="text/event-stream")  # fmt: skip
            return JSONResponse(await self._complete(prompts, config, stops, n, chat))

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Any:
            return await handle(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await handle(request, chat=False)

    # -- parsing -----------------------------------------------------------------------------------------------------

    def _parse(self, body: dict, chat: bool) -> tuple[list[list[int]], Any, list[str], int, bool, bool]:
        """Validate one request body: (prompt token ids per prompt, GenerationConfig, stop strings, n, stream,
        include_usage). Raises :class:`RequestError`."""
        model = param(body, "model", str)
        if model is None:
            raise RequestError("'model' is required (GET /v1/models lists it)", param="model")
        if model != self.model_name:
            raise RequestError(f"The model '{model}' does not exist: this server serves '{self.model_name}'",
                               status=404, param="model", code="model_not_found")  # fmt: skip
        for name, neutral in _UNSUPPORTED.items():
            if name in body and body[name] not in neutral:
                raise RequestError(f"'{name}' is not supported by this server; leave it out", param=name)
        prompts = self._chat_prompt(body) if chat else self._completion_prompts(body)
        n = param(body, "n", int, 1)
        if n < 1 or n * len(prompts) > self.max_choices:
            raise RequestError(f"'n'={n} with {len(prompts)} prompt(s): between 1 and {self.max_choices} choices in "
                               "all per request", param="n")  # fmt: skip
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            raise RequestError("'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = param(body, name, int)
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(f"'{name}' must be >= 1, got {max_tokens}", param=name)
        longest = max(len(p) for p in prompts)
        room = self.engine.runner.max_positions - longest
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise RequestError(
                f"This model's context is {self.engine.runner.max_positions} tokens; the prompt has {longest} and "
                f"asks for {max_tokens or 1} more: shorten the prompt or lower '{name}'",
                param=name, code="context_length_exceeded",
            )  # fmt: skip
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens if chat else 16, room)
        config = copy.deepcopy(self.engine.generation_config)
        config.max_new_tokens, config.max_length = max_tokens, None
        temperature = param(body, "temperature", (int, float))
        top_p = param(body, "top_p", (int, float))
        if temperature is not None and not 0 <= temperature <= 2:
            raise RequestError(f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
        if top_p is not None and not 0 < top_p <= 1:
            raise RequestError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
        if temperature == 0:
            config.do_sample = False  # OpenAI's greedy
        elif temperature is not None:
            config.do_sample, config.temperature = True, float(temperature)
        if top_p is not None:
            config.top_p = float(top_p)
        if not config.do_sample:
            config.temperature, config.top_p, config.top_k = 1.0, 1.0, None  # no sampling knobs on greedy requests
        stream = param(body, "stream", bool, False)
        options = param(body, "stream_options", dict, {})
        return prompts, config, stops, n, stream, bool(options.get("include_usage"))

    def _chat_prompt(self, body: dict) -> list[list[int]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
        messages = [{**m, "content": _text_content(m)} for m in messages]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestError("this model's tokenizer has no chat template: use /v1/completions", param="messages")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return [self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _completion_prompts(self, body: dict) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("'prompt' must be a string, a list of token ids, or a list of either", param="prompt")
        out = []
        for p in prompt:
            if isinstance(p, str) and p:
                out.append(self.tokenizer(p)["input_ids"])
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                if min(p) < 0 or max(p) >= len(self.tokenizer):
                    raise RequestError(f"'prompt' token ids must be in [0, {len(self.tokenizer)})", param="prompt")
                out.append(p)
            else:
                raise RequestError("each prompt must be a non-empty string or list of token ids", param="prompt")
        return out

    # -- running -----------------------------------------------------------------------------------------------------

    def _submit(self, prompts: list[list[int]], config: Any, n: int) -> tuple[list[_Choice], asyncio.Queue]:
        """Submit one engine request per choice; updates arrive on the returned queue as choice indices."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        choices = [_Choice(i) for i in range(len(prompts) * n)]

        def on_update(index: int) -> Any:
            def notify(handle: RequestHandle, new_tokens: list[int], finished: bool) -> None:
                # Runs on the engine's stepping thread: it must never raise (a raise there fails every request).
                try:
                    loop.call_soon_threadsafe(updates.put_nowait, index)
                except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
                    pass

            return notify

        try:
            for c in choices:
                c.handle = self.engine.submit(prompts[c.index // n], config, on_update=on_update(c.index))
        except ValueError as e:  # settings or a length the engine refuses, named in the message
            self._cancel(choices)
            raise RequestError(str(e)) from e
        except RuntimeError as e:  # the engine stopped after an error
            self._cancel(choices)
            raise RequestError(str(e), status=503) from e
        return choices, updates

    @staticmethod
    def _cancel(choices: list[_Choice]) -> None:
        for c in choices:
            if c.handle is not None and not c.handle.done:
                c.handle.cancel()

    def _advance(self, c: _Choice, stops: list[str]) -> str:
        """Bring ``c`` up to date with its handle; returns the text that may be sent now."""
        h = c.handle
        done = h.done  # read before the tokens: once done, the tokens are final
        c.tokens = list(h.tokens)
        text = self.tokenizer.decode(c.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:  # a stop string: the text ends before it, and the engine stops generating for this choice
            text, done = text[:cut], True
            c.finish_reason = "stop"
            h.cancel()
        elif done:
            c.finish_reason = {"cancelled": "abort"}.get(h.finish_reason, h.finish_reason)
            c.error = h.error
        c.text = text
        if done:
            return text[c.sent :]
        # Hold back an incomplete UTF-8 character and what could be the start of a stop string.
        safe = len(text.rstrip("\ufffd"))
        if stops:
            safe = min(safe, len(text) - max(len(s) for s in stops) + 1)
        return text[c.sent : max(c.sent, safe)]

    async def _complete(self, prompts: list[list[int]], config: Any, stops: list[str], n: int, chat: bool) -> dict:
        choices, updates = self._submit(prompts, config, n)
        try:
            while any(c.finish_reason is None for c in choices):
                c = choices[await updates.get()]
                if c.finish_reason is None:  # not a late update of a choice already cut at a stop string
                    self._advance(c, stops)
        finally:
            self._cancel(choices)
        failed = [c for c in choices if c.finish_reason in ("error", "abort")]
        if failed:
            raise RequestError(f"generation failed: {failed[0].error or 'the server is shutting down'}", status=503)
        usage = self._usage(prompts, n, choices)
        if chat:
            out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason, "logprobs": None} for c in choices]  # fmt: skip
            return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                    "model": self.model_name, "choices": out, "usage": usage}  # fmt: skip
        out = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None} for c in choices]
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": out, "usage": usage}  # fmt: skip

    async def _stream(self, prompts: list[list[int]], config: Any, stops: list[str], n: int, chat: bool,
                      include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
        """Server-sent events: one chunk per new piece of text of a choice, then its finish chunk, then [DONE]."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}  # fmt: skip

        def chunk(index: int, text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        try:
            choices, updates = self._submit(prompts, config, n)
        except RequestError as e:  # headers are sent already: report the error as an event
            yield f"data: {json.dumps(e.body())}\n\ndata: [DONE]\n\n"
            return
        try:
            if chat:
                for c in choices:
                    yield chunk(c.index, None, None, role=True)
            while any(c.finish_reason is None for c in choices):
                c = choices[await updates.get()]
                if c.finish_reason is not None:
                    continue  # a late update of a choice cut at a stop string
                piece = self._advance(c, stops)
                c.sent += len(piece)
                if c.finish_reason in ("error", "abort"):
                    err = RequestError(f"generation failed: {c.error or 'the server is shutting down'}", status=503)
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                if piece:
                    yield chunk(c.index, piece, None)
                if c.finish_reason is not None:
                    yield chunk(c.index, None, c.finish_reason)
            if include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': self._usage(prompts, n, choices)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnects: free the engine's slots
            self._cancel(choices)

    @staticmethod
    def _usage(prompts: list[list[int]], n: int, choices: list[_Choice]) -> dict[str, int]:
        prompt_tokens = sum(len(p) for p in prompts) * n
        completion = sum(len(c.tokens) for c in choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }


def _text_content(message: dict) -> str:
    """A message's text: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts (text only)."""
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(message.get("role"), str) or not isinstance(content, str):
        raise RequestError("each message needs a string 'role' and a text 'content' (a string or text parts)",
                           param="messages")  # fmt: skip
    return content
