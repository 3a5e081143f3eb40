"""scripts/gpu_check.sh and its report writer, on CPU: the script's dry run, and the report built from step outputs."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _report_module():
    spec = importlib.util.spec_from_file_location("gpu_check_report", ROOT / "scripts" / "gpu_check_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_parses_and_dry_run_writes_the_report(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    out = tmp_path / "check"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["dry_run"] and rep["passed"]
    names = [s["name"] for s in rep["steps"]]
    assert names == ["pytest_cuda", "kernel_bench", "bench_llama3_8b", "bench_hybrid_grpo", "bench_serving"]
    assert sum(s["limit_s"] for s in rep["steps"]) <= 9.5 * 60  # the whole check fits the 9.5-minute budget
    cmds = {s["name"]: s["command"] for s in rep["steps"]}
    assert "-m cuda" in cmds["pytest_cuda"]
    assert "--preset llama3-8b" in cmds["bench_llama3_8b"] and "--batch-sizes 1,32" in cmds["bench_llama3_8b"]
    grpo = cmds["bench_hybrid_grpo"]  # issue 35's GPU goal: the GRPO 8 x 8 batch on the Qwen2.5-1.5B shape, bf16
    assert all(a in grpo for a in ("--hybrid", "--preset qwen2-1.5b", "--batch-sizes 64", "--num-generations 8",
                                   "--dtype bf16"))  # fmt: skip
    assert all(k in rep["env"] for k in ("date_utc", "torch", "triton", "transformers", "device"))
    md = (out / "report.md").read_text()
    assert md.startswith("# GPU check: DRY RUN") and "| pytest_cuda | dry-run |" in md


def test_report_collects_figures_failures_and_goals(tmp_path):
    mod = _report_module()
    steps = [
        {"name": "pytest_cuda", "rc": 1, "seconds": 50, "limit_s": 180, "dry_run": False, "command": "pytest -m cuda"},
        {"name": "bench_llama3_8b", "rc": 124, "seconds": 180, "limit_s": 180, "dry_run": False, "command": "b"},
        {"name": "kernel_bench", "rc": 0, "seconds": 40, "limit_s": 90, "dry_run": False, "command": "k"},
    ]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (tmp_path / "env.json").write_text(json.dumps({"device": "Test GPU", "torch": "x", "date_utc": "d"}))
    (tmp_path / "pytest-cuda.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="boom"/></testcase>'
        '<testcase classname="tests.test_a" name="test_skip"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    # Input figures for the arithmetic only (made up, not measurements).
    rows = [
        {"peer": "compile", "batch": 1, "decode_tokens_per_s": 100.0, "pct_copy_bw": 60.0},
        {"peer": "dsinfer", "batch": 1, "decode_tokens_per_s": 150.0, "pct_copy_bw": 91.0},
        {"peer": "compile", "batch": 32, "decode_tokens_per_s": 1000.0, "pct_copy_bw": 50.0},
        {"peer": "dsinfer", "batch": 32, "decode_tokens_per_s": 1200.0, "pct_copy_bw": 55.0},
    ]
    (tmp_path / "bench-llama3-8b.json").write_text(json.dumps({"settings": {"prompt_len": 128}, "copy_gbs": 10.0,
                                                               "rows": rows}))  # fmt: skip
    serve_rows = [{"workload": "mixed, at once", "contender": "hf_cb", "tokens_per_s": 400.0},
                  {"workload": "mixed, at once", "contender": "cb", "tokens_per_s": 700.0},
                  {"workload": "mixed, poisson 8.0/s", "contender": "cb", "tokens_per_s": 1.0}]  # fmt: skip
    (tmp_path / "serve-opt-1.3b-t16.json").write_text(json.dumps({"rows": serve_rows}))
    (tmp_path / "kernels.json").write_text(json.dumps({"dtype": "bf16", "copy_gbs": 10.0,
                                                       "rows": [{"kernel": "rms_norm", "triton_ms": 0.01}]}))
    hybrid_rows = [{"peer": "hf", "mode": "full", "generate_ms": 5000.0},
                   {"peer": "hybrid", "mode": "full", "speedup": 6.0, "switch_pct": 2.5},
                   {"peer": "peft", "mode": "lora", "generate_ms": 7000.0},
                   {"peer": "hybrid", "mode": "lora", "speedup": 4.0, "switch_pct": 0.5}]  # fmt: skip
    (tmp_path / "bench-hybrid-qwen2-1.5b.json").write_text(json.dumps({"settings": {}, "rows": hybrid_rows}))
    assert mod.main(["report", str(tmp_path)]) == 1  # a failed step fails the check
    rep = json.loads((tmp_path / "report.json").read_text())
    assert not rep["passed"] and not rep["dry_run"]
    assert [s["status"] for s in rep["steps"]] == ["fail", "timeout", "pass"]
    assert rep["pytest_cuda"]["passed"] == 1 and rep["pytest_cuda"]["failed_ids"] == ["tests.test_a::test_bad"]
    goals = {g["goal"]: g for g in rep["goals"]}
    assert goals["batch-1 decode >= 90% of the in-run copy bandwidth"]["met"] is True
    assert goals["batch-1 decode >= 1.4x HF static+compile"]["value"] == 1.5
    serving = goals["serving: continuous batching >= 1.5x transformers' generate_batch tokens/s"]
    assert serving["value"] == 1.75 and serving["met"] is True  # 700 / 400 on the requests arriving at once
    assert goals["batch-32 decode >= 1.3x HF static+compile"]["met"] is False  # 1.2x
    hybrid = {k.split(": ", 1)[1]: g for k, g in goals.items() if k.startswith("hybrid GRPO 8x8, full")}
    assert hybrid["engine >= 5x HF generate"]["met"] is True  # 6x
    assert hybrid["switch <= 2% of generate"]["met"] is False and hybrid["switch <= 2% of generate"]["target"] == 2.0
    lora = {k.split(": ", 1)[1]: g["met"] for k, g in goals.items() if k.startswith("hybrid GRPO 8x8, LoRA")}
    assert lora == {"engine >= 5x peft generate": False, "switch <= 2% of generate": True}
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# GPU check: FAIL") and "Test GPU" in md and "tests.test_a::test_bad" in md
    assert "| rms_norm | 0.01 |" in md and "| dsinfer | 1 | 150 | 91 |" in md
    assert "GRPO 8x8, Qwen2.5-1.5B shape" in md
