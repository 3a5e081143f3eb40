"""How many threads a compiled CPU decode step runs on: torch's thread count when that is faster, one when it is not.

A decode step of a small model is a few hundred short parallel regions (one per generated loop, a few microseconds to
a millisecond each), and every region ends in a barrier. On cores the process has to itself, splitting each loop over
the threads pays: SmolLM2's int4 step at 2 threads takes 8.5-9.0 ms against 12.4-13.1 ms on one. When another
process holds a core, a thread that lost its core stalls every barrier for a scheduler time slice: the same step took
22-34 ms against 12-15 ms on one thread (docs/generation.md has the runs). Neither choice is right everywhere, and the
machine's state changes while a process runs.

So the step is compiled once for a thread count chosen at run time (inductor's ``cpp.dynamic_threads``: the generated
loops size their team from ``omp_get_max_threads()``), and a :class:`ThreadGovernor` picks, before each step, between
one thread and torch's thread count by the recent times of both: it runs the faster and tries the other once every
:data:`EXPLORE_EVERY` steps, so it follows a machine that becomes busy or quiet at the cost of one step in that many.
``HF_DSINFER_COMPILE_THREADS`` pins the choice instead (``1``, a count, or ``all``: torch's thread count).

torch's thread count is process-wide: the governor lowers it to one for the step it times and restores the caller's
value right after (``torch.set_num_threads`` costs ~0.2 us here).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import torch

__all__ = ["COMPILE_THREADS_ENV", "EXPLORE_EVERY", "ThreadGovernor", "pinned_threads"]

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


class ThreadGovernor:
    """Chooses the thread count of one compiled step (one batch bucket) between 1 and torch's current count.

    :meth:`step` is a context manager around one call of the compiled step: it sets the count, times the call and
    restores the caller's count. ``current`` is the count the last step ran on.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # seconds; a test passes a fake one
        self.current = 1
        self._avg: dict[int, float] = {}  # thread count -> running average of its step seconds
        self._warm: set[int] = set()  # counts that ran once (a first run starts the thread team: not timed)
        self._top = 0  # torch's count the averages were taken under (a change starts over)
        self._since_explore = 0
        self._exploring = False  # the step now running tries the choice not preferred

    def _choose(self, top: int, pinned: int | str | None) -> int:
        if pinned is not None:
            return top if pinned == "all" else min(pinned, top)
        if top <= 1:
            return 1
        if top != self._top:  # the caller changed torch's threads: what was measured no longer applies
            self._avg, self._warm, self._top, self._since_explore = {}, set(), top, 0
        self._exploring = False
        for n in (top, 1):  # measure both first (torch's count first: the fast choice on a quiet machine)
            if n not in self._avg:
                return n
        best = min(self._avg, key=self._avg.__getitem__)
        self._since_explore += 1
        if self._since_explore >= EXPLORE_EVERY:
            self._since_explore, self._exploring = 0, True
            return 1 if best == top else top
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
    def step(self) -> Iterator[int]:
        """Run the enclosed step on the chosen thread count (yielded); its time feeds the next choices."""
        top = torch.get_num_threads()
        pinned = pinned_threads()
        n = self.current = self._choose(top, pinned)
        if n != top:
            torch.set_num_threads(n)
        t0 = self.clock()
        try:
            yield n
        finally:
            seconds = self.clock() - t0
            if n != top:
                torch.set_num_threads(top)
        if pinned is None and top > 1:
            self._record(n, seconds)
