"""The hf-dsinfer command: info and generate."""

import json
import subprocess
import sys

from tiny_models import save_tiny

from hf_dsinfer.cli import info_report, main
from hf_dsinfer.integration.support import TESTED_ARCHITECTURES


def test_info_report_contents():
    report = info_report()
    assert set(report["versions"]) >= {"torch", "transformers", "triton", "peft", "accelerate"}
    assert report["versions"]["torch"] != "not installed"
    assert report["kernels"]["backend"] in ("auto", "triton", "torch")
    assert set(TESTED_ARCHITECTURES) <= set(report["architectures"])


def test_info_json_via_python_m():
    out = subprocess.run(
        [sys.executable, "-m", "hf_dsinfer", "info", "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert "llama" in report["architectures"] and report["device"]


def test_info_text(capsys):
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "transformers" in text and "llama" in text and "kernels:" in text


def test_generate_command(tmp_path, capsys):
    path = save_tiny("llama", tmp_path)
    assert main(["generate", path, "--prompt", "Hello world", "--prompt", "The quick", "--dtype", "fp32",
                 "--max-new-tokens", "4", "--set", "max_out_tokens=128"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("Hello world") and lines[1].startswith("The quick")
