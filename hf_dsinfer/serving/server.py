"""``hf-dsinfer serve``: an OpenAI-compatible HTTP server on :class:`~hf_dsinfer.serving.ServingEngine`.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (:mod:`.completions`: streaming as server-sent
events, or one JSON answer), ``GET /v1/models``, ``GET /health``. This module builds the app and runs it; the routes
that generate live in :mod:`.completions`.

Why not ``transformers serve``: it loads models itself, with fixed ``from_pretrained`` arguments (quantization limited
to bitsandbytes), so neither a plain checkpoint with ``--inference-config`` nor the engine's settings can reach it
without patching its private model manager. This server is small instead: FastAPI + uvicorn (the ``serve`` extra).

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: bad JSON or settings give 400,
an unknown model 404, a request that cannot fit the context 400 naming the limit; the server keeps serving.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations (``request: Request``) at runtime,
# and ``Request`` is imported inside ``_build_app`` (FastAPI is an optional dependency).
import socket
import threading
import time
from typing import Any

from ..log import logger
from .completions import CompletionService
from .engine import ServingEngine
from .http_common import INSTALL_HINT, RequestError, bind_socket

__all__ = ["OpenAIServer", "RequestError"]


class OpenAIServer:
    """The HTTP layer over a started-on-demand :class:`ServingEngine`.

    Args:
        engine: the engine (started by :meth:`start` / :meth:`run`, stopped by :meth:`stop`).
        tokenizer: the model's tokenizer (a chat template is needed for chat completions).
        model_name: the id clients pass as ``model`` (``GET /v1/models`` lists it).
        default_max_tokens: new tokens of a chat completion that sets no ``max_tokens`` (completions default to 16,
            as OpenAI's API does); capped by what is left of the context.
        max_choices: the largest ``n`` times the number of prompts one request may ask for.
    """

    def __init__(self, engine: ServingEngine, tokenizer: Any, model_name: str, *, default_max_tokens: int = 256,
                 max_choices: int = 16):  # fmt: skip
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.completions = CompletionService(engine, tokenizer, model_name, default_max_tokens=default_max_tokens,
                                             max_choices=max_choices)  # fmt: skip
        self.created = int(time.time())
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    # -- the app -----------------------------------------------------------------------------------------------------

    def _build_app(self) -> Any:
        try:
            from fastapi import FastAPI, Request
            from fastapi.responses import JSONResponse
        except ImportError as e:
            raise ImportError(f"hf-dsinfer serve needs FastAPI and uvicorn: {INSTALL_HINT}") from e
        from starlette.exceptions import HTTPException

        app = FastAPI(title="hf_dsinfer", docs_url=None, redoc_url=None)

        @app.exception_handler(RequestError)
        async def request_error(_: Request, e: RequestError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(HTTPException)
        async def http_error(_: Request, e: HTTPException) -> JSONResponse:  # unknown routes, wrong methods
            return JSONResponse(RequestError(str(e.detail), e.status_code).body(), status_code=e.status_code)

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok" if self.engine.is_running else "stopped"}

        @app.get("/v1/models")
        async def models() -> dict:
            card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "hf_dsinfer"}
            return {"object": "list", "data": [card]}

        self.completions.register(app)
        return app

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def _server(self, sock: socket.socket) -> Any:
        import uvicorn

        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
        return uvicorn.Server(config)

    def run(self, host: str = "127.0.0.1", port: int = 8000) -> None:
        """Serve until interrupted (Ctrl-C), then stop the engine."""
        sock = bind_socket(host, port)
        self.engine.start()
        logger.info("hf_dsinfer serving %s on http://%s:%d/v1", self.model_name, host, sock.getsockname()[1])
        try:
            self._server(sock).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the signal: a normal exit here
            logger.info("hf_dsinfer serving: stopped")
        finally:
            self.engine.stop()

    def start(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> str:
        """Serve from a background thread (``port=0``: a free port); returns the base URL, ``http://host:port/v1``."""
        sock = bind_socket(host, port)
        self.engine.start()
        self._uvicorn = self._server(sock)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="hf_dsinfer-http")  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.stop()
                raise RuntimeError(f"the HTTP server did not start on {host}:{sock.getsockname()[1]}")
            time.sleep(0.05)
        return f"http://{host}:{sock.getsockname()[1]}/v1"

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the background server (:meth:`start`) and the engine."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._uvicorn = self._thread = None
        self.engine.stop()
