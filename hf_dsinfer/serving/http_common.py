"""What every HTTP route of ``hf-dsinfer serve`` shares: OpenAI's error shape, body and parameter parsing, the socket.

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: a client fault is a 4xx naming the
parameter and the fix; the server keeps serving.
"""

from __future__ import annotations

import json
import socket
from typing import Any

__all__ = ["INSTALL_HINT", "RequestError", "bind_socket", "json_body", "param"]

INSTALL_HINT = 'pip install -e ".[serve]" (fastapi and uvicorn)'


class RequestError(Exception):
    """A client error: becomes an HTTP ``status`` answer in OpenAI's error format."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def param(body: dict, name: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    """``body[name]`` checked against ``types`` (None means absent); a 400 naming the parameter otherwise."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        value = object()  # JSON true/false is not a number here
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise RequestError(f"'{name}' must be {names}, got {json.dumps(body.get(name))}", param=name)
    return value


async def json_body(request: Any) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({e}); pick another --port") from e
    return sock
