"""How many threads a compiled CPU decode step runs on: torch's thread count when that is faster, one when it is not.

A decode step of a small model is a few hundred short parallel regions (one per generated loop, a few microseconds to
a millisecond each), and every region ends in a barrier. On cores the process has to itself, splitting each loop over
the threads pays: SmolLM2's int4 step at 2 threads took 9.2-9.9 ms against 13.2-13.6 ms on one. When another
process holds a core, a thread that lost its core stalls every barrier for a scheduler time slice: the same step
took 28.7-30.6 ms against 13.5-13.6 ms on one thread (docs/generation.md has the runs). Neither choice is right
everywhere, and the machine's state changes while a process runs.

So each batch bucket is compiled twice (:class:`~.compiled_cpu.CompiledCPUDecode`): generated loops on one thread, and
on a team of torch's thread count (the second compile runs after the first, in the background unless compiles are
synchronous), and a :class:`ThreadGovernor` picks, before each step, the variant whose recent steps were faster: it
runs that one and tries the other once every :data:`EXPLORE_EVERY` steps, so it follows a machine that becomes busy or
quiet at the cost of one step in that many. The one-thread variant also runs the step's library calls (MKL, oneDNN) on
one thread: torch's count is process-wide, so the governor lowers it for that step and restores the caller's value
right after (``torch.set_num_threads`` costs ~0.2 us here). ``HF_DSINFER_COMPILE_THREADS`` pins the choice instead.

(One graph whose loops size their team at run time, inductor's ``cpp.dynamic_threads``, would spare the second
compile, but on torch 2.13 its code failed an index check at 2 threads on SmolLM2 with a 72-token cache and aborted
the process; the fixed-team code of the same graph is right.)
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import torch

__all__ = ["COMPILE_THREADS_ENV", "EXPLORE_EVERY", "ThreadGovernor", "pinned_threads", "team_threads"]

#: ``HF_DSINFER_COMPILE_THREADS``: unset or ``auto`` lets :class:`ThreadGovernor` choose; ``N`` runs every compiled
#: step on ``min(N, torch.get_num_threads())`` threads; ``all`` on torch's thread count.
COMPILE_THREADS_ENV = "HF_DSINFER_COMPILE_THREADS"
#: One step in this many runs the choice not currently preferred, to notice that the machine changed.
EXPLORE_EVERY = 32
#: Weight of the newest step time in an option's running average (step times drift slowly as the cache fills).
_SMOOTH = 0.25


def pinned_threads() -> int | str | None:
    """The count :data:`COMPILE_THREADS_ENV` pins (an int, or ``"all"``), or None to let the governor choose."""
    value = os.environ.get(COMPILE_THREADS_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value == "all":
        return "all"
    try:
        wanted = int(value)
    except ValueError:
        wanted = 0
    if wanted < 1:
        raise ValueError(f"{COMPILE_THREADS_ENV} must be 'auto', a thread count (1 or more) or 'all', got {value!r}; "
                         "unset it to let hf_dsinfer choose per step between one thread and torch's count")  # fmt: skip
    return wanted


def team_threads() -> int:
    """The team size of the multi-threaded variant to compile now (1: compile none): torch's thread count, or the
    pinned count (at most torch's)."""
    pinned, top = pinned_threads(), torch.get_num_threads()
    if pinned is None or pinned == "all":
        return top
    return min(pinned, top)


class ThreadGovernor:
    """Chooses, per step of one batch bucket, between the one-thread variant and the team variant.

    :meth:`step` is a context manager around one call of the compiled step; it yields the variant's thread count (1,
    or ``team``) and times the call.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # seconds; a test passes a fake one
        self._avg: dict[int, float] = {}  # thread count -> running average of its step seconds
        self._warm: set[int] = set()  # counts that ran once (a first run starts the thread team: not timed)
        self._team = 0  # the team the averages were taken with (a change starts over)
        self._since_explore = 0
        self._exploring = False  # the step now running tries the choice not preferred

    def _choose(self, team: int | None, pinned: int | str | None) -> int:
        self._exploring = False
        if not team or team <= 1:
            return 1
        if pinned is not None:
            return 1 if pinned == 1 else team
        if team != self._team:  # another team size: what was measured no longer applies
            self._avg, self._warm, self._team, self._since_explore = {}, set(), team, 0
        for n in (team, 1):  # measure both first (the team first: the fast choice on a quiet machine)
            if n not in self._avg:
                return n
        best = min(self._avg, key=self._avg.__getitem__)
        self._since_explore += 1
        if self._since_explore >= EXPLORE_EVERY:
            self._since_explore, self._exploring = 0, True
            return 1 if best == team else team
        return best

    def _record(self, threads: int, seconds: float) -> None:
        if threads not in self._warm:
            self._warm.add(threads)
            return
        old = self._avg.get(threads)
        # A tried choice takes its new time as is: one step says whether the machine changed, and a wrong switch
        # is undone by the preferred choice's own steps or the next try.
        fresh = old is None or self._exploring
        self._avg[threads] = seconds if fresh else old + _SMOOTH * (seconds - old)

    @contextlib.contextmanager
    def step(self, team: int | None) -> Iterator[int]:
        """Run the enclosed step on the chosen variant: yields 1 or ``team`` (None or 1: no team variant ready). On 1,
        torch's thread count is 1 inside the block; its time feeds the next choices."""
        pinned = pinned_threads()
        n = self._choose(team, pinned)
        top = torch.get_num_threads()
        lower = n == 1 and top > 1
        if lower:
            torch.set_num_threads(1)
        t0 = self.clock()
        try:
            yield n
        finally:
            seconds = self.clock() - t0
            if lower:
                torch.set_num_threads(top)
        if pinned is None and team and team > 1:
            self._record(n, seconds)
