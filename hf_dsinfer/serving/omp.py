"""OpenMP worker threads when the engine steps on its own thread (CPU, GNU OpenMP: torch's Linux wheels).

Every OS thread that runs an OpenMP parallel region (any multi-threaded torch op on CPU) gets its own team of worker
threads, and the team stays alive, idle, as long as that thread lives. GNU OpenMP spin-waits at its barriers only
while it manages no more worker threads than there are CPUs; beyond that it waits on futexes (a sleep and a wake-up
per parallel region). The thread that loaded the model (the main thread) already owns a team, so once the engine's
stepping thread makes its own, every small op of every step pays a futex round trip: measured on 2 cores with 2
torch threads (tiny preset, 2026-11-25), continuous batching stepped at ~2000 generated tokens/s on its own thread
against ~3100 when the same steps ran on the main thread, and ~3250 on its own thread once the main thread's idle
team was released.

:func:`release_idle_openmp_workers` releases the calling thread's idle team (``omp_pause_resource_all``, OpenMP 5.0).
:meth:`ServingEngine.start <hf_dsinfer.serving.ServingEngine.start>` calls it from the thread that starts the engine
(the one that will not step it). If that thread runs torch ops again, GNU OpenMP gives it a new team: nothing breaks,
only the throttled spinning returns while both teams live.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ..log import logger

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release threads, keep what can be rebuilt cheaply


@functools.lru_cache(maxsize=1)
def _pause_function() -> ctypes._CFuncPtr | None:
    """``omp_pause_resource_all`` of the GNU OpenMP runtime this process loaded, or None (another runtime, none)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same library, not a second copy
            fn = lib.omp_pause_resource_all
        except (OSError, AttributeError):  # libgomp older than GCC 9 has no pause API
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def release_idle_openmp_workers(device: torch.device | str = "cpu") -> bool:
    """Release the calling thread's idle OpenMP worker threads before another thread takes over the CPU work.

    Does something only for a CPU ``device`` with more than one torch thread and GNU OpenMP (see the module
    docstring); returns whether a team was released. Never call it from inside a parallel region (torch does not
    call Python from one).
    """
    if torch.device(device).type != "cpu" or torch.get_num_threads() < 2:
        return False
    fn = _pause_function()
    if fn is None:
        return False
    released = fn(_OMP_PAUSE_SOFT) == 0
    logger.debug("hf_dsinfer serving: released the starting thread's idle OpenMP workers: %s", released)
    return released
