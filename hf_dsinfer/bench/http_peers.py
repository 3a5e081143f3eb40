"""Servers started side by side for the HTTP benchmark: ours (``hf-dsinfer serve``), ``transformers serve`` (plain
and ``--continuous-batching``) and llama.cpp's OpenAI server on a GGUF file (``llama-cpp-python[server]`` where it is
installed, else llama.cpp's own server prebuilt in ``xllamacpp``'s wheel: :mod:`.llamacpp_server`).

Each peer runs as a subprocess on a free loopback port with the same CPU thread count (``OMP_NUM_THREADS``, and
llama.cpp's ``--n_threads``), is waited for until ``GET /v1/models`` answers (bounded), and is stopped (SIGTERM, then
SIGKILL) when its load is done. A peer that cannot start (not installed, exits, never ready) is reported as skipped with
the reason and the tail of its log; the other peers still run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

#: ours-q4: our server on int4 groups of 32 with a float zero point, GGUF Q4_1's layout (docs/quantization.md), the
#: weight format of llama.cpp's peer on the Q4_1 GGUF. transformers-cb-sized: continuous batching with an explicit
#: cache (its default sizing hung under concurrent streams on CPU: shared/pitfalls.md).
PEER_NAMES = ("ours", "ours-q4", "transformers", "transformers-cb", "transformers-cb-sized", "llamacpp")
Q4_1_CONFIG = {"quant": {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric", "group_size": 32,
                                                     "zero_point": "float"}}}  # fmt: skip


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound then released: a tiny race with other processes is possible)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Peer:
    """A server to start: its command line, environment and where it answers once started."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    model_id: str = "bench"  # the ``model`` field its requests carry
    skip_reason: str | None = None  # set when it cannot run here (not installed, no GGUF file)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def peer_command(name: str, model: str, gguf: str | None, threads: int, max_model_len: int, parallel: int = 16) -> Peer:
    """The command line of peer ``name`` (one of :data:`PEER_NAMES`) serving ``model`` (an HF folder); ``parallel``:
    the requests llama.cpp's server decodes at once (its slots; our server and transformers' take what comes)."""
    port = free_port()
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name in ("ours", "ours-q4"):
        argv = [sys.executable, "-m", "hf_dsinfer", "serve", model, *host, "--served-model-name", "bench",
                "--max-model-len", str(max_model_len)]  # fmt: skip
        if name == "ours-q4":
            argv += ["--inference-config", json.dumps(Q4_1_CONFIG)]
        return Peer(name, argv, port, env)
    if name.startswith("transformers"):
        exe = shutil.which("transformers", path=os.path.dirname(sys.executable)) or shutil.which("transformers")
        argv = [exe or "transformers", "serve", model, *host, "--dtype", "float32", "--device", "cpu"]
        if name != "transformers":
            argv.append("--continuous-batching")
        if name == "transformers-cb-sized":
            argv += ["--cb-block-size", "256", "--cb-num-blocks", "256"]
        return Peer(name, argv, port, env, model, None if exe else "the `transformers` command is not installed")
    if name == "llamacpp":
        reason = None if not gguf or os.path.exists(gguf) else f"no GGUF file ({gguf!r}); pass --gguf"
        reason = reason or (None if gguf else "no GGUF file; pass --gguf")
        if importlib.util.find_spec("llama_cpp") is not None:  # llama-cpp-python[server]
            argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), *host, "--n_threads", str(threads),
                    "--n_ctx", str(max_model_len), "--model_alias", "bench"]  # fmt: skip
        else:  # llama.cpp's own C++ server, prebuilt in the xllamacpp wheel (.llamacpp_server)
            if reason is None and importlib.util.find_spec("xllamacpp") is None:
                reason = ("neither llama-cpp-python nor xllamacpp is installed (pip install xllamacpp, or "
                          "pip install -e '.[peers]'; llama-cpp-python[server] compiles llama.cpp)")  # fmt: skip
            argv = [sys.executable, "-m", "hf_dsinfer.bench.llamacpp_server", "--model", str(gguf), "--port", str(port),
                    "--threads", str(threads), "--ctx", str(max_model_len), "--parallel", str(parallel)]  # fmt: skip
        return Peer(name, argv, port, env, "bench", reason)
    raise ValueError(f"unknown server peer {name!r}; choose among {', '.join(PEER_NAMES)}")


class RunningPeer:
    """A started peer: ``with RunningPeer(peer, timeout) as p: ... p.base_url``; its output goes to a log file."""

    def __init__(self, peer: Peer, ready_timeout: float = 300.0):
        self.peer, self.ready_timeout = peer, ready_timeout
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"hf_dsinfer-bench-{peer.name}-", suffix=".log",
                                               delete=False)  # fmt: skip
        self.startup_s: float | None = None

    def __enter__(self) -> RunningPeer:
        env = {**os.environ, **self.peer.env}
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.peer.argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # fmt: skip
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return self.peer.base_url

    def log_tail(self, chars: int = 1500) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-chars:]

    def _wait_ready(self, t0: float) -> None:
        while time.monotonic() - t0 < self.ready_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.peer.name} exited with code {self.proc.returncode} before it was ready: "
                                   f"{self.log_tail(800)}")  # fmt: skip
            try:
                with urllib.request.urlopen(self.peer.base_url + "/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.peer.name} was not ready after {self.ready_timeout:.0f} s: {self.log_tail(800)}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the peer's process group, SIGKILL after ``timeout`` s; the log file is kept for the report."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
