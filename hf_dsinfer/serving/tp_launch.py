"""``hf-dsinfer serve --tensor-parallel-size N``: the worker processes of a tensor-parallel server.

On one machine the server process is rank 0 and starts the other ``N - 1`` ranks itself, as vLLM's multiprocessing
executor does: each is ``python -m hf_dsinfer.serving.tp_launch PATH CONFIG`` with torchrun's environment variables
(``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), loads the model with
``tensor_parallel.tp_size = N`` (only its slices) and runs :func:`~.tp_worker.run_worker` until the server stops it.
Under ``torchrun`` (``WORLD_SIZE`` already set; several machines through its rendezvous) nothing is started: every
rank runs the same ``hf-dsinfer serve`` command, rank 0 serves HTTP and the others become workers
(docs/tensor_parallel.md).

Lifetime: the server watches its workers (a worker that exits makes the engine fail: ``/health`` answers 503); on
shutdown it stops the engine, sends the workers' stop message, waits for them and terminates any left. A worker
ignores SIGINT / SIGTERM (rank 0 stops it once drained); a spawned one exits by itself when the server process is
gone, and ``SIGKILL`` always works.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from ..log import logger

__all__ = ["SERVE_TIMEOUT", "TPWorkers", "launched_rank", "serve_worker", "threads_per_rank"]

#: How long a rank may wait in one collective. An idle server's engine sends a keep-alive to the workers every
#: ``tp_worker.KEEPALIVE_S`` seconds, so only a stuck rank reaches it.
SERVE_TIMEOUT = datetime.timedelta(minutes=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_rank(size: int) -> int | None:
    """This process's rank when a launcher (torchrun) started it with ``WORLD_SIZE == size``, else None (then the
    server starts its workers itself). Raises ``ValueError`` when the launcher's world is another size."""
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        return None
    if int(world) != size:
        raise ValueError(f"--tensor-parallel-size {size} but the launcher started WORLD_SIZE={world} processes: "
                         "start as many processes as --tensor-parallel-size (one model replica)")  # fmt: skip
    return int(os.environ.get("RANK", "0"))


def threads_per_rank(size: int, threads: int | None) -> int | None:
    """CPU threads of each rank: ``--threads`` if given; on a machine without CUDA the cores shared by the ranks."""
    if threads is not None:
        return threads
    import torch

    if torch.cuda.is_available():
        return None
    return max(1, (os.cpu_count() or 1) // size)


class TPWorkers:
    """The ``N - 1`` worker processes this server started (ranks 1 .. N-1 on this machine)."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.engine: Any = None  # rank 0's ServingEngine, once built (see watch)
        self._closing = False
        self._watcher: threading.Thread | None = None

    @classmethod
    def spawn(cls, size: int, path: str, config: dict, threads: int | None = None) -> TPWorkers:
        """Set this process up as rank 0 of ``size`` (environment variables) and start ranks 1 .. size-1 loading
        ``path`` with the inference ``config`` (a dict with ``tensor_parallel.tp_size == size``)."""
        port = _free_port()
        base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size),
                "LOCAL_WORLD_SIZE": str(size)}  # fmt: skip
        os.environ.update(base, RANK="0", LOCAL_RANK="0")
        threads = threads_per_rank(size, threads)
        procs = []
        for rank in range(1, size):
            env = {**os.environ, **base, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "HF_DSINFER_TP_PARENT": str(os.getpid())}  # fmt: skip
            cmd = [sys.executable, "-m", "hf_dsinfer.serving.tp_launch", path, json.dumps(config)]
            if threads is not None:
                cmd.append(str(threads))
            procs.append(subprocess.Popen(cmd, env=env))
        logger.warning("hf_dsinfer serve: started %d tensor-parallel worker process(es) (pids %s)", size - 1,
                       ", ".join(str(p.pid) for p in procs))  # fmt: skip
        return cls(procs)

    def dead(self) -> list[str]:
        """The workers that have exited: ``"rank R (pid P) exited with code C"`` each."""
        return [f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
                for r, p in enumerate(self.procs, start=1) if p.poll() is not None]  # fmt: skip

    def watch(self, interval: float = 0.5) -> None:
        """Watch the workers from now on. One that exits while the model loads ends the server (the other ranks
        would wait for it in a collective): the others are killed and this process exits with status 1. Once
        :attr:`engine` is set, one that exits fails the engine instead (``/health`` 503, requests refused)."""

        def loop() -> None:
            while not self._closing:
                gone = self.dead()
                if gone and not self._closing:
                    reason = "; ".join(gone)
                    if self.engine is None:
                        logger.error("hf_dsinfer serve: a tensor-parallel worker died while loading (%s); stopping",
                                     reason)  # fmt: skip
                        for proc in self.procs:
                            if proc.poll() is None:
                                proc.kill()
                        os._exit(1)
                    logger.error("hf_dsinfer serve: a tensor-parallel worker died: %s", reason)
                    self.engine.fail(RuntimeError(f"tensor-parallel worker {reason}"))
                    return
                time.sleep(interval)

        self._watcher = threading.Thread(target=loop, name="hf_dsinfer-tp-watch", daemon=True)
        self._watcher.start()

    def close(self, engine: Any = None, timeout: float = 30.0) -> None:
        """Stop the workers: the stop message through ``engine`` (when every worker still runs), then wait up to
        ``timeout`` seconds for them to exit, then kill what is left (at once when the group has failed)."""
        self._closing = True
        stopped = engine is not None and not self.dead() and engine.fatal_error is None
        if stopped:
            sender = threading.Thread(target=engine.stop_workers, daemon=True, name="hf_dsinfer-tp-stop")
            sender.start()
            sender.join(timeout)  # a broadcast to a wedged rank must not keep the server from exiting
        # without the stop message (a failed group) the workers would wait for the next step: terminate them now
        deadline = time.monotonic() + (timeout if stopped else 0.0)
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            if proc.poll() is None:  # workers ignore SIGTERM (see serve_worker): SIGKILL
                logger.warning("hf_dsinfer serve: worker pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait(10)


def serve_worker(path: str, config: dict, threads: int | None = None) -> None:
    """A worker rank of a tensor-parallel server: join the process group, load ``path`` with the inference ``config``
    (this rank's slices only), run the steps rank 0 sends until it stops the workers, leave the group.

    SIGINT and SIGTERM are ignored: a launcher (torchrun, a terminal's Ctrl-C) signals every rank at once, and a
    worker must keep following rank 0's steps while rank 0 drains, until rank 0's stop message (or a launcher's
    SIGKILL, or the server's own exit for a spawned worker)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ..generation.threads import apply_threads
    from ..parallel.groups import init_distributed
    from .tp_worker import run_worker

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    apply_threads(threads)
    init_distributed(timeout=SERVE_TIMEOUT)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, inference_config=config)
        logger.warning("hf_dsinfer serve: rank %d of %d is a tensor-parallel worker of %s (rank 0 serves HTTP)",
                       dist.get_rank(), dist.get_world_size(), path)  # fmt: skip
        run_worker(model)
    finally:
        dist.destroy_process_group()


def _exit_with_parent(parent: int) -> None:
    """End this process when the server (``parent``) is gone (killed without stopping its workers)."""

    def loop() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=loop, name="hf_dsinfer-parent-watch", daemon=True).start()


def main(argv: list[str]) -> None:
    """``python -m hf_dsinfer.serving.tp_launch PATH CONFIG_JSON [THREADS]`` (started by :meth:`TPWorkers.spawn`)."""
    parent = os.environ.get("HF_DSINFER_TP_PARENT")
    if parent is not None:
        _exit_with_parent(int(parent))
    path, config = argv[0], json.loads(argv[1])
    serve_worker(path, config, int(argv[2]) if len(argv) > 2 else None)


if __name__ == "__main__":
    main(sys.argv[1:])
