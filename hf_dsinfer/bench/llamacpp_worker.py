"""llama.cpp in a process of its own for ``bench --peer llamacpp``: the two engines must not share an OpenMP runtime.

torch and llama.cpp both link ``libgomp.so.1``; in one process the loader maps it once, so their thread teams come from
one runtime. Once llama.cpp's team exists the runtime counts more threads than cores and shortens how long idle
threads spin before sleeping, so every parallel region of ours then wakes its threads from sleep: SmolLM2's int4 step
on 2 threads took 21.7-23.0 ms after one llama.cpp run in the same process against 8.8 ms before it (load 0.7, nothing
else running; one thread: 12.8-13.3 ms both ways). Each engine in its own process is how users run them, and neither
slows the other. The child hosts one ``xllamacpp`` server per thread count and answers requests over a pipe; the times
reported are llama.cpp's own, taken inside the child, so the pipe costs nothing that is measured.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection

__all__ = ["LlamaCppProcess"]

#: Seconds a request may take (a 128-token run at 1 thread takes a few seconds; loading a GGUF less).
REQUEST_TIMEOUT_S = 600.0


def _serve(conn: Connection, path: str, max_len: int) -> None:
    """The child: ``(threads, request)`` in, ``("ok", answer)`` or ``("error", text)`` out, until ``None``."""
    servers = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        threads, req = msg
        try:
            import xllamacpp

            if threads not in servers:
                p = xllamacpp.CommonParams()
                p.model.path = path
                p.n_ctx, p.n_parallel, p.n_batch = max_len, 1, max_len
                p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
                p.verbosity = 0
                servers[threads] = xllamacpp.Server(p)  # listens on 127.0.0.1 only, a free port
            conn.send(("ok", servers[threads].handle_completions(req)))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which records the run as failed
            conn.send(("error", f"{type(e).__name__}: {e}"))


class LlamaCppProcess:
    """A child process serving llama.cpp completions of one GGUF file (started on first use)."""

    def __init__(self, gguf_path: str, max_len: int) -> None:
        self.path, self.max_len = str(gguf_path), max_len
        self._conn: Connection | None = None
        self._proc: multiprocessing.Process | None = None

    def completions(self, threads: int, request: dict) -> dict:
        """llama.cpp's answer to ``request`` (its ``/completion`` fields) run on ``threads`` threads."""
        if self._proc is None:
            ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch threads inherited
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=_serve, args=(child, self.path, self.max_len), daemon=True,
                                     name="hf_dsinfer-llamacpp")  # fmt: skip
            self._proc.start()
            child.close()
        try:
            self._conn.send((threads, request))
            if not self._conn.poll(REQUEST_TIMEOUT_S):
                self.close()
                raise RuntimeError(f"llama.cpp did not answer within {REQUEST_TIMEOUT_S:.0f} s")
            status, out = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as e:  # the child died (a crash in llama.cpp)
            code = self._proc.exitcode
            self.close()
            raise RuntimeError(f"llama.cpp's process exited (exit code {code})") from e
        if status != "ok":
            raise RuntimeError(f"llama.cpp: {out}")
        return out

    def close(self) -> None:
        """Stop the child (waits a few seconds, then terminates it)."""
        if self._proc is None:
            return
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._conn.close()
        self._proc = self._conn = None
