"""``hf-dsinfer bench --peer llamacpp`` (hf_dsinfer/bench/llamacpp.py): the bench path with llama.cpp absent (on a tiny
model: our rows run, llama.cpp's are skipped with the reason) and present (on SmolLM2: same greedy text as ours)."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch
from tiny_models import save_tiny

from hf_dsinfer.bench import llamacpp
from hf_dsinfer.bench.cli import add_bench_arguments, bench_main
from hf_dsinfer.real_model import SMOLLM2_INSTALL, smollm2_available

HAVE_PEER = importlib.util.find_spec("xllamacpp") is not None and llamacpp.peer_unavailable() is None


def test_peer_absent_runs_ours_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", "0")  # the compiled step has its own tests; keep this one quick
    monkeypatch.setattr(llamacpp, "peer_unavailable", lambda: "xllamacpp does not import (test)")
    folder = save_tiny("llama", tmp_path / "tiny")
    threads = torch.get_num_threads()
    report = llamacpp.run_llamacpp_bench(prompt_len=8, new_tokens=4, rounds=2, threads=(1,), formats=("fp32", "int4"),
                                         folder=folder, source=None)  # fmt: skip
    assert torch.get_num_threads() == threads  # the thread count is restored
    assert report["skipped"] == {"llama.cpp F32": "xllamacpp does not import (test)",
                                 "llama.cpp Q4_1": "xllamacpp does not import (test)"}  # fmt: skip
    names = [r["name"] for r in report["runs"]]
    assert names == ["hf_dsinfer fp32", "hf_dsinfer int4", "HF eager fp32"] * 2  # alternating, every round kept
    assert all(r["error"] is None and r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 for r in report["runs"])
    assert [r["round"] for r in report["runs"]] == [1, 1, 1, 2, 2, 2]
    # fp32 greedy output is HF eager's (EOS masked on both); the int4 model reads fewer bytes per step than fp32
    assert report["texts"]["hf_dsinfer fp32"] == report["texts"]["HF eager fp32"]
    mb = {r["name"]: r["step_mb"] for r in report["runs"]}
    assert mb["hf_dsinfer int4"] < mb["hf_dsinfer fp32"] == mb["HF eager fp32"]
    assert report["same_text"] == {"fp32": None, "int4": None}  # nothing to compare with
    table = llamacpp.llamacpp_tables(report)
    assert "**Skipped:** llama.cpp F32: xllamacpp does not import (test)" in table
    assert table.count("| hf_dsinfer int4 |") == 3  # one summary row, two runs


def test_cli_refuses_random_presets():
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    with pytest.raises(SystemExit, match="--preset smollm2-real"):
        bench_main(p.parse_args(["--peer", "llamacpp", "--preset", "tiny"]))


def test_read_bandwidth_is_positive_and_restores_threads():
    threads = torch.get_num_threads()
    assert llamacpp.read_bandwidth_gbs(1, nbytes=1 << 24) > 0
    assert torch.get_num_threads() == threads


@pytest.mark.skipif(not HAVE_PEER, reason=f"llama.cpp's wheel is not installed: {llamacpp.PEER_INSTALL}")
@pytest.mark.skipif(not smollm2_available(), reason=f"SmolLM2 is not installed: `{SMOLLM2_INSTALL}`")
def test_peer_present_same_greedy_text_and_bytes_on_smollm2():
    report = llamacpp.run_llamacpp_bench(prompt_len=16, new_tokens=8, rounds=1, threads=(1,), formats=("fp32",),
                                         with_eager=False)  # fmt: skip
    assert report["skipped"] == {}
    assert [r["name"] for r in report["runs"]] == ["llama.cpp F32", "hf_dsinfer fp32"]
    assert all(r["error"] is None for r in report["runs"])
    # the F32 GGUF holds the HF folder's weights (both dequantized from the shipped Q4_1): same greedy text, and a
    # decode step reads the same bytes (the tied embedding as the head, no input embedding) in both
    assert report["same_text"] == {"fp32": True}
    llama, ours = report["runs"]
    assert llama["step_mb"] == pytest.approx(ours["step_mb"], rel=0.01)


def test_profile_decode_lists_the_gemms(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_dsinfer.bench.decode import profile_decode
    from hf_dsinfer.integration.engine import init_inference

    model = AutoModelForCausalLM.from_pretrained(save_tiny("llama", tmp_path / "tiny"), dtype=torch.float32)
    model = init_inference(model, dtype="fp32", replace_with_kernel_inject=True, keep_module_on_host=True,
                           cpu_compile=False, max_out_tokens=32).module  # fmt: skip
    res = profile_decode(model, torch.tensor([[5, 6, 7, 8]]), new_tokens=4, top=40)
    assert res["ms_per_step"] > 0 and res["profiled_ms_per_step"] > 0
    ops = {o["op"]: o for o in res["ops"]}
    mm = [o for name, o in ops.items() if name in ("aten::mm", "aten::addmm", "aten::linear")]
    assert mm and all(o["calls"] >= 1 for o in mm)  # per decode step: the layers' GEMMs at least once each
    assert sorted((o["self_ms"] for o in res["ops"]), reverse=True) == [o["self_ms"] for o in res["ops"]]


def test_llamacpp_process_reports_failures_and_closes(tmp_path):
    """The child process that hosts llama.cpp answers a request it cannot serve (no xllamacpp, or no such GGUF) with
    an error naming the cause, stays usable for the next request, and closes."""
    from hf_dsinfer.bench.llamacpp_worker import LlamaCppProcess

    proc = LlamaCppProcess(str(tmp_path / "missing.gguf"), 64)
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="llama.cpp"):
                proc.completions(1, {"prompt": [1, 2], "n_predict": 2})
        assert proc._proc is not None and proc._proc.is_alive()
    finally:
        proc.close()
    assert proc._proc is None
