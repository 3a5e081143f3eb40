"""Hybrid Engine statistics: where each train -> generate iteration spends its time.

An *iteration* starts at ``HybridEngine.eval()`` and ends at the next ``eval()``. Inside it: the weight refresh
(gather shards + LoRA-fuse + copy into the inference buffers), the ``generate`` calls, then (after ``train()``) the
training time until the next ``eval()``. ``e2e_ms`` is the whole iteration. Times are wall clock; on CUDA the
engine synchronizes at each boundary so the numbers are real device time (a few syncs per iteration, none per step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class IterationStats:
    """One iteration. ``gather_ms`` is the part of ``refresh_ms`` spent gathering shards (FSDP2 / ZeRO-3);
    ``new_tokens`` counts generated positions of all rows (rows that stopped early count their padding)."""

    index: int
    refreshed: bool = False
    refresh_ms: float = 0.0
    refresh_cpu_ms: float = 0.0  # the refresh's process CPU time (all threads of the process)
    gather_ms: float = 0.0
    generate_ms: float = 0.0
    generate_calls: int = 0
    samples: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0  # real prompt tokens of all rows, as ServingStats counts them
    prefill_tokens_computed: int = 0  # the ones prefilled: repeated rows (GRPO, num_return_sequences) share one
    train_ms: float = 0.0
    e2e_ms: float = 0.0
    complete: bool = False
    logp_diff: float | None = None  # the engine's logp_diff probe, when on (hybrid/probe.py)
    wake_ms: float = 0.0  # eval() after sleep(): storage back + full refresh (instead of refresh_ms)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of generate time."""
        return self.new_tokens / (self.generate_ms / 1e3) if self.generate_ms > 0 else 0.0

    @property
    def other_ms(self) -> float:
        """Iteration time not spent refreshing, generating or training (switching, Python overhead)."""
        return max(0.0, self.e2e_ms - self.refresh_ms - self.generate_ms - self.train_ms) if self.complete else 0.0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (with the derived ``tokens_per_s`` and ``other_ms``)."""
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "other_ms": self.other_ms}


class HybridStats:
    """The iterations of one :class:`~hf_dsinfer.HybridEngine` (the last ``keep`` are kept) plus running totals.

    ``last`` is the most recent iteration (possibly still open), ``summary()`` the totals and shares, and
    ``log_dict()`` the means of the iterations since the previous ``log_dict()`` call (what the Trainer callback logs).
    """

    def __init__(self, keep: int = 1000):
        self.iterations: deque[IterationStats] = deque(maxlen=keep)
        self._count = 0
        self._totals = IterationStats(index=-1)
        self._gen_mark = 0  # iterations below this index had their refresh/generate part logged
        self._done_mark = 0  # ... and below this one their training / end-to-end part

    # -- recording (called by the engine) ---------------------------------------------------------------------------

    def start(self) -> IterationStats:
        """Open a new iteration (at ``eval()``)."""
        it = IterationStats(index=self._count)
        self._count += 1
        self.iterations.append(it)
        return it

    def finish(self, it: IterationStats, e2e_ms: float, train_ms: float) -> None:
        """Close ``it`` (at the next ``eval()``) and add it to the totals."""
        it.e2e_ms, it.train_ms, it.complete = e2e_ms, train_ms, True
        t = self._totals
        t.refresh_ms += it.refresh_ms
        t.gather_ms += it.gather_ms
        t.generate_ms += it.generate_ms
        t.generate_calls += it.generate_calls
        t.samples += it.samples
        t.new_tokens += it.new_tokens
        t.prompt_tokens += it.prompt_tokens
        t.prefill_tokens_computed += it.prefill_tokens_computed
        t.train_ms += it.train_ms
        t.e2e_ms += it.e2e_ms
        t.refreshed = t.refreshed or it.refreshed
        t.index += 1

    # -- reading ----------------------------------------------------------------------------------------------------

    @property
    def count(self) -> int:
        """Iterations started so far."""
        return self._count

    @property
    def last(self) -> IterationStats | None:
        """The most recent iteration (open or complete), or None before the first ``eval()``."""
        return self.iterations[-1] if self.iterations else None

    def summary(self) -> dict[str, float]:
        """Totals over completed iterations, each phase's share of end-to-end time and the mean throughput."""
        t = self._totals
        n = t.index + 1
        share = (100.0 / t.e2e_ms) if t.e2e_ms else 0.0  # percent per ms; 0 before the first complete iteration
        return {
            "iterations": n,
            "e2e_ms_mean": t.e2e_ms / n if n else 0.0,
            "refresh_ms_mean": t.refresh_ms / n if n else 0.0,
            "gather_ms_mean": t.gather_ms / n if n else 0.0,
            "generate_ms_mean": t.generate_ms / n if n else 0.0,
            "train_ms_mean": t.train_ms / n if n else 0.0,
            "refresh_pct": t.refresh_ms * share,
            "generate_pct": t.generate_ms * share,
            "train_pct": t.train_ms * share,
            "tokens_per_s": t.tokens_per_s,
            "samples_per_s": t.samples / (t.e2e_ms / 1e3) if t.e2e_ms else 0.0,
        }

    def log_dict(self, prefix: str = "hybrid/") -> dict[str, float]:
        """Means over the iterations not yet logged; empty when nothing happened since the last call.

        Refresh and generate numbers are reported as soon as an iteration has them (it may still be open); training
        and end-to-end times once it is complete (at the next ``eval()``), so every value is logged exactly once.
        """
        gen = [it for it in self.iterations if it.index >= self._gen_mark]
        done = [it for it in self.iterations if it.complete and it.index >= self._done_mark]
        out: dict[str, float] = {}
        if gen:
            gen_ms = sum(it.generate_ms for it in gen)
            tokens = sum(it.new_tokens for it in gen)
            out.update(
                refresh_ms=sum(it.refresh_ms for it in gen) / len(gen),
                gather_ms=sum(it.gather_ms for it in gen) / len(gen),
                generate_ms=gen_ms / len(gen),
                tokens_per_s=tokens / (gen_ms / 1e3) if gen_ms > 0 else 0.0,
                switches=float(len(gen)),
            )
            probes = [it.logp_diff for it in gen if it.logp_diff is not None]
            if probes:
                out["logp_diff"] = sum(probes) / len(probes)
            self._gen_mark = gen[-1].index + 1
        if done:
            out.update(
                train_ms=sum(it.train_ms for it in done) / len(done),
                e2e_ms=sum(it.e2e_ms for it in done) / len(done),
            )
            self._done_mark = done[-1].index + 1
        return {prefix + k: (v if k == "logp_diff" else round(v, 3)) for k, v in out.items()}

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"HybridStats(iterations={s['iterations']}, e2e={s['e2e_ms_mean']:.1f} ms, refresh="
            f"{s['refresh_ms_mean']:.1f} ms ({s['refresh_pct']:.0f}%), generate={s['generate_ms_mean']:.1f} ms "
            f"({s['generate_pct']:.0f}%), train={s['train_ms_mean']:.1f} ms ({s['train_pct']:.0f}%), "
            f"{s['tokens_per_s']:.1f} tokens/s)"
        )
