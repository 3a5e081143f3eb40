"""The background compile's priority, and the eager steps' thread count while it runs.

A compile of the CPU decode step runs beside the eager steps it will replace (:mod:`.compiled_cpu`): its thread runs
at the lowest CPU priority (:func:`compile_nice`, :func:`lower_priority`) and the eager steps meanwhile leave it a core
(:func:`leave_a_core`). The measurements behind each default are beside it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

from ..log import logger

__all__ = ["COMPILE_NICE", "NICE_ENV", "compile_nice", "leave_a_core", "lower_priority"]


@contextlib.contextmanager
def leave_a_core() -> Iterator[None]:
    """Run the enclosed eager step on one thread fewer (at least one): a background compile keeps a core busy, and
    an OpenMP team of torch's full thread count then waits at every barrier for the thread that lost its core.
    SmolLM2 on 2 cores, default threads, a compile running (fresh compile cache, quiet machine): eager steps at 2
    threads took 125-196 ms per token against HF eager's 53-56 ms; at 1 thread 47-64 ms, and the compile took as
    long (70 s against 71-73 s). ``torch.set_num_threads`` sets the calling thread's OpenMP team size, so only the
    decoding thread is affected, and it is restored after the step."""
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


#: Nice value of the background compile's thread (Linux sets priorities per thread; the C++ compiler processes and
#: helper threads it starts inherit it, inductor's compile thread pool included, which lives on in the process). 19,
#: the lowest: when the eager steps and the compile want the same core, the kernel runs the step first. SmolLM2 on 2
#: cores at a load of 2-11 (loaded figures, docs/generation.md): calls while compiling took 130-1198 ms per
#: token at normal priority, 42-1385 ms at 19 (4 runs; HF eager alone: 134-194 ms); the compile took 228-523 s
#: against 284-760 s.
#: ``HF_DSINFER_COMPILE_NICE`` overrides it (0: the caller's priority).
COMPILE_NICE = 19
NICE_ENV = "HF_DSINFER_COMPILE_NICE"


def compile_nice() -> int:
    """The nice value background compiles run at: :data:`NICE_ENV` when set, else :data:`COMPILE_NICE`."""
    value = os.environ.get(NICE_ENV, "").strip()
    if not value:
        return COMPILE_NICE
    try:
        nice = int(value)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ValueError(f"{NICE_ENV} must be a nice value from 0 (the caller's priority) to 19 (the lowest), got "
                         f"{value!r}; unset it for the default ({COMPILE_NICE})")  # fmt: skip
    return nice


def lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority to ``nice`` (where the OS has per-thread priorities: Linux).

    An unprivileged process can lower a priority but never raise it back, so this is for a thread that ends after
    its work: the background compile's. Never raises: where it is refused, the compile runs at the usual priority."""
    if nice <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    try:
        tid = threading.get_native_id()  # on Linux PRIO_PROCESS with a thread id sets that thread only
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError as e:  # a sandbox that refuses it
        logger.info("hf_dsinfer: could not lower the background compile's priority (%s)", e)
