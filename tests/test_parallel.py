"""Tensor parallelism end to end: 2 gloo processes on CPU against the tp=1 model.

The module starts the two ranks once (``python tests/test_parallel.py worker JOB``, with torchrun's environment
variables and a free port, bounded by a timeout); each rank runs every check and writes its results to a file, and
the tests below compare those files with references computed here with plain transformers. Rows: llama with GQA
(2 KV heads, and 4 KV heads of 8 q heads), gpt_neox (fused per-head qkv), opt, falcon (multi-query: the one KV head
is replicated), phi3 (fused qkv and gate_up), gpt2 (Conv1D), qwen2, and gptj (no policy: AutoTP alone). The policy
rows run again with ``replace_with_kernel_inject=True`` (fused layers on each rank's slices). Each gives logits
within ``MODEL_LOGITS_TOL``, 20 greedy tokens identical to tp=1, and sampled tokens identical on both ranks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from tiny_models import PAD, left_pad, prompts, save_tiny  # noqa: E402
from tolerances import MODEL_LOGITS_TOL  # noqa: E402

# One xdist worker runs the whole module: its module-scoped launches would otherwise run once per worker.
pytestmark = pytest.mark.xdist_group("test_parallel")

WORLD = 2
NEW_TOKENS = 20
FAMILY_TOKENS = 8
TIMEOUT_S = 300
# name -> (tiny_models row, config overrides)
ROWS = {
    "llama_kv2": ("llama", {}),
    "llama_kv4": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 4}),
    "gpt_neox": ("gpt_neox", {}),
    "opt": ("opt", {}),
    "falcon": ("falcon", {}),
    "phi3": ("phi3", {}),
    "gpt2": ("gpt2", {}),
    "qwen2": ("qwen2", {}),
    "gptj": ("gptj", {}),  # no policy: AutoTP alone finds its row / column linears
    # uneven splits: vocab 501 -> 251 / 250 rows; tp_grain_size 8 on intermediate 136 -> 72 / 64
    "uneven": ("llama", {"vocab_size": 501}),
}
GRAIN = {"uneven": 8}  # the other rows use the default tp_grain_size (64)
LOCAL_MLP = ("uneven", "llama40", "llama40_kv8")
# rows also run with replace_with_kernel_inject=True: fused layers on each rank's slices, all-reduce in o / down
FUSED = ["llama_kv2", "llama_kv4", "gpt_neox", "opt", "falcon", "phi3", "gpt2", "qwen2"]


def free_port() -> int:
    """A TCP port nobody listens on right now (for the rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    job: dict, out_dir: str, world: int = WORLD, timeout: int = TIMEOUT_S, script: str = __file__
) -> list[dict]:
    """Run ``python <script> worker <job>`` on ``world`` ranks (torchrun's environment), return each rank's results
    (the worker writes ``rank<N>.pt`` into ``out_dir``)."""
    job_path = os.path.join(out_dir, "job.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            CUDA_VISIBLE_DEVICES="",
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
        )
        log = open(os.path.join(out_dir, f"log{rank}.txt"), "w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, script, "worker", job_path], env=env, stdout=log, stderr=subprocess.STDOUT
                ),
                log,
            )
        )
    try:
        for p, _ in procs:
            p.wait(timeout=timeout)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            log.close()
    results = []
    for rank, (p, _) in enumerate(procs):
        path = os.path.join(out_dir, f"rank{rank}.pt")
        if not os.path.exists(path):
            with open(os.path.join(out_dir, f"log{rank}.txt")) as f:
                raise AssertionError(f"rank {rank} exited {p.returncode} without results:\n{f.read()[-4000:]}")
        results.append(torch.load(path, weights_only=False))
    return results


# ---------------------------------------------------------------------------------------------------------------------
# The worker (runs in each rank's process)
# ---------------------------------------------------------------------------------------------------------------------


def _generate(model, ids, mask, sample: bool, new_tokens: int = NEW_TOKENS):
    kw = dict(do_sample=True, top_k=0, temperature=1.0) if sample else dict(do_sample=False)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=PAD, **kw
    )
    return out[:, ids.shape[1] :]


def _checks(model, rank: int) -> dict:
    ids, mask = left_pad(prompts())
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    greedy = _generate(model, ids, mask, sample=False)
    torch.manual_seed(1234 + rank)  # different on purpose: rank 0's state must be broadcast before sampling
    sampled = _generate(model, ids, mask, sample=True)
    return {"logits": logits, "greedy": greedy, "sampled": sampled}


def _split(model) -> tuple:
    """(local q/kv heads of the first attention, every rank's vocab rows): what AutoTP kept on this rank."""
    plan = model._dsinfer_tp_plan
    return next(iter(plan.local_heads.values())), plan.head[1] if plan.head else None


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def worker(job_path: str) -> None:
    """One rank: run every check of the job, save results to ``rank{RANK}.pt`` next to the job file."""
    import transformers

    import hf_dsinfer

    with open(job_path) as f:
        job = json.load(f)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    out: dict = {}
    tp2 = {"dtype": "fp32", "replace_with_kernel_inject": False, "tensor_parallel": {"tp_size": world}}
    for name, path in job.get("models", {}).items():
        try:
            grain = {"tp_grain_size": GRAIN[name]} if name in GRAIN else {}  # else the default, 64
            cfg = {**tp2, "tensor_parallel": {"tp_size": world, **grain}}
            model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
            out[name] = _checks(model, rank)
            out[name]["local_mlp"] = model.model.layers[0].mlp.up_proj.weight.shape[0] if name in LOCAL_MLP else None
            out[name]["split"] = _split(model)
            out[name]["n_params"] = sum(p.numel() for p in model.parameters())
        except Exception:  # noqa: BLE001 - reported by the test
            out[name] = {"error": traceback.format_exc()}
    for name in job.get("fused", []):
        try:
            cfg = {**tp2, "replace_with_kernel_inject": True}
            model = transformers.AutoModelForCausalLM.from_pretrained(job["models"][name], inference_config=cfg)
            out[name + "+fused"] = _checks(model, rank)
            out[name + "+fused"]["fused"] = hf_dsinfer.policies.is_injected(model)
            out[name + "+fused"]["split"] = _split(model)
            out[name + "+fused"]["n_params"] = sum(p.numel() for p in model.parameters())
        except Exception:  # noqa: BLE001 - reported by the test
            out[name + "+fused"] = {"error": traceback.format_exc()}
    for name, path in job.get("families", {}).items():
        try:
            model = getattr(transformers, FAMILIES[name][2]).from_pretrained(path, inference_config=tp2)
            ids, mask = left_pad(prompts())
            with torch.no_grad():
                out[name] = {"logits": model(input_ids=ids, attention_mask=mask).logits}
            if name not in ENCODERS:
                out[name]["greedy"] = _generate(model, ids, mask, sample=False, new_tokens=FAMILY_TOKENS)
            out[name]["n_params"] = sum(p.numel() for p in model.parameters())
        except Exception:  # noqa: BLE001 - reported by the test
            out[name] = {"error": traceback.format_exc()}
    for name in job.get("families_fused", []):
        try:
            cfg = {**tp2, "replace_with_kernel_inject": True}
            model = transformers.AutoModelForCausalLM.from_pretrained(job["families"][name], inference_config=cfg)
            ids, mask = left_pad(prompts())
            with torch.no_grad():
                got = {"logits": model(input_ids=ids, attention_mask=mask).logits}
            got["greedy"] = _generate(model, ids, mask, sample=False, new_tokens=FAMILY_TOKENS)
            got["fused"] = hf_dsinfer.policies.is_injected(model)
            out[name + "+fused"] = got
        except Exception:  # noqa: BLE001 - reported by the test
            out[name + "+fused"] = {"error": traceback.format_exc()}
    if "inplace" in job:  # init_inference on a built full model: split in place
        model = transformers.AutoModelForCausalLM.from_pretrained(job["inplace"], dtype=torch.float32)
        engine = hf_dsinfer.init_inference(
            model, dtype="fp32", tensor_parallel={"tp_size": WORLD}, save_mp_checkpoint_path=job["mp_dir"]
        )
        out["inplace"] = _checks(engine.module, rank)
        # a later start from the per-rank checkpoint description: no re-slicing
        desc = os.path.join(job["mp_dir"], "ds_inference_config.json")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            job["inplace"], inference_config={**tp2, "checkpoint": desc}
        )
        out["from_mp"] = _checks(model, rank)
    if "errors" in job:
        cfg = {"dtype": "fp32", "tensor_parallel": {"tp_size": 3}}
        out["err_world"] = _error(
            lambda: transformers.AutoModelForCausalLM.from_pretrained(job["errors"]["ok"], inference_config=cfg)
        )
        out["err_heads"] = _error(
            lambda: transformers.AutoModelForCausalLM.from_pretrained(job["errors"]["heads1"], inference_config=tp2)
        )
    if "memory" in job:
        # warm up first (imports, process groups, first-call code paths) so only the big load is measured
        _checks(transformers.AutoModelForCausalLM.from_pretrained(job["warmup"], inference_config=tp2), rank)
        out["memory"] = _measure_load(job["memory"], tp2)
    torch.save(out, os.path.join(os.path.dirname(job_path), f"rank{rank}.pt"))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _measure_load(path: str, cfg: dict) -> dict:
    import gc

    import transformers

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _rss_kib("VmRSS")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
    loaded = _rss_kib("VmHWM")
    with torch.no_grad():  # touches every weight: lazily mapped pages would show up now
        model(input_ids=torch.tensor([[5, 6, 7]]))
    peak = max(loaded, _rss_kib("VmHWM"))
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"before_kib": before, "loaded_kib": loaded, "peak_kib": peak, "local_bytes": local}


# ---------------------------------------------------------------------------------------------------------------------
# The tests (run in pytest's process)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Save every row, start the two ranks once, return (paths, rank results)."""
    base = tmp_path_factory.mktemp("tp")
    paths = {name: save_tiny(row, base / name, **over) for name, (row, over) in ROWS.items()}
    heads1 = save_tiny("llama", base / "heads1", hidden_size=16, num_attention_heads=1, num_key_value_heads=1)
    job = {
        "models": paths,
        "fused": FUSED,
        "inplace": paths["llama_kv2"],
        "mp_dir": str(base / "mp"),
        "errors": {"ok": paths["llama_kv2"], "heads1": heads1},
    }
    return paths, launch(job, str(base))


@torch.no_grad()
def _reference(path: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, mask = left_pad(prompts())
    logits = model(input_ids=ids, attention_mask=mask).logits
    greedy = _generate(model, ids, mask, sample=False)
    return logits, greedy, sum(p.numel() for p in model.parameters())


def _assert_matches(got: dict, ref_logits, ref_greedy, what: str, real_only: bool = False) -> None:
    assert "error" not in got, got.get("error")
    got_logits = got["logits"]
    if real_only:  # fused layers: logits at left-padding positions carry no meaning (HF's are arbitrary too)
        real = left_pad(prompts())[1].bool()
        got_logits, ref_logits = got_logits[real], ref_logits[real]
    torch.testing.assert_close(got_logits, ref_logits, **MODEL_LOGITS_TOL[torch.float32], msg=what)
    assert torch.equal(got["greedy"], ref_greedy), f"{what}: greedy tokens differ from tp=1"


@pytest.mark.parametrize("name", list(ROWS))
def test_tp2_matches_tp1(run, name):
    paths, results = run
    logits, greedy, n_params = _reference(paths[name])
    for rank, res in enumerate(results):
        _assert_matches(res[name], logits, greedy, f"{name} rank {rank}")
    # sampling: each rank seeded differently, rank 0's RNG state broadcast first -> identical draws
    assert torch.equal(results[0][name]["sampled"], results[1][name]["sampled"])
    # the weights really are split: each rank holds well under the full count
    assert results[0][name]["n_params"] < 0.75 * n_params
    if name == "uneven":
        assert [r[name]["local_mlp"] for r in results] == [72, 64]


@pytest.mark.parametrize("name", FUSED)
def test_tp2_fused_layers_match_tp1(run, name):
    """Kernel injection on a TP-split model: fused layers on each rank's slices equal HF at tp=1."""
    paths, results = run
    logits, greedy, n_params = _reference(paths[name])
    for rank, res in enumerate(results):
        got = res[name + "+fused"]
        assert "error" not in got, got.get("error")
        assert got["fused"], f"{name} rank {rank} fell back to HF's modules"
        _assert_matches(got, logits, greedy, f"{name} fused rank {rank}", real_only=True)
        assert got["n_params"] < 0.75 * n_params
    assert torch.equal(results[0][name + "+fused"]["sampled"], results[1][name + "+fused"]["sampled"])


def test_init_inference_shards_in_place_and_mp_checkpoint_reloads(run):
    paths, results = run
    logits, greedy, _ = _reference(paths["llama_kv2"])
    for res in results:
        _assert_matches(res["inplace"], logits, greedy, "init_inference tp=2")
        _assert_matches(res["from_mp"], logits, greedy, "reloaded from save_mp_checkpoint_path")
    assert torch.equal(results[0]["inplace"]["sampled"], results[1]["inplace"]["sampled"])


def test_indivisible_settings_name_the_numbers(run):
    _, results = run
    for res in results:
        assert "tp_size=3 does not divide the world size 2" in res["err_world"], res["err_world"]
        assert "tp_size=2 is more than num_attention_heads (1)" in res["err_heads"], res["err_heads"]


# -- families AutoTP learned from their structure (HF modules on 2 ranks) ---------------------------------------------

_GQA = dict(hidden_size=96, intermediate_size=136, num_attention_heads=6, num_key_value_heads=2)
# name -> (model_type, config, auto class): configs built here, so no fused policy or tiny_models row is needed
FAMILIES = {
    "olmo2": ("olmo2", _GQA, "AutoModelForCausalLM"),  # full-width q/k RMSNorm: statistics all-reduced
    "olmo3_mqa": ("olmo3", dict(_GQA, num_key_value_heads=1), "AutoModelForCausalLM"),  # k norm over a replicated head
    "bloom": ("bloom", dict(hidden_size=96, n_head=6), "AutoModelForCausalLM"),  # alibi sliced, per-head qkv
    "codegen": ("codegen", dict(n_embd=128, n_head=8, n_inner=136, rotary_dim=8), "AutoModelForCausalLM"),
    "gemma": ("gemma", dict(_GQA, head_dim=16), "AutoModelForCausalLM"),
    "gemma3_text": ("gemma3_text", dict(_GQA, head_dim=16, sliding_window=4), "AutoModelForCausalLM"),
    "granite": ("granite", dict(_GQA, embedding_multiplier=2.0, attention_multiplier=0.2, logits_scaling=2.0),
                "AutoModelForCausalLM"),
    "cohere": ("cohere", dict(_GQA, use_qk_norm=True), "AutoModelForCausalLM"),
    "glm4": ("glm4", _GQA, "AutoModelForCausalLM"),
    "starcoder2": ("starcoder2", dict(_GQA, sliding_window=4), "AutoModelForCausalLM"),
    "gpt_neo": ("gpt_neo", dict(hidden_size=96, num_heads=6, num_layers=2, attention_types=[[["global", "local"], 1]],
                                window_size=4, intermediate_size=136), "AutoModelForCausalLM"),
    "roberta": ("roberta", dict(hidden_size=96, intermediate_size=136, num_attention_heads=6, pad_token_id=1),
                "AutoModelForMaskedLM"),
    "distilbert": ("distilbert", dict(dim=96, hidden_dim=136, n_heads=6, n_layers=2), "AutoModelForMaskedLM"),
}
ENCODERS = {name for name, (_, _, auto) in FAMILIES.items() if auto != "AutoModelForCausalLM"}


def save_family(name: str, directory) -> str:
    """Build and save one FAMILIES row (two layers, vocab 500, seeded weights); return the path."""
    import transformers

    model_type, config, auto = FAMILIES[name]
    common = dict(vocab_size=500, num_hidden_layers=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1,
                  eos_token_id=2)
    config = transformers.AutoConfig.for_model(model_type, **{**common, **config})
    torch.manual_seed(0)
    model = getattr(transformers, auto).from_config(config)
    with torch.no_grad():  # norms start at ones / zeros: perturb them so a mis-split norm weight shows
        for n, p in model.named_parameters():
            if "norm" in n.lower() and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(os.fspath(directory))
    return os.fspath(directory)


@pytest.fixture(scope="module")
def run_families(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp_families")
    paths = {name: save_family(name, base / name) for name in FAMILIES}
    return paths, launch({"families": paths, "families_fused": _with_policy()}, str(base))


def _with_policy() -> list[str]:
    """FAMILIES decoders that have a kernel-injection policy in this tree (their fused TP path is checked too)."""
    from hf_dsinfer.policies import POLICIES

    return [n for n, (model_type, _, _) in FAMILIES.items() if n not in ENCODERS and model_type in POLICIES]


@torch.no_grad()
def _family_reference(name: str, path: str):
    import transformers

    model = getattr(transformers, FAMILIES[name][2]).from_pretrained(path, dtype=torch.float32).eval()
    ids, mask = left_pad(prompts())
    logits = model(input_ids=ids, attention_mask=mask).logits
    greedy = None if name in ENCODERS else _generate(model, ids, mask, sample=False, new_tokens=FAMILY_TOKENS)
    return logits, greedy, sum(p.numel() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp2_autotp_families_match_tp1(run_families, name):
    paths, results = run_families
    logits, greedy, n_params = _family_reference(name, paths[name])
    for rank, res in enumerate(results):
        got = res[name]
        assert "error" not in got, got.get("error")
        torch.testing.assert_close(got["logits"], logits, **MODEL_LOGITS_TOL[torch.float32], msg=f"{name} rank {rank}")
        if greedy is not None:
            assert torch.equal(got["greedy"], greedy), f"{name} rank {rank}: greedy tokens differ from tp=1"
        assert got["n_params"] < 0.8 * n_params


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in ENCODERS])
def test_tp2_fused_families_match_tp1(run_families, name):
    """Where a family has a policy: kernel injection on each rank's AutoTP slices equals tp=1 (real positions)."""
    paths, results = run_families
    if name not in _with_policy():
        pytest.skip(f"{FAMILIES[name][0]} has no kernel-injection policy")
    import transformers

    import hf_dsinfer

    try:  # what injection does without TP: a config variant the policy does not fuse keeps HF's modules there too
        alone = transformers.AutoModelForCausalLM.from_pretrained(
            paths[name], inference_config={"dtype": "fp32", "replace_with_kernel_inject": True})
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the {FAMILIES[name][0]} policy fails without tensor parallelism too: {type(e).__name__}: {e}")
    fused_expected = hf_dsinfer.policies.is_injected(alone)  # olmo2 and bloom too (tests/test_parallel_coverage.py)
    logits, greedy, _ = _family_reference(name, paths[name])
    real = left_pad(prompts())[1].bool()
    for rank, res in enumerate(results):
        got = res[name + "+fused"]
        assert "error" not in got, got.get("error")
        assert got["fused"] == fused_expected, f"{name} rank {rank}: fused={got['fused']}"
        torch.testing.assert_close(got["logits"][real], logits[real], **MODEL_LOGITS_TOL[torch.float32])
        assert torch.equal(got["greedy"], greedy), f"{name} fused rank {rank}: greedy tokens differ from tp=1"


# -- three ranks: uneven head and vocab splits -------------------------------------------------------------------------

_WIDE = dict(hidden_size=160, num_attention_heads=40, intermediate_size=200, vocab_size=50257)  # head_dim 4
# name -> (tiny_models row, overrides, expected (local q heads, local kv heads) per rank)
UNEVEN3 = {
    "llama40": ("llama", dict(_WIDE, num_key_value_heads=40), [(14, 14), (13, 13), (13, 13)]),
    "llama40_kv8": ("llama", dict(_WIDE, num_key_value_heads=8), [(15, 3), (15, 3), (10, 2)]),
    "gpt2_40": ("gpt2", dict(n_embd=160, n_head=40, n_inner=200, vocab_size=50257), [(14, 14), (13, 13), (13, 13)]),
}
VOCAB_ROWS_3 = [16768, 16768, 16721]  # 785 units of 64 dealt 262 / 262 / 261, the 17 rows left over to the last rank


@pytest.fixture(scope="module")
def run3(tmp_path_factory):
    """Three ranks, 40 heads and vocab 50257: HF modules and fused layers, default tp_grain_size (64)."""
    base = tmp_path_factory.mktemp("tp3")
    paths = {name: save_tiny(row, base / name, **over) for name, (row, over, _) in UNEVEN3.items()}
    return paths, launch({"models": paths, "fused": list(UNEVEN3)}, str(base), world=3)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(UNEVEN3))
def test_tp3_uneven_heads_and_vocab_match_tp1(run3, name):
    paths, results = run3
    logits, greedy, n_params = _reference(paths[name])
    expected_heads = UNEVEN3[name][2]
    for rank, res in enumerate(results):
        _assert_matches(res[name], logits, greedy, f"{name} rank {rank}")
        assert res[name]["split"] == (expected_heads[rank], VOCAB_ROWS_3)
        assert res[name]["n_params"] < 0.5 * n_params
        got = res[name + "+fused"]
        assert "error" not in got, got.get("error")
        assert got["fused"], f"{name} rank {rank} fell back to HF's modules"
        assert got["split"] == (expected_heads[rank], VOCAB_ROWS_3)
        _assert_matches(got, logits, greedy, f"{name} fused rank {rank}", real_only=True)
    if name in LOCAL_MLP:  # intermediate 200 = 3 units of 64 + 8 left over for the last rank
        assert [r[name]["local_mlp"] for r in results] == [64, 64, 72]
    for key in (name, name + "+fused"):
        assert all(torch.equal(results[0][key]["sampled"], r[key]["sampled"]) for r in results[1:])


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    worker(sys.argv[2])
    sys.exit(0)
