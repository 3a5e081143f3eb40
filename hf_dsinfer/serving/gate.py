"""The door of ``hf-dsinfer serve``'s ``/v1`` routes: API key, draining, backpressure and model-name aliases.

One pure-ASGI middleware (no ``BaseHTTPMiddleware``: it must not buffer streamed answers) that, for each ``/v1/*``
request and before any route runs:

* answers 401 without ``Authorization: Bearer <key>`` when a key is set (constant-time compare);
* answers 503 to generating requests while the server drains (shutting down);
* answers 429 with ``Retry-After`` when ``max_num_queued_reqs`` choices are already in flight (vLLM's meaning:
  waiting plus running; a request with ``n`` choices and ``p`` prompts counts ``n * p``), so a load balancer can send
  it elsewhere at once instead of letting it wait;
* rewrites an accepted alias of the model name (the model's full path) to the served name.

It counts the choices in flight itself, from admission until the response has been sent (or the client has gone):
the count is exact under concurrency because the event loop admits one request at a time.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["REJECTION_REASONS", "Gate"]

GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
#: why the gate refused a request: the queue cap (429; vLLM's reason label for ``--max-num-queued-reqs``), a drain in
#: progress (503), a missing or wrong API key (401)
REJECTION_REASONS = ("max_num_queued_reqs", "shutting_down", "unauthorized")


def _error(status: int, message: str, kind: str, code: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class Gate:
    """ASGI middleware in front of the app (see the module docstring); ``in_flight`` is read by the server."""

    def __init__(self, app: Any, *, api_key: str | None = None, max_num_queued_reqs: int | None = None,
                 model_name: str = "", model_aliases: tuple[str, ...] = (), retry_after_s: int = 1):  # fmt: skip
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_num_queued_reqs = max_num_queued_reqs
        self.model_name, self.model_aliases = model_name, set(model_aliases) - {model_name}
        self.retry_after_s = retry_after_s
        self.draining = False
        self.in_flight = 0  # choices of admitted generating requests not yet answered
        #: requests refused at the door, by reason (exported as ``hf_dsinfer:admission_rejections_total{reason}``)
        self.rejected = dict.fromkeys(REJECTION_REASONS, 0)

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.api_key is not None and not self._authorized(scope):
            self.rejected["unauthorized"] += 1
            body = _error(401, "Incorrect API key provided: send it as 'Authorization: Bearer <key>'",
                          "invalid_request_error", "invalid_api_key")  # fmt: skip
            return await _respond(send, 401, body, [(b"www-authenticate", b"Bearer")])
        if scope.get("method") != "POST" or path not in GENERATING:
            return await self.app(scope, receive, send)
        if self.draining:
            self.rejected["shutting_down"] += 1
            body = _error(503, "the server is shutting down: send the request to another replica", "server_error",
                          "server_shutting_down")  # fmt: skip
            return await _respond(send, 503, body, [(b"connection", b"close")])
        raw, more = await _read_body(receive)
        weight, replaced = self._inspect(raw) if not more else (1, None)
        if self.max_num_queued_reqs is not None and self.in_flight + weight > max(self.max_num_queued_reqs, weight):
            self.rejected["max_num_queued_reqs"] += 1
            body = _error(429, f"the server is at its limit of {self.max_num_queued_reqs} requests in flight "
                          f"(--max-num-queued-reqs); retry after {self.retry_after_s} s or on another replica",
                          "rate_limit_error", "queue_full")  # fmt: skip
            return await _respond(send, 429, body, [(b"retry-after", str(self.retry_after_s).encode())])
        if replaced is not None:
            raw = replaced
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-length"]
                     + [(b"content-length", str(len(raw)).encode())]}  # fmt: skip
        self.in_flight += weight
        try:
            await self.app(scope, _replay(raw, more, receive), send)
        finally:  # answered, failed, or the client went away (the route cancelled its engine requests)
            self.in_flight -= weight

    def _authorized(self, scope: dict) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, key = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.api_key)

    def _inspect(self, raw: bytes) -> tuple[int, bytes | None]:
        """(choices the request asks for, the body with an alias of the model name replaced or None). A body that
        does not parse counts 1 and goes on unchanged: the route answers it with its 400."""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return 1, None
        if not isinstance(body, dict):
            return 1, None
        n = body.get("n")
        n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        prompt = body.get("prompt")
        prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
        replaced = None
        if body.get("model") in self.model_aliases:
            replaced = json.dumps({**body, "model": self.model_name}).encode()
        return n * max(1, prompts), replaced


async def _read_body(receive: Callable[[], Awaitable[dict]], limit: int = 1 << 20) -> tuple[bytes, bool]:
    """Up to ``limit`` bytes of the request body: (bytes, whether more follows); a larger body is passed on unread."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: let the app see it
            return b"".join(chunks), True
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False
        if size >= limit:
            return b"".join(chunks), True


def _replay(raw: bytes, more: bool, receive: Callable[[], Awaitable[dict]]) -> Callable[[], Awaitable[dict]]:
    """A ``receive`` that first gives back the body already read, then the rest of the connection's messages."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": more}
        return await receive()

    return replay


async def _respond(send: Callable, status: int, body: dict, headers: list[tuple[bytes, bytes]]) -> None:
    data = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data})
