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
    # after the texts: prompt tokens, new tokens, time to first token, tokens/s
    assert "prompt tokens:" in lines[2] and "new tokens: 8" in lines[2] and "time to first token:" in lines[2]
    assert "tokens/s" in lines[2]


def test_generate_json(tmp_path, capsys):
    path = save_tiny("llama", tmp_path)
    assert main(["generate", path, "--prompt", "Hello world", "--max-new-tokens", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["texts"][0].startswith("Hello world") and report["batch_size"] == 1
    assert report["new_tokens"] == 3 and report["prompt_tokens"] > 0
    assert report["time_to_first_token_ms"] > 0 and report["tokens_per_s"] > 0
    assert report["path"].startswith("fast")  # default config: fused layers, hf_dsinfer's loop
