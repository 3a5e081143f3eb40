"""Keeps a background compile's tracing from stalling the decode steps that run meanwhile.

Dynamo traces Python while holding the interpreter lock (the GIL). The decoding thread gives the lock up inside every
torch op (the bindings release it while the kernel runs) and must take it back afterwards; with a compile thread
running Python, it then waits until CPython forces a switch, after its switch interval (5 ms by default). An eager
step of SmolLM2 has hundreds of ops: on a quiet 2-core machine, calls that decode at 42-47 ms per token took 1598 ms
per token while dynamo traced (docs/generation.md). A shorter switch interval made the compile slower and the steps
no faster.

So a background compile runs under a trace hook (``sys.settrace``, set on the compile thread only) that parks the
thread at its next Python call while a decode step runs. After each step the decoding thread lends the parked compile
a slice of time (:data:`SLICE_FRACTION` of the step, at most :data:`MAX_SLICE_S`) by sleeping; when no step has run
for :data:`IDLE_S` (between ``generate`` calls, an idle server) the compile runs freely. Phases of the compile that
run no Python (the C++ compiler, in its own processes) are never parked, and no slice is lent while the compile
thread is not waiting for one.

Garbage collections are one C call each, which no trace hook can split: a collection the compile thread starts waits
at its start (a ``gc`` callback) until the gate opens, and a full one (254-371 ms on SmolLM2's heap) until the decoding
thread is idle, since one started in a slice would run on into the next steps.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

#: Time lent to a parked compile after each decode step, as a fraction of that step's time: a call then takes about
#: 1.1x an eager call alone (the fused eager step beats HF's by 1.3-1.7x) while the compile's Python progresses at an
#: eleventh of a core during back-to-back calls and at full speed between calls. A quarter and a fifth were tried on
#: SmolLM2 (2 cores, default threads, quiet): calls while dynamo traced took 54-58 and 49-63 ms per token against HF
#: eager's 59.7 and 58.2: too close.
SLICE_FRACTION = 0.1
#: Most time lent after one step (a slow step of a large model does not hand the compile long stretches).
MAX_SLICE_S = 0.05
#: Longest single park: a step that lasts longer has the compile run alongside it (as without the gate). A bound, so
#: that a parked compile holding a lock the step needs (a module it is importing halfway, say) delays the step
#: instead of deadlocking it.
PARK_MAX_S = 10.0
#: gc's third threshold (second-generation collections between full ones; 10 by default) while a compile runs.
GC_FULL_THRESHOLD = 1000
#: The interpreter's switch interval during a slice (see :meth:`CompileGate.step`).
SLICE_SWITCH_S = 0.0005
#: A compile parked this long without a decode step in between runs freely until the next step starts.
IDLE_S = 0.1


class CompileGate:
    """Coordinates compile threads (:meth:`compiling`) with decoding threads (:meth:`step`); one per process."""

    def __init__(self) -> None:
        self._go = threading.Event()
        self._go.set()
        self._lock = threading.Lock()
        self.open = True  # read by the hook on every Python call of a compile thread: a plain attribute, no lock
        self.steps = 0  # decode steps running now (several decoding threads may step at once)
        self.last_step_end = 0.0  # time.monotonic() when the last step ended
        self.compiling_threads = 0  # threads under the hook
        self.parked = 0  # compile threads waiting at the gate now
        self.held_gcs = 0  # of those, collections waiting for the decoding thread to go idle (no slice for them)
        self._compile_threads: set[int] = set()  # thread idents under the hook
        self._gc_threshold = gc.get_threshold()
        self.parked_s = 0.0  # total time compile threads spent parked (stats, tests)
        self.lent_s = 0.0  # total time decoding threads slept to let a parked compile run

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Run the enclosed compile (on this thread) under the hook that parks it while decode steps run."""
        previous = sys.gettrace()  # a debugger's or coverage's tracer: restored afterwards
        with self._lock:
            self.compiling_threads += 1
            self._compile_threads.add(threading.get_ident())
            if self.compiling_threads == 1:
                gc.callbacks.append(self._on_gc)
                self._gc_threshold = gc.get_threshold()
                # Full collections are one C call holding the GIL over the whole heap: 254-371 ms each in the compile
                # thread on SmolLM2 (a quiet machine), which no park can split, and the calls they overlapped were the
                # slow ones. Rarer while compiling; young generations are collected as usual.
                gc.set_threshold(*self._gc_threshold[:2], max(self._gc_threshold[2], GC_FULL_THRESHOLD))
        sys.settrace(self._hook)
        try:
            yield
        finally:
            sys.settrace(previous)
            with self._lock:
                self.compiling_threads -= 1
                self._compile_threads.discard(threading.get_ident())
                if not self.compiling_threads:
                    gc.callbacks.remove(self._on_gc)
                    gc.set_threshold(*self._gc_threshold)
                    self._set(True)

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        # Called on each Python call of a compile thread (never for the calls the hook itself makes). Returning None
        # asks for no line events in the frame, so the cost is this one attribute check per call.
        if not self.open:
            self._park()
        return None

    def _idle(self) -> bool:
        return not self.steps and time.monotonic() - self.last_step_end >= IDLE_S

    def _park(self, until_idle: bool = False) -> None:
        t0 = time.monotonic()
        with self._lock:
            self.parked += 1
            self.held_gcs += until_idle
        try:
            while not self.open or (until_idle and not self._idle()):
                self._go.wait(IDLE_S)  # releases the GIL while waiting
                if not self.open and self._idle():
                    self._set(True)  # no decode step for a while: the decoding thread is idle
                if time.monotonic() - t0 > PARK_MAX_S:
                    if not self.open:
                        self._set(True)  # see PARK_MAX_S: run alongside this step (the next one closes the gate)
                    break
        finally:
            with self._lock:
                self.parked -= 1
                self.held_gcs -= until_idle
                self.parked_s += time.monotonic() - t0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # A gc callback, registered while any compile runs; it is called in whichever thread collects. A collection
        # started by a compile thread waits here, before it starts, while the gate is closed (the trace hook parks it
        # at this call already); a full one waits for the decoding thread to go idle.
        if phase != "start" or threading.get_ident() not in self._compile_threads:
            return
        full = info["generation"] == 2
        if self.open and (not full or self._idle()):
            return
        tracer = sys.gettrace()
        sys.settrace(None)  # the waiting below calls Python (Event.wait), which must not re-enter the hook
        try:
            self._park(until_idle=full)
        finally:
            sys.settrace(tracer)

    def _set(self, open_: bool) -> None:
        self.open = open_
        if open_:
            self._go.set()
        else:
            self._go.clear()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Run the enclosed decode step with compile threads parked; then lend a parked compile its slice.

        The gate closes even when no compile runs yet: the step may start one (its first step), which must not run
        alongside it either. The cost without a compile is a lock and an event per step (microseconds)."""
        with self._lock:
            self.steps += 1
        self._set(False)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - t0
            self.last_step_end = time.monotonic()
            with self._lock:
                self.steps -= 1
                lend = not self.steps and self.parked > self.held_gcs
            if lend:
                slice_s = min(took * SLICE_FRACTION, MAX_SLICE_S)
                interval = sys.getswitchinterval()
                # Short only for the slice: when the sleep ends, this thread gets the GIL back within 0.5 ms instead
                # of after a whole default interval (5 ms) of the compile's Python.
                sys.setswitchinterval(min(interval, SLICE_SWITCH_S))
                self._set(True)
                try:
                    time.sleep(slice_s)  # the compile runs meanwhile
                finally:
                    sys.setswitchinterval(interval)
                self.lent_s += slice_s
                with self._lock:
                    if self.compiling_threads and not self.steps:
                        self._set(False)  # parked again until the next slice, or until the caller goes idle


#: The process's gate: every background compile and every decode step that runs while one is pending go through it.
GATE = CompileGate()
