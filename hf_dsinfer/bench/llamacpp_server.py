"""llama.cpp's OpenAI-compatible server as a peer of the HTTP benchmark, without compiling llama.cpp.

``llama-cpp-python[server]`` builds llama.cpp from source (more than 40 minutes on a busy 2-core machine here);
``xllamacpp`` ships llama.cpp's own server (its C++ HTTP layer, slots and continuous batching) prebuilt in its wheel.
This module is the command :mod:`.http_peers` starts for the ``llamacpp`` peer when ``llama_cpp`` is not installed::

    python -m hf_dsinfer.bench.llamacpp_server --model SmolLM2.Q4_1.gguf --port 8080 --threads 2 --parallel 16

It serves until SIGTERM / SIGINT on 127.0.0.1 only. ``--ctx`` is the context of *one* request: llama.cpp divides its
KV cache (``n_ctx``) among its ``--parallel`` slots, so the cache gets ``ctx x parallel`` tokens.
"""

from __future__ import annotations

import argparse
import signal
import threading


def build_params(model: str, port: int, threads: int, ctx: int, parallel: int, alias: str):
    """xllamacpp's ``CommonParams`` of llama.cpp's server: loopback, continuous batching, ``parallel`` slots."""
    import xllamacpp

    p = xllamacpp.CommonParams()
    p.model.path = model
    p.model_alias = {alias} if isinstance(p.model_alias, set) else alias
    p.hostnames = ["127.0.0.1"]
    p.port = port
    p.n_parallel, p.cont_batching = parallel, True
    p.n_ctx = ctx * parallel  # split among the slots
    p.n_batch = max(512, ctx)
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
    p.verbosity = 0
    return p


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hf_dsinfer.bench.llamacpp_server", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024, help="context of one request (tokens)")
    ap.add_argument("--parallel", type=int, default=16, help="requests decoded at once (llama.cpp's slots)")
    ap.add_argument("--alias", default="bench", help="the model name requests carry")
    ns = ap.parse_args(argv)
    import xllamacpp

    server = xllamacpp.Server(build_params(ns.model, ns.port, ns.threads, ns.ctx, ns.parallel, ns.alias))
    print(f"llama.cpp server (xllamacpp) on {server.listening_address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(0.5):
        pass
    del server  # stops llama.cpp's HTTP threads


if __name__ == "__main__":
    main()
