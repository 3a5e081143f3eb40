"""``hf-dsinfer serve``: an OpenAI-compatible HTTP server on :class:`~hf_dsinfer.serving.ServingEngine`.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (:mod:`.completions`: streaming as server-sent
events, or one JSON answer), ``GET /v1/models``, ``GET /health`` (200 only while the engine can serve),
``GET /metrics`` (Prometheus, :mod:`.metrics`). This module builds the app and runs it: the ``/v1`` door (API key,
backpressure, draining: :mod:`.gate`), CORS, and the lifecycle (start, graceful drain on SIGTERM, stop).

Why not ``transformers serve``: it loads models itself, with fixed ``from_pretrained`` arguments (quantization limited
to bitsandbytes), so neither a plain checkpoint with ``--inference-config`` nor the engine's settings can reach it
without patching its private model manager. This server is small instead: FastAPI + uvicorn (the ``serve`` extra).

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: bad JSON or settings give 400, a
missing API key 401, an unknown model 404, a full queue 429 (with ``Retry-After``), a server shutting down or whose
engine failed 503.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations (``request: Request``) at runtime,
# and ``Request`` is imported inside ``_build_app`` (FastAPI is an optional dependency).
import asyncio
import signal
import socket
import threading
import time
from typing import Any

from ..log import logger
from .completions import CompletionService
from .embedding_routes import EmbeddingService
from .engine import ServingEngine
from .gate import Gate
from .http_common import INSTALL_HINT, RequestError, bind_socket, json_body
from .metrics import ServerMetrics
from .tokenize_routes import TokenizeService

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
        model_aliases: other names accepted as ``model`` (e.g. the model's full path); answers name ``model_name``.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (401 otherwise); ``/health`` and
            ``/metrics`` stay open.
        allowed_origins: CORS origins allowed to call the server from a browser (None: no CORS headers, so only
            same-origin pages); ``allowed_methods`` / ``allowed_headers`` as Starlette's ``CORSMiddleware``.
        max_num_queued_reqs: the most choices in flight (waiting plus running, vLLM's meaning); past it a request is
            refused at once with 429 and ``Retry-After``. None: no limit.
        shutdown_timeout: seconds :meth:`run` lets running requests finish after SIGTERM / Ctrl-C before cancelling.
    """

    def __init__(self, engine: ServingEngine | None, tokenizer: Any, model_name: str, *, embedder: Any = None,
                 default_max_tokens: int = 256,
                 max_choices: int = 16, model_aliases: tuple[str, ...] = (), api_key: str | None = None,
                 allowed_origins: list[str] | None = None, allowed_methods: list[str] | None = None,
                 allowed_headers: list[str] | None = None, max_num_queued_reqs: int | None = None,
                 shutdown_timeout: float = 0.0, tool_call_parser: str | None = None):  # fmt: skip
        if max_num_queued_reqs is not None and max_num_queued_reqs < 1:
            raise ValueError(f"max_num_queued_reqs={max_num_queued_reqs}: pass a positive integer (None: no limit)")
        if (engine is None) == (embedder is None):
            raise ValueError("OpenAIServer serves one model: pass an engine (--runner generate) or an embedder "
                             "(--runner pooling), not both")  # fmt: skip
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        # The generating routes need an engine, /v1/embeddings an embedder (embedding_routes); /tokenize serves both.
        self.completions = None if engine is None else CompletionService(
            engine, tokenizer, model_name, default_max_tokens=default_max_tokens, max_choices=max_choices,
            tool_call_parser=tool_call_parser)  # fmt: skip
        self.embeddings = None if embedder is None else EmbeddingService(embedder, model_name)
        self.max_model_len = engine.runner.max_positions if engine is not None else embedder.max_model_len
        self.tokenize = TokenizeService(tokenizer, model_name, self.max_model_len)
        self.created = int(time.time())
        self.shutdown_timeout = shutdown_timeout
        self.metrics = None  # generation metrics: none on a pooling server (no /metrics there)
        if engine is not None:
            engine.record_timestamps = True  # the inter-token latency histogram reads every request's token times
            self.metrics = ServerMetrics(engine, model_name, engine.runner.max_positions)
        self._cors = (allowed_origins, allowed_methods, allowed_headers)
        self._gate_options = dict(api_key=api_key, max_num_queued_reqs=max_num_queued_reqs, model_name=model_name,
                                  model_aliases=tuple(model_aliases))  # fmt: skip
        self.gate: Gate | None = None  # set when the middleware stack is built (below)
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None
        self._drain_thread: threading.Thread | None = None
        self.app = self._build_app()
        self.app.middleware_stack = self.app.build_middleware_stack()  # now, so that the gate exists (drain)

    # -- the app -----------------------------------------------------------------------------------------------------

    def _build_app(self) -> Any:
        try:
            from fastapi import FastAPI, Request
            from fastapi.responses import JSONResponse, Response
        except ImportError as e:
            raise ImportError(f"hf-dsinfer serve needs FastAPI and uvicorn: {INSTALL_HINT}") from e
        from starlette.exceptions import HTTPException

        app = FastAPI(title="hf_dsinfer", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(RequestError)
        async def request_error(_: Request, e: RequestError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(HTTPException)
        async def http_error(_: Request, e: HTTPException) -> JSONResponse:  # unknown routes, wrong methods
            return JSONResponse(RequestError(str(e.detail), e.status_code).body(), status_code=e.status_code)

        @app.get("/health")
        async def health() -> JSONResponse:
            problem = self.unhealthy_reason()
            if problem is None:
                return JSONResponse({"status": "ok"})
            return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)

        if self.metrics is not None:

            @app.get("/metrics")
            async def metrics() -> Response:
                body, content_type = self.metrics.render()
                return Response(body, media_type=content_type)

        @app.get("/v1/models")
        async def models() -> dict:
            card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "hf_dsinfer",
                    "max_model_len": self.max_model_len}  # fmt: skip
            return {"object": "list", "data": [card, *self._lora_cards()]}

        if self.engine is not None and self.engine.lora is not None:
            self._lora_routes(app)

        if self.completions is not None:
            self.completions.register(app)
        if self.embeddings is not None:
            self.embeddings.register(app, generating=self.completions is not None)
        self.tokenize.register(app)
        # Starlette wraps the last added middleware outermost: CORS answers preflights before the gate asks for a key.
        app.add_middleware(_GateFactory, server=self)
        origins, methods, headers = self._cors
        if origins:
            from starlette.middleware.cors import CORSMiddleware

            app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=list(methods or ["*"]),
                               allow_headers=list(headers or ["*"]))  # fmt: skip
        return app

    def _lora_cards(self) -> list[dict]:
        """``/v1/models`` entries of the loaded LoRA adapters (vLLM's: ``root`` the folder, ``parent`` the base)."""
        lora = None if self.engine is None else self.engine.lora
        if lora is None:
            return []
        return [{"id": a.name, "object": "model", "created": self.created, "owned_by": "hf_dsinfer", "root": a.path,
                 "parent": self.model_name, "max_model_len": self.max_model_len}
                for a in sorted(lora.adapters.values(), key=lambda a: a.name)]  # fmt: skip

    def _lora_routes(self, app: Any) -> None:
        """vLLM's ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``/v1/unload_lora_adapter``
        ``{"lora_name"}`` (behind ``--api-key`` like every /v1 route); answers as vLLM's, in plain text."""
        from fastapi import Request
        from fastapi.responses import PlainTextResponse

        def field(body: dict, name: str) -> str:
            value = body.get(name)
            if not isinstance(value, str) or not value:
                raise RequestError(f"'{name}' is required: a non-empty string", param=name)
            return value

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Any:
            body = await json_body(request)
            name, path = field(body, "lora_name"), field(body, "lora_path")
            if name == self.model_name:
                raise RequestError(f"'{name}' is the base model's name; pick another lora_name", param="lora_name")
            try:
                await asyncio.to_thread(self.engine.load_lora_adapter, name, path)
            except ValueError as e:
                raise RequestError(str(e), param="lora_path") from e
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Any:
            name = field(await json_body(request), "lora_name")
            try:
                await asyncio.to_thread(self.engine.unload_lora_adapter, name)
            except KeyError as e:
                raise RequestError(e.args[0], status=404, param="lora_name", code="model_not_found") from e
            except ValueError as e:
                raise RequestError(str(e), param="lora_name") from e
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def unhealthy_reason(self) -> str | None:
        """Why the server cannot serve now (``/health`` answers 503 with it), or None."""
        if self.gate.draining:
            return "shutting down"
        if self.engine is None:
            return None if self.embeddings.is_running else "the embedding worker is not running"
        if self.engine.fatal_error is not None:
            return f"the engine failed: {self.engine.fatal_error!r}"
        if not self.engine.is_running:
            return "the engine is not running"
        return None

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def _backend(self) -> Any:
        """What runs the model: the engine, or the embedding worker (``--runner pooling``)."""
        return self.engine if self.engine is not None else self.embeddings

    def _server(self, sock: socket.socket) -> Any:
        import uvicorn

        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
        server = _Uvicorn(config)
        server.on_signal = self._on_signal
        return server

    def run(self, host: str = "127.0.0.1", port: int = 8000) -> None:
        """Serve until SIGTERM or Ctrl-C, then drain (:attr:`shutdown_timeout`), stop the engine and return."""
        sock = bind_socket(host, port)
        self._backend().start()
        logger.info("hf_dsinfer serving %s on http://%s:%d/v1", self.model_name, host, sock.getsockname()[1])
        self._uvicorn = self._server(sock)
        try:
            self._uvicorn.run(sockets=[sock])
        finally:
            if self._drain_thread is not None:
                self._drain_thread.join(self.shutdown_timeout + 10)
            self._backend().stop()
            logger.info("hf_dsinfer serving: stopped")

    def start(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> str:
        """Serve from a background thread (``port=0``: a free port); returns the base URL, ``http://host:port/v1``."""
        sock = bind_socket(host, port)
        self._backend().start()
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

    def stop(self, timeout: float = 30.0, drain_timeout: float = 0.0) -> None:
        """Stop the background server (:meth:`start`) and the engine. ``drain_timeout``: first refuse new requests
        (503, ``/health`` 503) and let the running ones finish for up to this many seconds, then cancel the rest."""
        self.drain(drain_timeout)
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._uvicorn = self._thread = None
        self._backend().stop()

    def drain(self, timeout: float) -> bool:
        """Refuse new generating requests (503) and wait up to ``timeout`` s for the admitted ones to be answered;
        then cancel what is left and wait (5 s at most) for those answers to go out. True when none was cancelled."""
        gate = self.gate
        gate.draining = True
        deadline = time.monotonic() + max(0.0, timeout)
        while gate.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        clean = gate.in_flight == 0
        if not clean:
            logger.warning("hf_dsinfer serving: %d request(s) still running after the %.1f s shutdown timeout; "
                           "cancelling them", gate.in_flight, timeout)  # fmt: skip
            self._backend().stop(cancel_pending=True)  # their answers end with an error saying the server shuts down
            deadline = time.monotonic() + 5.0
            while gate.in_flight > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        return clean

    def _on_signal(self, sig: int) -> None:
        """SIGTERM / SIGINT while :meth:`run` serves: drain in a thread, then let uvicorn exit (exit status 0). A second
        signal cancels the running requests at once."""
        uv = self._uvicorn
        if self._drain_thread is not None:
            logger.warning("hf_dsinfer serving: second %s: cancelling the running requests", signal.Signals(sig).name)
            self._backend().stop(cancel_pending=True)
            uv.should_exit = True
            return
        logger.warning("hf_dsinfer serving: %s: refusing new requests, letting the running ones finish (%.0f s at "
                       "most, --shutdown-timeout)", signal.Signals(sig).name, self.shutdown_timeout)  # fmt: skip

        def drain_then_exit() -> None:
            try:
                self.drain(self.shutdown_timeout)
            finally:
                uv.should_exit = True

        self._drain_thread = threading.Thread(target=drain_then_exit, name="hf_dsinfer-drain", daemon=True)
        self._drain_thread.start()


class _GateFactory:
    """Builds the :class:`Gate` when Starlette builds its middleware stack, and hands it to the server."""

    def __new__(cls, app: Any, server: OpenAIServer) -> Any:  # noqa: D102 - a middleware factory
        server.gate = Gate(app, **server._gate_options)
        if server.metrics is not None:
            server.metrics.rejections = server.gate.rejected  # read at each scrape
        return server.gate


def _uvicorn_class() -> type:
    import uvicorn

    class Uvicorn(uvicorn.Server):
        """uvicorn's server whose SIGTERM / SIGINT start a drain (the owner's ``on_signal``) instead of exiting at once,
        and are not raised again afterwards (so a drained shutdown exits with status 0)."""

        on_signal: Any = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.on_signal is None:
                return super().handle_exit(sig, frame)
            self.on_signal(sig)

    return Uvicorn


def _Uvicorn(config: Any) -> Any:  # noqa: N802 - a class built on first use (uvicorn is optional)
    return _uvicorn_class()(config)
