"""Tensor-parallel continuous batching (serving/tp_worker.py): 2 gloo ranks on CPU against the tp=1 engine.

The ranks start once (test_parallel's launcher, ``script=`` this file); each loads the same tiny saved llama (and
bloom: ALiBi on the paged cache's torch path) with ``tensor_parallel={"tp_size": 2}`` and fused layers, and runs the
cases below; the test process runs the very same cases on a tp=1 load of the same folders and compares request by
request. Cases: ``generate_batch`` on every rank (greedy, chunked prefill, a shared prompt prefix whose blocks are hit,
``num_return_sequences=2`` with copy-on-write; ranks passing different prompts each get their own results), and a
``ServingEngine`` on rank 0 with ``run_worker`` on rank 1 (seeded sampling, log-probs, prompt log-probs, a cache
small enough to preempt, n-gram speculation), with one broadcast per step. ``hf-dsinfer serve
--tensor-parallel-size 2`` (its own worker process) answers through the ``openai`` client as a tp=1 engine does, a
killed worker turns ``/health`` to 503, and no worker outlives the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request

import pytest
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_parallel import free_port, launch  # noqa: E402 - the gloo launcher, run on this file's worker
from tiny_models import PAD, prompts, save_tiny  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_serving_tp")

WORLD = 2
TIMEOUT_S = 300
FUSED = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 64}


def greedy(new: int = 8, **kw) -> transformers.GenerationConfig:
    """Greedy with no EOS (every request runs ``new`` tokens)."""
    return transformers.GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=PAD, eos_token_id=-1, **kw)


def _tokens(results: dict) -> dict[str, list[int]]:
    return {name: list(out.generated_tokens) for name, out in results.items()}


def batch_cases(model, rank: int) -> dict:
    """``generate_batch`` cases; every rank runs them (as under torchrun)."""
    from hf_dsinfer.serving import last_batch_stats

    out: dict = {}
    shared = prompts((13,), seed=5)[0]
    batch = [shared + p for p in prompts((3, 6, 2), seed=6)] + prompts((20, 4), seed=7)
    # blocks of 4 tokens, 12 tokens a step: the 20- and 16-token prompts prefill in chunks
    cb = transformers.ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=12)
    out["greedy"] = _tokens(model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=cb))
    stats = last_batch_stats(model)
    out["greedy_stats"] = None if stats is None else stats.as_dict()
    # two sequences a prompt (top_k=1: deterministic): the child shares its parent's prompt blocks (copy-on-write)
    two = transformers.GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1, num_return_sequences=2,
                                        pad_token_id=PAD, eos_token_id=-1)  # fmt: skip
    out["two"] = _tokens(model.generate_batch(prompts((7, 10), seed=8), generation_config=two,
                                              continuous_batching_config=cb))  # fmt: skip
    stats = last_batch_stats(model)
    out["two_stats"] = None if stats is None else stats.as_dict()
    # each rank its own prompts (different counts): each gets the results of its own, named as if alone
    own = prompts((5, 9, 3), seed=20) if rank == 0 else prompts((6,), seed=21)
    out["own"] = _tokens(model.generate_batch(own, generation_config=greedy(5), continuous_batching_config=cb))
    return out


def engine_cases(model, rank: int) -> dict:
    """A ServingEngine on rank 0 (run_worker on the others): sampling, log-probs, preemption, speculation."""
    from hf_dsinfer.serving import ServingEngine
    from hf_dsinfer.serving.tp_worker import run_worker

    if rank != 0:
        run_worker(model)  # the sampling engine
        big = run_worker(model)  # the speculating one, stopped with a payload larger than the channel's buffer
        run_worker(model)  # one more engine after that
        buffer = model._dsinfer_step_channel.buffer.numel()
        return {"big": big == list(range(20000)), "buffer": buffer}
    out: dict = {}
    batch = prompts((9, 14, 5, 11), seed=30)
    # 12 blocks of 4: four requests of up to 26 tokens cannot all hold their blocks -> preemptions
    engine = ServingEngine(model, block_size=4, num_blocks=12, max_batch_tokens=16)
    sample = transformers.GenerationConfig(do_sample=True, temperature=0.9, top_k=50, max_new_tokens=12,
                                           pad_token_id=PAD, eos_token_id=-1)  # fmt: skip
    channel = engine.runner.channel  # the model's one channel (the generate_batch cases used it before)
    before = None if channel is None else channel.messages
    handles = [engine.submit(p, sample, seed=100 + i, logprobs=2) for i, p in enumerate(batch[:3])]
    handles.append(engine.submit(batch[3], greedy(12), prompt_logprobs=1))
    engine.run_until_idle()
    engine.stop_workers()
    out["sampled"] = [h.tokens for h in handles]
    out["logprobs"] = [[e.logprob for e in h.logprobs] for h in handles[:3]]
    out["prompt_logprobs"] = [e.logprob for e in handles[3].prompt_logprobs[1:]]
    out["stats"] = engine.stats.as_dict()
    out["messages"] = None if channel is None else channel.messages - before
    spec = ServingEngine(model, block_size=4, num_blocks=32, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})  # fmt: skip
    pattern = prompts((6,), seed=31)[0]
    handle = spec.submit(pattern * 3, greedy(12))
    spec.run_until_idle()
    spec.stop_workers(list(range(20000)) if channel is not None else None)  # a one-off larger buffer (GROW)
    out["spec"] = handle.tokens
    out["spec_stats"] = spec.stats.as_dict()
    last = ServingEngine(model, block_size=4, num_blocks=32)  # the channel still in step after the one-off buffer
    again = last.submit(batch[0], greedy(4))
    last.run_until_idle()
    last.stop_workers()
    out["after_grow"] = again.tokens
    out["buffer"] = None if channel is None else channel.buffer.numel()
    return out


def run_cases(path: str, rank: int, tp_size: int) -> dict:
    """Every case on the model at ``path`` loaded with ``tp_size`` ranks (fused layers, fp32)."""
    cfg = dict(FUSED, tensor_parallel={"tp_size": tp_size}) if tp_size > 1 else FUSED
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
    # the tp=1 reference of rank 1's prompts runs the engine cases as rank 0 would (its own engine)
    return {"batch": batch_cases(model, rank), "engine": engine_cases(model, rank if tp_size > 1 else 0)}


def bloom_cases(path: str, rank: int, tp_size: int) -> dict:
    cfg = dict(FUSED, tensor_parallel={"tp_size": tp_size}) if tp_size > 1 else FUSED
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
    shared = prompts((9,), seed=40)[0]
    batch = [shared + p for p in prompts((4, 7), seed=41)] + prompts((12,), seed=42)
    cb = transformers.ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=16)
    return {"greedy": _tokens(model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=cb))}


def four_rank_cases(path: str, rank: int, tp_size: int) -> dict:
    """4 ranks (llama's 6 q heads over 2 KV heads: 2 / 1 q heads a rank, each KV head on 2 ranks): generate_batch."""
    cfg = dict(FUSED, tensor_parallel={"tp_size": tp_size}) if tp_size > 1 else FUSED
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
    return {"batch": {"greedy": batch_cases(model, rank)["greedy"]}}


def worker(job_path: str) -> None:
    """One rank: every case, saved to ``rank{RANK}.pt`` next to the job file."""
    import json

    import hf_dsinfer  # noqa: F401 - registers inference_config=

    with open(job_path) as f:
        job = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out: dict = {}
    cases = (("llama", run_cases), ("bloom", bloom_cases)) if world == WORLD else (("llama", four_rank_cases),)
    for name, fn in cases:
        try:
            out[name] = fn(job[name], rank, world)
        except Exception:  # noqa: BLE001 - reported by the test
            out[name] = {"error": traceback.format_exc()}
    torch.save(out, os.path.join(os.path.dirname(job_path), f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(tp=2 results of each rank, tp=1 results of each rank's cases), the two ranks started once."""
    import hf_dsinfer  # noqa: F401

    base = tmp_path_factory.mktemp("serving_tp")
    job = {"llama": save_tiny("llama", base / "llama"), "bloom": save_tiny("bloom", base / "bloom")}
    got = launch(job, str(base), world=WORLD, timeout=TIMEOUT_S, script=__file__)
    torch.set_num_threads(1)
    ref = [{"llama": run_cases(job["llama"], r, 1), "bloom": bloom_cases(job["bloom"], r, 1)} for r in range(WORLD)]
    return got, ref


def _ok(result: dict) -> dict:
    assert "error" not in result, result.get("error")
    return result


@pytest.mark.parametrize("case", ["greedy", "two", "own"])
def test_generate_batch_tp2_equals_tp1_on_every_rank(run, case):
    got, ref = run
    for rank in range(WORLD):
        mine, theirs = _ok(got[rank]["llama"])["batch"][case], ref[rank]["llama"]["batch"][case]
        assert mine.keys() == theirs.keys(), f"rank {rank}: request ids differ"
        assert mine == theirs, f"rank {rank}: {case} tokens differ from tp=1"
        assert all(len(t) for t in mine.values())


def test_prefix_sharing_and_copy_on_write_under_tp(run):
    got, ref = run
    stats = _ok(got[0]["llama"])["batch"]["greedy_stats"]
    assert stats["prefix_hit_tokens"] > 0, "the shared 13-token prefix was not hit"
    assert stats["prefix_hit_tokens"] == ref[0]["llama"]["batch"]["greedy_stats"]["prefix_hit_tokens"]
    assert stats["steps"] > len(_ok(got[0]["llama"])["batch"]["greedy"]["req_4"]), "chunked prefill takes more steps"
    two = got[0]["llama"]["batch"]["two_stats"]
    assert two["copy_on_write_blocks"] > 0 and two["prefix_hit_tokens"] > 0
    assert got[1]["llama"]["batch"]["greedy_stats"] is None, "rank 1 runs no engine of its own"


def test_engine_tp2_sampling_logprobs_preemption_speculation_equal_tp1(run):
    got, ref = run
    mine, theirs = _ok(got[0]["llama"])["engine"], ref[0]["llama"]["engine"]
    assert mine["sampled"] == theirs["sampled"], "seeded sampling / greedy tokens differ from tp=1"
    for a, b in zip(mine["logprobs"] + [mine["prompt_logprobs"]], theirs["logprobs"] + [theirs["prompt_logprobs"]]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)
    assert mine["stats"]["preemptions"] > 0 and mine["stats"]["preemptions"] == theirs["stats"]["preemptions"]
    # one broadcast per step, plus the workers' setup and stop
    assert mine["messages"] == mine["stats"]["steps"] + 2
    assert mine["spec"] == theirs["spec"]
    assert mine["spec_stats"]["spec_decode_num_accepted_tokens"] > 0
    # a stop payload larger than the buffer used a one-off larger buffer; both sides went back to the standing one
    assert got[1]["llama"]["engine"] == {"big": True, "buffer": mine["buffer"]} and mine["buffer"] == 1 << 12
    assert mine["after_grow"] == theirs["after_grow"]


def test_bloom_alibi_tp2_equals_tp1(run):
    got, ref = run
    for rank in range(WORLD):
        assert _ok(got[rank]["bloom"])["greedy"] == ref[rank]["bloom"]["greedy"], f"rank {rank}: bloom differs"


@pytest.mark.slow
def test_generate_batch_on_4_ranks_with_uneven_heads_equals_tp1(run, tmp_path):
    """4 gloo ranks: uneven local q heads (2 / 1) and each KV head held by 2 ranks; every rank's tokens equal tp=1."""
    got, ref = run
    path = save_tiny("llama", tmp_path / "llama")  # the same seed, the same weights as the 2-rank run's folder
    four = launch({"llama": path}, str(tmp_path), world=4, timeout=TIMEOUT_S, script=__file__)
    for rank in range(4):
        mine = _ok(four[rank]["llama"])["batch"]["greedy"]
        assert mine == ref[0]["llama"]["batch"]["greedy"], f"rank {rank}: 4-rank tokens differ from tp=1"


def test_engine_refusals_without_a_second_process(tmp_path):
    """A tp=1 model has no workers; an engine off rank 0 is refused by name."""
    from types import SimpleNamespace

    from hf_dsinfer.serving.engine import _check_tp
    from hf_dsinfer.serving.tp_worker import channel_for, run_worker

    path = save_tiny("llama", tmp_path / "m")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=FUSED)
    with pytest.raises(ValueError, match="not split over tensor-parallel ranks"):
        channel_for(model)
    with pytest.raises(ValueError, match="rank 0 runs the ServingEngine"):
        run_worker(model)
    with pytest.raises(ValueError, match="run_worker"):
        _check_tp(SimpleNamespace(rank=1, size=2))


def test_step_encoding_round_trips():
    from hf_dsinfer.serving.runner import StepInputs
    from hf_dsinfer.serving.tp_worker import decode_step, encode_step

    step = StepInputs(
        input_ids=torch.tensor([5, 6, 7]), positions=torch.tensor([0, 1, 4]), slot_mapping=torch.tensor([8, 9, 20]),
        cu_seqlens=torch.tensor([0, 2, 3], dtype=torch.int32), seq_lens=torch.tensor([2, 5], dtype=torch.int32),
        block_tables=torch.tensor([[2, 0], [4, 5]], dtype=torch.int32), prompt_rows=torch.tensor([0]),
        sample_rows=torch.tensor([1, 2]), copies=torch.tensor([[3, 5]]), lora_slots=torch.tensor([-1, -1, 0]),
    )  # fmt: skip
    back = decode_step(encode_step(step))
    for field in step.__dataclass_fields__:
        a, b = getattr(step, field), getattr(back, field)
        assert torch.equal(a, b) and a.dtype == b.dtype, field


# -- hf-dsinfer serve --tensor-parallel-size 2 -------------------------------------------------------------------------

SERVE_PROMPTS = ["Hello world", "The quick brown fox jumps", "Once upon a time", "a b c d e f g"]


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _health(root: str) -> int:
    try:
        with urllib.request.urlopen(root + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def wait_healthy(root: str, procs: list[subprocess.Popen], timeout: float = 240.0) -> None:
    """Until ``root``'s /health answers 200; fails with the output of a process in ``procs`` that exited first."""
    deadline = time.monotonic() + timeout
    while _health(root) != 200:
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, dead[0].stdout.read()
        assert time.monotonic() < deadline, "the tensor-parallel server did not come up"
        time.sleep(0.5)


def _answers(base: str) -> list[tuple[str, str]]:
    """Greedy and seeded-sampling completions of SERVE_PROMPTS through the openai client: (text, finish_reason)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
    out = []
    for i, prompt in enumerate(SERVE_PROMPTS):
        for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 7 + i}):
            r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=10, **extra)
            out.append((r.choices[0].text, r.choices[0].finish_reason))
    return out


def test_serve_tensor_parallel_size_2_answers_as_tp1_and_stops_its_worker(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from hf_dsinfer.serving.serve_cli import build_server

    path = save_tiny("llama", tmp_path / "tiny-llama")
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hf_dsinfer", "serve", path, "--tensor-parallel-size", "2", "--port", str(port),
           "--inference-config", '{"dtype": "fp32"}', "--max-model-len", "64", "--disable-log-requests"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    workers: list[int] = []
    try:
        wait_healthy(root, [proc])
        workers = _children(proc.pid)
        assert len(workers) == 1, f"one worker process expected, found {workers}"
        got = _answers(root + "/v1")
        # tp=1: the same folder and settings in this process
        torch.set_num_threads(1)
        server = build_server(path, {"dtype": "fp32"}, max_model_len=64)
        base = server.start("127.0.0.1", 0)
        try:
            want = _answers(base)
        finally:
            server.stop()
        assert got == want, "tensor-parallel answers differ from tp=1"
        # a worker that dies turns /health to 503 (the server watches its workers)
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _health(root) != 503:
            assert time.monotonic() < deadline, "/health still answers 200 after the worker died"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read()
        assert "tensor-parallel worker died" in log, log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"worker {pid} outlived the server"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_serve_clean_shutdown_leaves_no_worker(tmp_path):
    """SIGTERM with healthy workers: the stop message ends them, the server exits 0, no process is left."""
    pytest.importorskip("fastapi")
    path = save_tiny("llama", tmp_path / "tiny-llama")
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hf_dsinfer", "serve", path, "-tp", "2", "--port", str(port), "--inference-config",
           '{"dtype": "fp32"}', "--max-model-len", "64"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_healthy(root, [proc])
        workers = _children(proc.pid)
        body = json.dumps({"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4}).encode()
        req = urllib.request.Request(root + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert workers and all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in workers)


def test_bench_serving_tp_runs_both_contenders_with_the_same_tokens(tmp_path):
    """``hf-dsinfer bench --serve-tp 2``'s module on a few short requests: every run of both contenders is reported
    with its load average, and continuous batching produced the padded batches' greedy tokens."""
    from hf_dsinfer.bench.serving_tp import main

    out = tmp_path / "tp.json"
    summary = main(["--tp", "2", "--requests", "4", "--rounds", "1", "--max-prompt", "24", "--max-new", "16",
                    "--json", str(out)])  # fmt: skip
    assert summary["same_tokens"] is True
    assert sorted(r["contender"] for r in summary["runs"]) == ["cb", "padded"]
    assert all(r["tokens"] > 0 and r["seconds"] > 0 and "load_1min" in r for r in summary["runs"])
    assert json.loads(out.read_text())["cb_over_padded"] > 0


def test_serve_under_torchrun_rank0_serves_and_rank1_works(tmp_path):
    """Both ranks run the same ``serve -tp 2`` command with torchrun's variables (what torchrun, also across machines,
    does): rank 0 answers, rank 1 follows; SIGTERM to both (as torchrun forwards it) ends both with status 0."""
    pytest.importorskip("fastapi")
    path = save_tiny("llama", tmp_path / "tiny-llama")
    port, master = free_port(), free_port()
    root = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hf_dsinfer", "serve", path, "-tp", "2", "--port", str(port), "--inference-config",
           '{"dtype": "fp32"}', "--max-model-len", "64"]  # fmt: skip
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(master)}  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    try:
        wait_healthy(root, procs)
        assert _children(procs[0].pid) == [], "under torchrun the server starts no worker of its own"
        # ignore_eos: the request samples (temperature 1), and a sampled EOS would end it before 4 tokens
        body = json.dumps({"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}).encode()
        req = urllib.request.Request(root + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 4
        for p in procs:
            p.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
        assert "tensor-parallel worker" in procs[1].stdout.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    worker(sys.argv[2])
