"""The gate that parks a background compile's Python while decode steps run (hf_dsinfer/generation/compile_gate.py).

A stand-in compile thread counts its Python calls; the test thread plays the decoding thread. No torch.compile is
needed: the gate only sees Python calls and steps (tests/test_first_hour.py runs a real background compile through it).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from hf_dsinfer.generation import compile_gate
from hf_dsinfer.generation.compile_gate import CompileGate


class _Compile:
    """A thread doing Python work under ``gate.compiling()`` until stopped; ``calls`` counts its work items."""

    def __init__(self, gate: CompileGate):
        self.gate = gate
        self.calls = 0
        self.stop = threading.Event()
        self.tracer_inside = None
        self.tracer_after = "unset"
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _work(self) -> None:
        self.calls += 1

    def _run(self) -> None:
        with self.gate.compiling():
            self.tracer_inside = sys.gettrace()
            while not self.stop.is_set():
                self._work()
        self.tracer_after = sys.gettrace()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


@contextlib.contextmanager
def _step_starting_compile(gate: CompileGate) -> Iterator[_Compile]:
    """A decode step inside which a compile thread starts (as a bucket's first eager step starts it) and parks."""
    work = _Compile(gate)
    with gate.step():
        work.thread.start()
        assert _wait_for(lambda: gate.parked == 1)
        yield work


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def test_no_step_no_parking():
    """Without decode steps the compile runs freely, and its thread's tracer is restored when it ends; full
    collections are rarer while it runs, gc's thresholds restored after."""
    import gc

    before = gc.get_threshold()
    gate = CompileGate()
    work = _Compile(gate)
    work.thread.start()
    try:
        assert _wait_for(lambda: work.calls > 1000)
        assert gate.parked_s == 0.0 and gate.compiling_threads == 1
        assert gc.get_threshold() == (*before[:2], max(before[2], compile_gate.GC_FULL_THRESHOLD))
    finally:
        work.finish()
    assert work.tracer_inside is not None and work.tracer_after is None
    assert gc.get_threshold() == before
    assert gate.compiling_threads == 0 and gate.open


def test_steps_park_the_compile_then_lend_it_a_slice(monkeypatch):
    """While a step runs the compile makes no progress (one call at most: it parks at its next Python call), even
    when the step sleeps (releases the GIL); after each step it runs for a slice; when steps stop it runs freely."""
    monkeypatch.setattr(compile_gate, "IDLE_S", 0.2)
    gate = CompileGate()
    with _step_starting_compile(gate) as work:
        during = work.calls
        time.sleep(0.1)  # a step that gives the GIL up: the parked compile still waits
        assert work.calls - during <= 1
    try:
        # SLICE_FRACTION of the step (>= 0.1 s), at most MAX_SLICE_S
        assert compile_gate.SLICE_FRACTION * 0.1 <= gate.lent_s <= compile_gate.MAX_SLICE_S
        assert not gate.open  # closed again after the slice: the caller's Python between steps runs alone
        for _ in range(3):  # back-to-back steps with work between them (a generate call's loop)
            with gate.step():
                assert _wait_for(lambda: gate.parked == 1, 2.0)
                during = work.calls
                time.sleep(0.02)
                assert work.calls - during <= 1
            during = work.calls
            time.sleep(0.01)  # the caller's own Python between steps: the compile stays parked
            assert work.calls - during <= 1
        assert gate.lent_s > 0 and gate.parked_s > 0
        idle_from = work.calls
        assert _wait_for(lambda: work.calls > idle_from + 1000, 5.0)  # no step for IDLE_S: it runs freely
        assert gate.open
    finally:
        work.finish()


def test_lent_slice_is_bounded(monkeypatch):
    """A slow step lends at most MAX_SLICE_S."""
    monkeypatch.setattr(compile_gate, "MAX_SLICE_S", 0.01)
    gate = CompileGate()
    with _step_starting_compile(gate) as work:
        time.sleep(0.2)
    try:
        assert gate.lent_s == pytest.approx(0.01)
    finally:
        work.finish()


def test_switch_interval_is_restored():
    """The short switch interval of a slice is the caller's again afterwards."""
    gate = CompileGate()
    before = sys.getswitchinterval()
    with _step_starting_compile(gate) as work:
        pass  # the step ends: a slice is lent, under the short switch interval
    try:
        assert gate.lent_s > 0 and sys.getswitchinterval() == before
    finally:
        work.finish()


def test_a_park_is_bounded(monkeypatch):
    """A step longer than PARK_MAX_S has the compile run alongside it (no deadlock on a lock the step needs)."""
    monkeypatch.setattr(compile_gate, "PARK_MAX_S", 0.2)
    monkeypatch.setattr(compile_gate, "IDLE_S", 0.05)
    gate = CompileGate()
    with _step_starting_compile(gate) as work:
        parked_at = work.calls
        assert _wait_for(lambda: work.calls > parked_at + 1000, 5.0)  # it ran on inside the step
    work.finish()


def test_full_collection_waits_until_the_decoding_thread_is_idle(monkeypatch):
    """A full garbage collection the compile thread starts (one C call holding the GIL for the whole heap) does not
    start during a step nor in the slice after it: it waits until no step has run for IDLE_S. Collections started
    outside the compile thread never wait."""
    import gc

    # A slice long enough (0.2 s) that the woken compile thread surely reaches its collection inside it, however busy
    # the machine: with the default tenth of a millisecond-long step it may be parked again first (at the gc callback's
    # own Python call), which also keeps the collection out of the step but never counts as a held collection.
    monkeypatch.setattr(compile_gate, "IDLE_S", 0.8)
    monkeypatch.setattr(compile_gate, "SLICE_FRACTION", 1.0)
    monkeypatch.setattr(compile_gate, "MAX_SLICE_S", 0.2)
    gate = CompileGate()
    done: list[float] = []

    def compile_like() -> None:
        with gate.compiling():
            gc.collect()  # generation 2
            done.append(time.monotonic())

    thread = threading.Thread(target=compile_like, daemon=True)
    with gate.step():
        thread.start()
        assert _wait_for(lambda: gate.parked == 1)
        gc.collect()  # the decoding thread is not held (while the held one waits, this returns at once)
        time.sleep(0.2)  # the step lasts >= 0.2 s, so its slice is MAX_SLICE_S
    step_end = gate.last_step_end
    assert not done  # the slice after the step was not enough: the collection waits for the caller to go idle
    assert gate.held_gcs == 1
    thread.join(5)
    assert done and done[0] - step_end >= compile_gate.IDLE_S
    assert gate.held_gcs == 0 and gate.parked == 0 and gate.open and gc.callbacks.count(gate._on_gc) == 0
