"""LoRA adapters under tensor-parallel continuous batching: 2 gloo ranks on CPU against tp=1 and peft.

The ranks start once (test_parallel's launcher, ``script=`` this file) and load a tiny saved llama with
``tensor_parallel={"tp_size": 2}`` (its MLP's 136 features split 64 / 72 by the grain rule: an uneven gate/up cut);
rank 0 runs a ``ServingEngine(enable_lora=True)`` and rank 1 ``run_worker``. Requests of two adapters (one on every
projection: q/k/v, o, gate/up, down; one on q/v and down only, another rank) and of the base share each step; then
one adapter is unloaded and a third loaded into its slot at run time, and the mix runs again. The test process runs
the same case on a tp=1 load and on peft's ``PeftModel`` (each request alone) and compares request by request.
``hf-dsinfer serve -tp 2 --enable-lora --lora-modules`` answers through the ``openai`` client as a tp=1 server does,
also after vLLM's ``/v1/unload_lora_adapter`` and ``/v1/load_lora_adapter`` swapped an adapter at run time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

import pytest
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_parallel import free_port, launch  # noqa: E402 - the gloo launcher, run on this file's worker
from tiny_models import PAD, prompts, randomize_lora, save_tiny  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_serving_tp")

WORLD = 2
TIMEOUT_S = 300
FUSED = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 64}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, rslora, target modules, seed)
ADAPTERS = {
    "every": (8, 16, True, ALL, 1),
    "qv_down": (4, 8, False, ["q_proj", "v_proj", "down_proj"], 2),
    "late": (6, 12, False, ALL, 3),  # loaded at run time into the slot "qv_down" frees
}
NEW = 8


def _greedy(new: int = NEW) -> transformers.GenerationConfig:
    return transformers.GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=PAD, eos_token_id=-1)


def _save_adapter(base: str, out: str, rank: int, alpha: int, rslora: bool, targets: list[str], seed: int) -> str:
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    randomize_lora(peft_model, seed=seed, scale=0.3)  # peft starts B at zero: a real, non-zero delta
    peft_model.save_pretrained(out)
    return out


def _mix() -> list[tuple[str | None, list[int]]]:
    """(adapter, prompt) of the first phase: both adapters and the base, a prompt shared across adapters."""
    ps = prompts((9, 14, 5, 11, 7), seed=60)
    return [("every", ps[0]), ("qv_down", ps[1]), (None, ps[2]), ("every", ps[3]), ("qv_down", ps[0]), (None, ps[4])]


def _late_mix() -> list[tuple[str | None, list[int]]]:
    ps = prompts((10, 6, 8), seed=61)
    return [("late", ps[0]), ("every", ps[1]), (None, ps[2]), ("late", ps[1])]


def engine_case(path: str, dirs: dict[str, str], rank: int, tp_size: int) -> dict:
    """Rank 0 (or tp=1): the engine over both phases; rank 1: the worker loop."""
    from hf_dsinfer.serving import ServingEngine
    from hf_dsinfer.serving.tp_worker import run_worker

    cfg = dict(FUSED, tensor_parallel={"tp_size": tp_size}) if tp_size > 1 else FUSED
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
    if rank != 0:
        run_worker(model)
        return {"worker": True}
    engine = ServingEngine(model, block_size=4, num_blocks=64, max_batch_tokens=16, enable_lora=True, max_loras=2,
                           max_lora_rank=8, generation_config=_greedy())  # fmt: skip
    channel = engine.runner.channel
    for name in ("every", "qv_down"):
        engine.load_lora_adapter(name, dirs[name])
    before = None if channel is None else channel.messages
    handles = [engine.submit(p, adapter=a) for a, p in _mix()]
    engine.run_until_idle()
    out: dict = {"mix": [h.tokens for h in handles], "mix_steps": engine.stats.steps}
    out["mix_messages"] = None if channel is None else channel.messages - before  # SETUP + one per step
    try:
        engine.load_lora_adapter("late", dirs["late"])
    except ValueError as e:  # both slots taken: refused on rank 0, nothing reaches the workers
        out["full"] = str(e)
    engine.unload_lora_adapter("qv_down")
    engine.load_lora_adapter("late", dirs["late"])  # into the freed slot, zeroed first on every rank
    handles = [engine.submit(p, adapter=a) for a, p in _late_mix()]
    engine.run_until_idle()
    out["late"] = [h.tokens for h in handles]
    out["slots"] = {a.name: a.slot for a in engine.lora.adapters.values()}
    engine.stop_workers()
    return out


def worker(job_path: str) -> None:
    """One rank: the engine case, saved to ``rank{RANK}.pt`` next to the job file."""
    import json

    import hf_dsinfer  # noqa: F401 - registers inference_config=

    with open(job_path) as f:
        job = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        out = engine_case(job["base"], job["dirs"], rank, world)
    except Exception:  # noqa: BLE001 - reported by the test
        out = {"error": traceback.format_exc()}
    torch.save(out, os.path.join(os.path.dirname(job_path), f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pytest.importorskip("peft")
    import hf_dsinfer  # noqa: F401

    root = tmp_path_factory.mktemp("serving_tp_lora")
    base = save_tiny("llama", root / "base")
    dirs = {n: _save_adapter(base, str(root / n), r, a, rs, t, s) for n, (r, a, rs, t, s) in ADAPTERS.items()}
    return root, base, dirs


@pytest.fixture(scope="module")
def run(folders):
    """(rank results of the tp=2 run, the tp=1 result)."""
    root, base, dirs = folders
    got = launch({"base": base, "dirs": dirs}, str(root), world=WORLD, timeout=TIMEOUT_S, script=__file__)
    torch.set_num_threads(1)
    return got, engine_case(base, dirs, 0, 1)


def _ok(result: dict) -> dict:
    assert "error" not in result, result.get("error")
    return result


def test_mixed_adapters_and_base_in_one_step_tp2_equal_tp1(run):
    got, ref = run
    mine = _ok(got[0])
    assert _ok(got[1]) == {"worker": True}
    assert mine["mix"] == ref["mix"], "tp=2 tokens of the adapter / base mix differ from tp=1"
    assert all(len(t) == NEW for t in mine["mix"])
    # six requests of 16 prompt tokens a step at most: several requests (and adapters) shared steps
    assert mine["mix_steps"] < sum(len(p) + NEW for _, p in _mix())
    # the adapters changed the answers (a shared prompt: "every", "qv_down" and the base differ)
    assert len({tuple(mine["mix"][0]), tuple(mine["mix"][4])}) == 2
    # ordinary steps stay one broadcast each (plus the workers' cache setup)
    assert mine["mix_messages"] == mine["mix_steps"] + 1


def test_load_and_unload_at_run_time_reach_every_rank(run):
    got, ref = run
    mine = _ok(got[0])
    assert "all 2 LoRA slots are in use" in mine["full"] and "--max-loras" in mine["full"]
    assert mine["slots"] == ref["slots"] == {"every": 0, "late": 1}
    assert mine["late"] == ref["late"], "tp=2 tokens after unload / load differ from tp=1"


def test_tp1_reference_equals_peft_alone(folders, run):
    """The tp=1 tokens the tp=2 run matched are peft's, request by request (each request alone)."""
    from peft import PeftModel

    _, base, dirs = folders
    _, ref = run
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    oracle = PeftModel.from_pretrained(hf, dirs["every"], adapter_name="every").eval()
    for name in ("qv_down", "late"):
        oracle.load_adapter(dirs[name], adapter_name=name)
    for (adapter, prompt), tokens in list(zip(_mix(), ref["mix"])) + list(zip(_late_mix(), ref["late"])):
        ids = torch.tensor([prompt])
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=_greedy())
        with torch.no_grad():
            if adapter is None:
                with oracle.disable_adapter():
                    want = oracle.generate(**kwargs)[0, len(prompt) :].tolist()
            else:
                oracle.set_adapter(adapter)
                want = oracle.generate(**kwargs)[0, len(prompt) :].tolist()
        assert tokens == want, f"adapter {adapter}: tokens differ from peft"


@pytest.mark.slow
def test_four_ranks_uneven_heads_and_replicated_kv_equal_tp1(folders, run, tmp_path):
    """4 gloo ranks: 2 / 1 local q heads and each KV head held by 2 ranks, so B's q/k/v rows are cut unevenly and
    the k/v rows repeated; the same requests give tp=1's tokens."""
    _, base, dirs = folders
    _, ref = run
    got = launch({"base": base, "dirs": dirs}, str(tmp_path), world=4, timeout=TIMEOUT_S, script=__file__)
    assert [_ok(r) for r in got[1:]] == [{"worker": True}] * 3
    assert _ok(got[0])["mix"] == ref["mix"] and got[0]["late"] == ref["late"], "4-rank tokens differ from tp=1"


# -- hf-dsinfer serve -tp 2 --enable-lora ------------------------------------------------------------------------------


def _answers(base_url: str, names: list[str]) -> list[str]:
    """Greedy completions of two prompts for every served model name through the openai client."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    listed = sorted(m.id for m in client.models.list().data)
    out = [repr(listed)]
    for name in names:
        for prompt in ("Hello world", "The quick brown fox"):
            r = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
            out.append(r.choices[0].text)
    return out


def _swap(base_url: str, late: str) -> list[str]:
    """vLLM's run-time routes: unload ``qv_down``, load ``late`` in its place; then ``late``'s answers."""
    import json
    import urllib.request

    for route, body in (("unload_lora_adapter", {"lora_name": "qv_down"}),
                        ("load_lora_adapter", {"lora_name": "late", "lora_path": late})):  # fmt: skip
        req = urllib.request.Request(f"{base_url}/{route}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200, route
    return _answers(base_url, ["late"])


def test_serve_tp2_with_lora_modules_answers_as_tp1(folders, tmp_path):
    pytest.importorskip("fastapi")
    from test_serving_tp import wait_healthy

    from hf_dsinfer.serving.serve_cli import build_server

    _, base, dirs = folders
    path = str(tmp_path / "tiny-llama")
    os.symlink(base, path)  # the served name is the folder's
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    modules = [f"{n}={dirs[n]}" for n in ("every", "qv_down")]
    cmd = [sys.executable, "-m", "hf_dsinfer", "serve", path, "-tp", "2", "--port", str(port), "--inference-config",
           '{"dtype": "fp32"}', "--max-model-len", "64", "--enable-lora", "--lora-modules", *modules,
           "--max-lora-rank", "8", "--disable-log-requests"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    names = ["tiny-llama", "every", "qv_down"]
    try:
        wait_healthy(root, [proc])
        got = _answers(root + "/v1", names) + _swap(root + "/v1", dirs["late"])
        torch.set_num_threads(1)
        server = build_server(path, {"dtype": "fp32"}, max_model_len=64, enable_lora=True, max_lora_rank=8,
                              lora_modules={n: dirs[n] for n in ("every", "qv_down")})  # fmt: skip
        url = server.start("127.0.0.1", 0)
        try:
            want = _answers(url, names) + _swap(url, dirs["late"])
        finally:
            server.stop()
        assert got == want, "tensor-parallel answers with adapters differ from tp=1"
        assert len(set(got[1:])) > 2, "the adapters changed nothing"
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    worker(sys.argv[2])
