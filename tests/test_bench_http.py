"""The HTTP benchmark (``hf-dsinfer bench --serve-url``) against our own server on a tiny random model, in process on
127.0.0.1: a small request set, the report's fields and values (counts, fixed output lengths, ordered percentiles,
goodput), the command line, and what a refused or unreachable server gives. Figures themselves are docs' business."""

import json

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hf_dsinfer[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install 'hf_dsinfer[serve]'")

from http_json import post_json  # noqa: E402
from tiny_models import save_tiny  # noqa: E402

from hf_dsinfer.bench.http_bench import api_base, bench_server, markdown, report_header, served_model  # noqa: E402
from hf_dsinfer.bench.http_load import (  # noqa: E402
    LoadSettings,
    RequestSpec,
    chat_requests,
    measure,
    parse_goodput,
    percentile,
    synthetic_requests,
)
from hf_dsinfer.cli import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 5  # output tokens per request


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, tokenizer folder, tokenizer) of our server on a tiny llama with a plain chat template."""
    from hf_dsinfer.serving import ServingEngine
    from hf_dsinfer.serving.serve_cli import load_for_serving
    from hf_dsinfer.serving.server import OpenAIServer

    path = save_tiny("llama", tmp_path_factory.mktemp("tiny"))
    model, tok = load_for_serving(path, {"dtype": "fp32", "max_out_tokens": 96})
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    engine = ServingEngine(model, block_size=16, max_batch_tokens=64, max_num_seqs=8)
    server = OpenAIServer(engine, tok, "tiny")
    base = server.start("127.0.0.1", 0)
    try:
        yield base, path, tok
    finally:
        server.stop()


def _check_run(run: dict, requests: int, new: int) -> None:
    assert run["requests"] == run["completed"] == requests and run["failed"] == 0, run["errors"]
    assert run["output_len_min"] == run["output_len_max"] == run["output_len_asked"] == new  # fixed lengths
    assert run["output_tokens"] == requests * new and run["counted_by"] == ["usage"]
    assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["duration_s"])
    assert run["request_throughput"] == pytest.approx(requests / run["duration_s"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = run[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
    assert run["ttft_ms"]["p50"] <= run["e2el_ms"]["p50"]
    assert len(run["load_before"]) == len(run["load_after"]) == 3


def test_sweep_against_our_server(served):
    base, _, tok = served
    specs = synthetic_requests(tok, 6, 12, NEW, seed=3)
    assert [s.prompt_tokens for s in specs] == [12] * 6  # the synthetic prompts hold the length asked for
    assert specs == synthetic_requests(tok, 6, 12, NEW, seed=3)  # seeded: the same set every time
    section = bench_server(api_base(base + "/completions"), served_model(base), specs, chat=False,
                           concurrencies=[1, 3], rates=[40.0], slos={"ttft": 1e6, "e2el": 1e6}, seed=0,
                           request_timeout=60, max_seconds=120)  # fmt: skip
    assert section["length_control"] == "ignore_eos" and section["refused"] == [], section["refused"]
    runs = section["runs"]
    assert [(r["concurrency"], r["rate"]) for r in runs] == [(1, None), (3, None), (None, 40.0)]
    for run in runs:
        _check_run(run, 6, NEW)
        assert run["goodput"] == pytest.approx(run["request_throughput"])  # objectives every request meets
        assert run["itl_ms"]["p50"] > 0 and run["tpot_ms"]["mean"] > 0
    report = {**report_header(specs, "synthetic", False, 1, 0), "servers": [section]}
    table = markdown(report)
    assert table.count("\n| ") == 1 + len(runs) and "concurrency 3" in table and "rate 40/s" in table


def test_chat_set_and_an_objective_nobody_meets(served):
    base, _, tok = served
    specs = chat_requests(tok, 4, NEW, seed=0)
    assert all(isinstance(s.prompt, list) and s.prompt_tokens > 0 for s in specs)
    settings = LoadSettings(url=base + "/chat/completions", model="tiny", chat=True, slos=parse_goodput(["tpot:1e-6"]),
                            request_timeout=60, max_seconds=120)  # fmt: skip
    run = measure(settings, specs, concurrency=2)
    _check_run(run, 4, NEW)
    assert run["goodput"] == 0.0


def test_cli_writes_the_report(served, tmp_path):
    base, path, _ = served
    argv = ["bench", "--serve-url", base, "--tokenizer", path, "--num-prompts", "4", "--prompt-len", "8",
            "--new-tokens", str(NEW), "--concurrency", "2", "--goodput", "ttft:100000", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "bench-http.json").read_text())
    assert report["mode"] == "http" and report["requests"] == 4 and report["endpoint"] == "completions"
    (server,) = report["servers"]
    assert server["model"] == "tiny" and server["url"].endswith("/v1/completions")
    _check_run(server["runs"][0], 4, NEW)
    assert (tmp_path / "bench-http.md").read_text().startswith("HTTP benchmark")


def test_bad_flags_and_an_unreachable_server(tmp_path, served):
    _, path, tok = served
    with pytest.raises(ValueError, match="NAME among ttft, tpot, e2el"):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match="not a number"):
        parse_goodput(["ttft:fast"])
    with pytest.raises(SystemExit, match="numbers > 0"):
        main(["bench", "--serve-url", "http://127.0.0.1:9/v1", "--tokenizer", path, "--concurrency", "0"])
    from hf_dsinfer.bench.http_peers import free_port

    dead = f"http://127.0.0.1:{free_port()}/v1/completions"  # nothing listens there
    settings = LoadSettings(url=dead, model="x", chat=False, request_timeout=5, max_seconds=30)
    run = measure(settings, [RequestSpec("hello", 3, 1)] * 2, concurrency=2)
    assert run["completed"] == 0 and run["failed"] == 2 and run["errors"] and run["ttft_ms"]["p50"] is None


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    values = [5.0, 1.0, 9.0, 3.5, 7.25, 2.0, 8.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_peer_that_cannot_run_is_skipped_with_its_reason(monkeypatch):
    import importlib.util

    from hf_dsinfer.bench import http_peers

    real = importlib.util.find_spec
    absent = {"llama_cpp", "xllamacpp"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a))
    peer = http_peers.peer_command("llamacpp", "/nowhere", __file__, 1, 256)
    assert "neither llama-cpp-python nor xllamacpp is installed" in peer.skip_reason
    absent.discard("xllamacpp")  # llama.cpp's own server from the xllamacpp wheel, on the slots the sweep needs
    peer = http_peers.peer_command("llamacpp", "/nowhere", __file__, 2, 256, parallel=4)
    assert peer.argv[1:3] == ["-m", "hf_dsinfer.bench.llamacpp_server"]
    assert peer.argv[peer.argv.index("--parallel") + 1] == "4" and peer.argv[peer.argv.index("--threads") + 1] == "2"
    assert "no GGUF file" in http_peers.peer_command("llamacpp", "/m", "/no.gguf", 1, 256).skip_reason
    ours = http_peers.peer_command("ours-q4", "/m", None, 2, 256)
    assert ours.argv[1:4] == ["-m", "hf_dsinfer", "serve"] and '"zero_point": "float"' in ours.argv[-1]
    assert ours.env["OMP_NUM_THREADS"] == "2" and ours.base_url.startswith("http://127.0.0.1:")
    with pytest.raises(ValueError, match="unknown server peer"):
        http_peers.peer_command("vllm", "/m", None, 1, 256)


def test_a_server_refusing_ignore_eos_is_asked_with_min_tokens_then_nothing():
    """transformers serve answers unknown fields with 422: the probe falls back and records each refusal."""
    import asyncio

    from hf_dsinfer.bench.http_load import httpx, probe_length_control

    seen = []

    def handler(request):
        body = json.loads(request.content)
        seen.append(sorted(k for k in ("ignore_eos", "min_tokens", "stream_options") if k in body))
        if "ignore_eos" in body or "min_tokens" in body:
            return httpx.Response(422, json={"detail": "Unexpected fields"})
        chunks = [{"choices": [{"text": t}]} for t in ("a", "b", "c")] + [{"choices": [], "usage": {
            "completion_tokens": 3}}]  # fmt: skip
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async def probe():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await probe_length_control(client, "http://peer/v1/completions", RequestSpec("hi", 3, 1), "m", False)

    found = asyncio.run(probe())
    assert found["length_control"] == "none" and found["stream_usage"] and found["probe_output_tokens"] == 3
    assert [r["length_control"] for r in found["refused"]] == ["ignore_eos"] * 2 + ["min_tokens"] * 2
    assert all(r["error"].startswith("HTTP 422") for r in found["refused"])
    assert seen[-1] == ["stream_options"]


def test_llamacpp_server_peer_answers_on_loopback():
    """The ``llamacpp`` peer without llama-cpp-python: llama.cpp's own server from the xllamacpp wheel, started as the
    HTTP benchmark starts it, answers a chat request with the asked number of tokens and stops on SIGTERM."""
    pytest.importorskip("xllamacpp", reason="xllamacpp not installed (pip install -e '.[peers]')")
    from hf_dsinfer.bench import http_peers
    from hf_dsinfer.real_model import smollm2_gguf

    try:
        gguf = str(smollm2_gguf())
    except Exception as e:  # noqa: BLE001 - the wheel with the GGUF is not installed
        pytest.skip(f"no SmolLM2 GGUF: {e}")
    peer = http_peers.peer_command("llamacpp", "/unused", gguf, 1, 256, parallel=2)
    if "hf_dsinfer.bench.llamacpp_server" not in peer.argv:
        pytest.skip("llama-cpp-python is installed: the peer runs its server instead")
    assert peer.skip_reason is None
    with http_peers.RunningPeer(peer, ready_timeout=120) as running:
        status, body = post_json(running.base_url + "/chat/completions", {
            "model": "bench", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True})  # fmt: skip
        assert status == 200 and body["usage"]["completion_tokens"] == 5
        proc = running.proc
    assert proc.poll() is not None  # stopped with the context
