"""``hf-dsinfer serve`` as an operator runs it: /metrics against what happened, /health, API key, CORS, served name and
context defaults, backpressure (429), KV sizing, graceful drain in process and on SIGTERM of the real command.

A tiny random llama (tests/tiny_models.py) on 127.0.0.1; every wait is bounded."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
pytest.importorskip("prometheus_client", reason="the serve extra is not installed: pip install -e '.[serve]'")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tiny_models import save_tiny  # noqa: E402

from hf_dsinfer.serving.serve_cli import build_server  # noqa: E402
from hf_dsinfer.serving.sizing import CPU_KV_CACHE_BYTES, parse_bytes  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "test-key"


def call(url: str, body=None, key: str | None = KEY, method: str | None = None, headers=None, timeout=60.0):
    """(status, headers, parsed JSON or text) of one HTTP call."""
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, raw = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, dict(e.headers), e.read().decode()
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw


def scrape(root: str) -> dict[str, float]:
    """Every sample of GET /metrics as ``{name{labels}: value}`` (labels other than model_name kept)."""
    status, _, text = call(root + "/metrics", key=None)
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def settled(root: str, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once no request is running or waiting (the engine's bookkeeping trails the last answer by a step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(root)
        if m["hf_dsinfer:num_requests_running"] == 0 and m["hf_dsinfer:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("ops") / "tiny-llama")


@pytest.fixture(scope="module")
def served(tiny_path):
    server = build_server(tiny_path, {"dtype": "fp32"}, api_key=KEY, max_num_seqs=2, max_num_queued_reqs=4,
                          allowed_origins=["http://ok.example"])  # fmt: skip
    base = server.start("127.0.0.1", 0)
    try:
        yield server, base, base[: -len("/v1")]
    finally:
        server.stop()


def test_defaults_fit_the_model(served, tiny_path):
    server, base, _ = served
    assert server.model_name == "tiny-llama"  # the folder's name, not the path
    status, _, models = call(base + "/models")
    assert status == 200 and models["data"][0]["id"] == "tiny-llama"
    assert models["data"][0]["max_model_len"] == 256 == server.engine.runner.max_positions  # max_position_embeddings
    status, _, out = call(base + "/completions", {"model": str(tiny_path), "prompt": "Hello", "max_tokens": 3})
    assert status == 200 and out["model"] == "tiny-llama"  # the full path is accepted too
    # The CPU default: max_num_seqs x max_model_len tokens (well under the 1 GiB ceiling here).
    assert server.engine.runner.blocks.num_blocks == 2 * 256 // 16


def test_kv_sizing_options(tiny_path):
    from hf_dsinfer.serving.sizing import kv_bytes_per_token, plan_kv_cache

    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("1.5G") == 1_500_000_000 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="kv-cache-memory"):
        parse_bytes("lots")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, inference_config={"dtype": "fp32", "max_out_tokens": 256})
    bpt, _ = kv_bytes_per_token(model)
    assert bpt == 2 * 4 * 2 * (2 * 16)  # K and V, fp32, 2 layers, 2 KV heads of 16
    args = dict(block_size=16, max_num_seqs=64, max_model_len=256, max_batch_tokens=256)
    assert plan_kv_cache(model, **args).num_blocks == 64 * 256 // 16  # fits the 1 GiB ceiling: what the limits need
    assert plan_kv_cache(model, **args, kv_cache_memory=1 << 20).num_blocks == (1 << 20) // (bpt * 16)
    assert plan_kv_cache(model, **args, num_blocks=40).num_blocks == 40
    with pytest.raises(ValueError, match="max-model-len"):
        plan_kv_cache(model, **args, kv_cache_memory=bpt * 100)  # less than one request of 256 tokens
    huge = plan_kv_cache(model, **{**args, "max_num_seqs": 10**6})
    assert huge.nbytes <= CPU_KV_CACHE_BYTES and "capped" in huge.reason


def test_max_model_len(tiny_path):
    from hf_dsinfer.serving.serve_cli import serving_inference_config

    assert serving_inference_config(tiny_path, {"dtype": "fp32"}).max_out_tokens == 256
    assert serving_inference_config(tiny_path, {"dtype": "fp32"}, max_model_len=128).max_out_tokens == 128
    assert serving_inference_config(tiny_path, {"max_out_tokens": 64}).max_out_tokens == 64
    with pytest.raises(ValueError, match="longer than the model's context"):
        serving_inference_config(tiny_path, None, max_model_len=512)
    with pytest.raises(ValueError, match="disagree"):
        serving_inference_config(tiny_path, {"max_out_tokens": 64}, max_model_len=128)


def test_context_of_a_folder_saved_with_an_inference_config(tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_dsinfer.serving.serve_cli import serving_inference_config

    model = AutoModelForCausalLM.from_pretrained(tiny_path, inference_config={"dtype": "fp32", "max_out_tokens": 96})
    model.save_pretrained(tmp_path / "saved")
    saved = serving_inference_config(str(tmp_path / "saved"))
    assert saved.max_out_tokens == 96 and str(saved.dtype) in ("fp32", "float32")  # the saved config, its context
    assert serving_inference_config(str(tmp_path / "saved"), max_model_len=200).max_out_tokens == 200  # the flag wins


REFUSED = "hf_dsinfer:admission_rejections_total{{reason={}}}"


def test_api_key_and_open_probes(served):
    _, base, root = served
    before = scrape(root)[REFUSED.format("unauthorized")]
    assert call(base + "/models", key=None)[0] == 401
    status, headers, body = call(base + "/completions", {"model": "tiny-llama", "prompt": "Hi"}, key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and headers["www-authenticate"] == "Bearer"
    assert call(base + "/models")[0] == 200
    assert call(root + "/health", key=None)[0] == 200
    assert call(root + "/metrics", key=None)[0] == 200
    assert scrape(root)[REFUSED.format("unauthorized")] == before + 2  # the two 401s above, counted by reason


def test_cors(served):
    _, base, _ = served
    pre = {"Origin": "http://ok.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    status, headers, _ = call(base + "/completions", key=None, method="OPTIONS", headers=pre)
    assert status == 200 and headers["access-control-allow-origin"] == "http://ok.example"
    status, headers, _ = call(base + "/completions", key=None, method="OPTIONS", headers={**pre, "Origin": "http://x"})
    assert status == 400 and "access-control-allow-origin" not in headers


def test_metrics_match_what_happened(served):
    server, base, root = served
    before = settled(root)
    prompts = ["Hello world", "The quick brown fox jumps", "DeepSpeed"]
    answers = [call(base + "/completions", {"model": "tiny-llama", "prompt": p, "max_tokens": 5 + i})
               for i, p in enumerate(prompts)]  # fmt: skip
    assert all(status == 200 for status, _, _ in answers)
    after = settled(root)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    usage = [body["usage"] for _, _, body in answers]
    generated = sum(u["completion_tokens"] for u in usage)
    assert delta("hf_dsinfer:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta("hf_dsinfer:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta("hf_dsinfer:generation_tokens_total") == generated
    reasons = [body["choices"][0]["finish_reason"] for _, _, body in answers]
    for reason in ("stop", "length"):
        assert delta(f"hf_dsinfer:request_success_total{{finished_reason={reason}}}") == reasons.count(reason)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):  # fmt: skip
        assert delta(f"hf_dsinfer:{hist}_count") == 3, hist
    assert delta("hf_dsinfer:request_generation_tokens_sum") == generated
    assert delta("hf_dsinfer:inter_token_latency_seconds_count") == generated - 3  # one gap between two tokens
    assert delta("hf_dsinfer:e2e_request_latency_seconds_sum") >= delta("hf_dsinfer:time_to_first_token_seconds_sum")
    assert after["hf_dsinfer:kv_cache_usage_perc"] == 0.0  # nothing holds a block (cached prefixes count as free)
    assert "hf_dsinfer:spec_decode_num_draft_tokens_total" not in after  # no speculation in this engine


def test_stop_string_counts_as_stop(served):
    _, base, root = served
    for prompt in ("The quick brown fox", "DeepSpeed inference", "Hello world"):
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "temperature": 0}
        status, _, full = call(base + "/completions", body)
        text = full["choices"][0]["text"]
        # A character that first appears after the start: the text must end right before it.
        ok = [ch for i, ch in enumerate(text) if i and ch.isprintable() and ch != "\ufffd" and ch not in text[:i]]
        if status == 200 and ok:
            stop = ok[0]
            break
    else:
        pytest.skip("the tiny model's greedy texts have no usable stop string")
    before = settled(root)
    status, _, cut = call(base + "/completions", {**body, "stop": [stop]})
    assert (
        status == 200
        and cut["choices"][0]["finish_reason"] == "stop"
        and cut["choices"][0]["text"] == text[: text.find(stop)]
    )
    after = settled(root)
    label = "hf_dsinfer:request_success_total{{finished_reason={}}}"
    assert after[label.format("stop")] - before[label.format("stop")] == 1
    assert after[label.format("abort")] == before[label.format("abort")]


def test_backpressure_refuses_at_once(served):
    server, base, root = served
    refused_before = scrape(root)
    results: list = []
    body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4}
    with server.engine.paused():  # no step runs: admitted requests stay in flight while the burst arrives
        threads = [threading.Thread(target=lambda: results.append(call(base + "/completions", body)))
                   for _ in range(8)]  # fmt: skip
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(results) < 4 and time.monotonic() < deadline:  # the 4 refusals come back while paused
            time.sleep(0.02)
        refused = list(results)
    for t in threads:
        t.join(60)
    assert len(refused) == 4 and all(status == 429 for status, _, _ in refused)
    status, headers, err = refused[0]
    assert headers["retry-after"] == "1" and err["error"]["code"] == "queue_full"
    done = [r for r in results if r[0] == 200]
    assert len(done) == 4 and all(b["choices"][0]["finish_reason"] in ("stop", "length") for _, _, b in done)
    deadline = time.monotonic() + 10  # the gate counts a request out after its last byte went: a client can be faster
    while server.gate.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.gate.in_flight == 0
    refused_after = scrape(root)  # the 4 refusals are exported by reason; nothing else was refused meanwhile
    for reason, added in (("max_num_queued_reqs", 4), ("shutting_down", 0), ("unauthorized", 0)):
        assert refused_after[REFUSED.format(reason)] == refused_before[REFUSED.format(reason)] + added


def test_health_503_after_the_engine_dies(tiny_path):
    server = build_server(tiny_path, {"dtype": "fp32"}, max_num_seqs=2)
    base = server.start("127.0.0.1", 0)
    root = base[: -len("/v1")]
    try:
        assert call(root + "/health")[0] == 200

        def broken_forward(plan):
            raise RuntimeError("simulated device failure")

        server.engine.runner.run = broken_forward  # the next step raises on the stepping thread
        status, _, body = call(base + "/completions", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4})
        assert status == 503 and "simulated device failure" in body["error"]["message"]
        status, _, body = call(root + "/health")
        assert status == 503 and "simulated device failure" in body["reason"]
        assert call(base + "/completions", {"model": "tiny-llama", "prompt": "Hi"})[0] == 503  # refused, not hung
    finally:
        server.stop()


def test_drain_lets_running_requests_finish(tiny_path):
    server = build_server(tiny_path, {"dtype": "fp32"}, max_num_seqs=2)
    base = server.start("127.0.0.1", 0)
    root = base[: -len("/v1")]
    body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 6}
    results: list = []
    with server.engine.paused():
        running = threading.Thread(target=lambda: results.append(call(base + "/completions", body)))
        running.start()
        deadline = time.monotonic() + 30
        while server.gate.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        stopper = threading.Thread(target=server.stop, kwargs={"drain_timeout": 30})
        stopper.start()
        while not server.gate.draining and time.monotonic() < deadline:
            time.sleep(0.02)
        assert call(root + "/health")[0] == 503
        status, _, err = call(base + "/completions", body)
        assert status == 503 and err["error"]["code"] == "server_shutting_down"
    running.join(60)
    stopper.join(60)
    assert not stopper.is_alive() and results[0][0] == 200  # finished normally after admissions stopped
    assert results[0][2]["choices"][0]["finish_reason"] in ("stop", "length")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_then_exits_0(tiny_path):
    port = _free_port()
    root = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hf_dsinfer", "serve", str(tiny_path), "--port", str(port), "--inference-config",
           '{"dtype": "fp32"}', "--shutdown-timeout", "60", "--tool-call-parser", "json"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if call(root + "/health", timeout=2)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = json.dumps(
            {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
        ).encode()
        req = urllib.request.Request(root + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as stream:
            first = stream.readline()
            assert first.startswith(b"data: ")
            proc.send_signal(signal.SIGTERM)  # while the stream is open
            rest = stream.read().decode()
        events = [json.loads(line[6:]) for line in (first.decode() + rest).splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        assert not any("error" in e for e in events), events[-1]
        finish = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
        assert "length" in finish and rest.rstrip().endswith("[DONE]")  # all 200 tokens, after the SIGTERM
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read()
        assert "SIGTERM" in log and "refusing new requests" in log
        # the access log is on by default on the command line (at info, whatever transformers' verbosity)
        assert "hf_dsinfer request cmpl-" in log and "completion_tokens=200" in log and "finish=length" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_every_serve_option_is_documented():
    import argparse
    from pathlib import Path

    from hf_dsinfer.serving.serve_cli import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    doc = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    assert not {f for f in flags if f"`{f}" not in doc}, "serve options missing from docs/serving.md"
