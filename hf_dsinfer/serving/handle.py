"""``RequestHandle``: one request submitted to a :class:`~.engine.ServingEngine`, as its submitter sees it (the
token stream, the finish reason, log-probs, timestamps) and as the engine's stepping thread updates it."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

from ..log import logger
from .requests import SamplingParams, TokenLogprobs

__all__ = ["FINISH_REASONS", "RequestHandle"]

#: Finish reasons a handle can end with. "stop": an EOS token or one of ``stop_token_ids`` (included in the tokens),
#: a structured-output constraint completed, or a transformers stopping criterion fired; "length": max_new_tokens;
#: "cancelled": :meth:`RequestHandle.cancel` or :meth:`ServingEngine.stop` with ``cancel_pending``; "error": see
#: :attr:`RequestHandle.error`.
FINISH_REASONS = ("stop", "length", "cancelled", "error")

_END = object()  # the sentinel closing a handle's token stream


class RequestHandle:
    """One submitted request: iterate it for its new token ids as they come; the iteration ends when it finishes.

    ``tokens``: the tokens generated so far; ``finish_reason`` (None while running): one of :data:`FINISH_REASONS`;
    ``stop_reason``: the stop token id that finished it ("stop" by one of ``stop_token_ids``; vLLM's field), else
    None; ``error``: the message when it failed. ``params``: its :class:`~.requests.SamplingParams`.

    Log-probs, when asked for (``SamplingParams.logprobs`` / ``prompt_logprobs``; None otherwise): ``logprobs[i]``
    (a :class:`~.requests.TokenLogprobs`) belongs to ``tokens[i]`` and is there as soon as that token is (it is
    appended first); ``prompt_logprobs[i]`` belongs to ``prompt_ids[i]`` (``[0]`` is None: the first token has no
    prefix), set once before the first token. Safe to use from any thread.
    """

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        on_update: Callable[..., None] | None = None,
        params: SamplingParams | None = None,
    ):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params is not None and params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.stop_reason: int | str | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.created_time = time.perf_counter()
        self.scheduled_time: float | None = None  # first admitted into a step (queue time = this - created)
        self.first_token_time: float | None = None
        self.record_timestamps = False
        self.timestamps: list[float] = []  # time of each token (when record_timestamps)
        self.finished_time: float | None = None
        self._stream: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._on_update = on_update
        self._cancel: Callable[[RequestHandle], None] | None = None  # set by the engine
        self._listeners: list[Callable[[RequestHandle], None]] = []  # the engine's finish_listeners

    # -- the consumer's side ---------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        """New token ids as they are generated (blocking); ends when the request finishes. Iterate it once."""
        while True:
            item = self._stream.get()
            if item is _END:
                return
            yield from item

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request finishes (True) or ``timeout`` seconds pass (False)."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> list[int]:
        """All generated tokens once finished; raises ``RuntimeError`` if it failed, ``TimeoutError`` on timeout."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.finish_reason == "error":
            raise RuntimeError(f"request {self.request_id} failed: {self.error}")
        return list(self.tokens)

    def cancel(self) -> None:
        """Stop generating for this request (its blocks are freed before the next step); ends with "cancelled"."""
        if self._cancel is not None and not self.done:
            self._cancel(self)

    # -- the engine's side -----------------------------------------------------------------------------------------

    def _push(self, new_tokens: list[int], logprobs: list[TokenLogprobs] | None = None) -> None:
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        if self.record_timestamps:
            self.timestamps.extend([now] * len(new_tokens))
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.extend(logprobs)  # before the tokens: a reader that sees token i finds its log-probs
        self.tokens.extend(new_tokens)
        self._stream.put(new_tokens)
        self._notify(new_tokens, False)

    def _notify(self, new_tokens: list[int], finished: bool) -> None:
        # A failing client callback must not take the stepping thread (and every other request) down with it.
        if self._on_update is not None:
            try:
                self._on_update(self, new_tokens, finished)
            except Exception:  # noqa: BLE001
                logger.exception("hf_dsinfer serving: on_update of request %s raised; ignored", self.request_id)

    def _finish(self, reason: str, error: str | None = None) -> None:
        if self.done:
            return
        self.finish_reason, self.error = reason, error
        self.finished_time = time.perf_counter()
        self._done.set()
        self._stream.put(_END)
        self._notify([], True)
        for listener in self._listeners:
            try:
                listener(self)
            except Exception:  # noqa: BLE001 - an observer must not fail the step
                logger.exception("hf_dsinfer serving: a finish listener of request %s raised; ignored", self.request_id)

    def __repr__(self) -> str:
        return f"RequestHandle({self.request_id!r}, tokens={len(self.tokens)}, finish_reason={self.finish_reason!r})"
