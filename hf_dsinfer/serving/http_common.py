"""What every HTTP route of ``hf-dsinfer serve`` shares: OpenAI's error shape, body and parameter parsing, the socket.

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: a client fault is a 4xx naming the
parameter and the fix; the server keeps serving.
"""

from __future__ import annotations

import json
import socket
from typing import Any

__all__ = ["INSTALL_HINT", "RequestError", "bind_socket", "json_body", "model_not_found", "param", "unknown_field"]

INSTALL_HINT = 'pip install -e ".[serve]" (fastapi and uvicorn)'


class RequestError(Exception):
    """A client error: becomes an HTTP ``status`` answer in OpenAI's error format."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def unknown_field(name: str, route: str, fields: object, hint: str = "") -> RequestError:
    """OpenAI's 400 for a field ``route`` does not take, listing the ``fields`` it takes."""
    return RequestError(f"Unrecognized request argument supplied: '{name}'{hint}; {route} takes: "
                        f"{', '.join(sorted(fields))}", param=name)  # fmt: skip


def model_not_found(model: str, served: str, also: str = "") -> RequestError:
    """The 404 for a ``model`` this server does not serve (``also``: what else it serves, e.g. adapters)."""
    return RequestError(f"The model '{model}' does not exist: this server serves '{served}'{also}", status=404,
                        param="model", code="model_not_found")  # fmt: skip


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
