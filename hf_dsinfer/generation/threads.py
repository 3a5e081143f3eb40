"""CPU threads: the ``threads`` setting (``InferenceConfig.threads``, ``--threads``) and the busy-machine warning.

torch runs CPU ops on one OpenMP thread team per process, of ``torch.get_num_threads()`` threads (by default one per
core, or ``OMP_NUM_THREADS``). The threads of a team wait for each other at the end of every parallel region; when
other processes hold the cores, a thread that lost its core makes the others wait (spinning first, then sleeping), so
on a busy machine more threads can be several times slower than one. Setting ``threads`` calls
``torch.set_num_threads`` for the whole process (it is torch's one process-wide setting); it overrides
``OMP_NUM_THREADS`` for torch's ops, which only gives the default.
"""

from __future__ import annotations

import os

import torch

from ..log import logger, warn_once

__all__ = ["apply_threads", "available_cores", "busy_machine", "load_average", "warn_if_busy"]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average (runnable processes, averaged), or None where the OS has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_machine() -> tuple[float, int] | None:
    """``(load, cores)`` when the 1-minute load average is above the cores available here, else None."""
    load, cores = load_average(), available_cores()
    if load is not None and load > cores:
        return load, cores
    return None


def warn_if_busy(threads: int | None = None, how: str = "--threads 1") -> bool:
    """Warn once per process when the machine is oversubscribed and torch would use more than one thread; returns
    whether it warned. ``threads``: the count that will be used (None: torch's current one); ``how``: how the reader
    sets the count where they are (a CLI flag, or the config field)."""
    threads = torch.get_num_threads() if threads is None else threads
    busy = busy_machine()
    if busy is None or threads <= 1:
        return False
    load, cores = busy
    passive = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    waiting = "sleep while they wait (OMP_WAIT_POLICY=PASSIVE), which helps" if passive else "spin while they wait"
    warn_once(
        f"hf_dsinfer: this machine is busy (1-minute load average {load:.1f} on {cores} cores) and torch uses "
        f"{threads} threads per op: threads that lose their core make the others wait, which can be several times "
        f"slower than one thread; its threads {waiting}. Use {how} (or fewer threads than free cores) while the "
        "load lasts."
    )
    return True


def apply_threads(threads: int | None) -> None:
    """Set torch's CPU threads for this process to ``threads`` (None: leave them as they are).

    Called when a model is loaded with an inference config (``InferenceConfig.threads``). Only the command line warns
    about a busy machine (:func:`warn_if_busy`, at its start); a library call logs the change at info level.
    """
    if threads is not None and threads != torch.get_num_threads():
        logger.info("hf_dsinfer: torch CPU threads %d -> %d (the threads setting)", torch.get_num_threads(), threads)
        torch.set_num_threads(threads)
