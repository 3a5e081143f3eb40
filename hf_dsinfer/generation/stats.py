"""Timing of every ``generate`` call: time to first token, ms per token, tokens/s, batch size.

A :class:`StepTimer` is started before the prefill and marked after each forward step (prefill, then every decode
step). On CUDA it records events and reads them once, at the end of the call, so timing adds no host sync per step;
elsewhere it reads the host clock. The finished :class:`GenerateStats` is logged at info level and kept as the last
stats of the model (:func:`last_generate_stats`).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..log import logger

STATS_ATTR = "_dsinfer_last_stats"
_LAST: list[GenerateStats] = []  # the process-wide last stats (one slot)
_PER_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_dsinfer_step_timing", default=False)


@dataclass
class GenerateStats:
    """What one ``generate`` call did and how fast.

    ``ttft_ms``: from the call's start to the first token (prefill and its sampling). ``ms_per_token``: mean time of
    one decode step (one token for every row). ``tokens_per_s``: generated tokens of all rows per second of the
    whole call; ``decode_tokens_per_s`` the same over the decode steps only. ``path``: ``fast`` (our loop),
    ``fast+graphs`` (decode steps replayed as CUDA graphs) or ``hf`` (transformers' loop). ``step_ms``: time of each
    forward step (prefill first), filled only when step timing was requested (:func:`step_timing`).
    ``prompt_tokens`` is the prompt width (padding included); ``prompt_tokens_total`` the real prompt tokens of all
    rows and ``prefill_tokens_computed`` the ones the prefill computed (fewer when repeated rows share one prefill),
    as ``ServingStats.prompt_tokens`` / ``prefill_tokens_computed`` count them.
    """

    batch_size: int
    prompt_tokens: int
    new_tokens: int
    ttft_ms: float
    ms_per_token: float
    tokens_per_s: float
    decode_tokens_per_s: float
    total_ms: float
    path: str
    step_ms: list[float] = field(default_factory=list)
    prompt_tokens_total: int = 0
    prefill_tokens_computed: int = 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return asdict(self)


class StepTimer:
    """Marks the start of a call and the end of each forward step; :meth:`finish` turns marks into stats."""

    def __init__(self, device: torch.device | str, per_step: bool | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.per_step = _PER_STEP.get() if per_step is None else per_step
        self._marks: list[Any] = []  # floats (host clock) or CUDA events
        self._steps = 0

    def _now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def start(self) -> None:
        """Mark the start of the call."""
        self._marks = [self._now()]
        self._steps = 0

    def mark(self) -> None:
        """Mark the end of one forward step (the first one is the prefill)."""
        if not self._marks:
            self.start()
        self._steps += 1
        now = self._now()
        # Keep start, first token and the latest mark; every mark only when per-step times were asked for.
        if self.per_step or len(self._marks) < 3:
            self._marks.append(now)
        else:
            self._marks[-1] = now

    def _elapsed_ms(self, a: Any, b: Any) -> float:
        if self.cuda:
            return float(a.elapsed_time(b))
        return (b - a) * 1e3

    def finish(self, batch_size: int, prompt_tokens: int, new_tokens: int, path: str) -> GenerateStats:
        """The stats of the call (synchronizes once on CUDA). ``new_tokens``: tokens generated per row."""
        end = self._now()
        if self.cuda:
            end.synchronize()
        marks = self._marks or [end]
        start = marks[0]
        total = self._elapsed_ms(start, end)
        ttft = self._elapsed_ms(start, marks[1]) if len(marks) > 1 else total
        decode_ms = total - ttft
        decode_steps = max(new_tokens - 1, 0)
        ms_per_token = decode_ms / decode_steps if decode_steps else 0.0
        step_ms: list[float] = []
        if self.per_step and len(marks) > 1:
            step_ms = [self._elapsed_ms(a, b) for a, b in zip(marks[:-1], marks[1:])]
        return GenerateStats(
            batch_size=batch_size,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            ttft_ms=ttft,
            ms_per_token=ms_per_token,
            tokens_per_s=batch_size * new_tokens / (total / 1e3) if total > 0 else 0.0,
            decode_tokens_per_s=batch_size * decode_steps / (decode_ms / 1e3) if decode_ms > 0 else 0.0,
            total_ms=total,
            path=path,
            step_ms=step_ms,
        )


@contextlib.contextmanager
def step_timing() -> Iterator[None]:
    """Within this block, generate calls record the time of every forward step in ``GenerateStats.step_ms``."""
    token = _PER_STEP.set(True)
    try:
        yield
    finally:
        _PER_STEP.reset(token)


@contextlib.contextmanager
def forward_marks(model: nn.Module, timer: StepTimer) -> Iterator[None]:
    """Mark ``timer`` after every forward of ``model`` (for loops we do not own, e.g. transformers' generate)."""
    handle = model.register_forward_hook(lambda *_: timer.mark())
    try:
        yield
    finally:
        handle.remove()


def prompt_counts(call: Any, ids: Any, mask: Any, batch: int) -> tuple[int, int]:
    """``(prompt_tokens_total, prefill_tokens_computed)`` of a call: the fast loop's counts (``call``), else (HF's
    loop, which prefills every row) the real prompt tokens of the ``batch`` output rows."""
    if getattr(call, "prompt_tokens", 0):
        return call.prompt_tokens, call.prefill_tokens
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] == 0:
        return 0, 0
    per_prompt = batch // ids.shape[0] or 1  # num_return_sequences
    real = mask.sum() if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else ids.numel()
    total = int(real) * per_prompt
    return total, total


def record_stats(model: nn.Module | None, stats: GenerateStats) -> None:
    """Keep ``stats`` as the last stats of ``model`` and of the process, and log them at info level."""
    if model is not None:
        try:
            object.__setattr__(model, STATS_ATTR, stats)
        except (AttributeError, TypeError):
            pass
    _LAST[:] = [stats]
    logger.info(
        "hf_dsinfer generate (%s): batch %d, prompt %d, %d new tokens; first token %.1f ms, %.2f ms/token, "
        "%.1f tokens/s (decode %.1f tokens/s)",
        stats.path, stats.batch_size, stats.prompt_tokens, stats.new_tokens, stats.ttft_ms, stats.ms_per_token,
        stats.tokens_per_s, stats.decode_tokens_per_s,
    )


def last_generate_stats(model: nn.Module | None = None) -> GenerateStats | None:
    """The stats of the last ``generate`` of ``model`` (or an engine / wrapper around it), or of the process."""
    if model is None:
        return _LAST[0] if _LAST else None
    for m in (model, getattr(model, "module", None), getattr(model, "base_model", None)):
        if m is not None and getattr(m, STATS_ATTR, None) is not None:
            return getattr(m, STATS_ATTR)
    return None
