"""The hf-dsinfer command: info and generate."""

import json
import subprocess
import sys

from tiny_models import save_tiny

from hf_dsinfer.cli import info_report, main
from hf_dsinfer.integration.support import TESTED_ARCHITECTURES


def test_info_report_contents():
    import transformers

    from hf_dsinfer.hf_compat import NEWEST_TESTED, OLDEST_TESTED, in_tested_range
    from hf_dsinfer.policies import POLICIES
    from hf_dsinfer.policies.generic import inference_path

    report = info_report()
    assert set(report["versions"]) >= {"torch", "transformers", "triton", "peft", "accelerate"}
    assert report["versions"]["torch"] != "not installed"
    assert report["kernels"]["backend"] in ("auto", "triton", "torch")
    assert set(TESTED_ARCHITECTURES) <= set(report["architectures"])
    assert report["transformers"] == {
        "version": transformers.__version__,
        "tested_range": [OLDEST_TESTED, NEWEST_TESTED],
        "in_tested_range": in_tested_range(),
    }
    assert set(report["paths"]) == {"fused", "generic", "hf"}
    # each family's label follows the path it really takes (a policy, the generic check, or HF modules)
    for model_type, label in {**report["architectures"], **report["other_examples"]}.items():
        path = inference_path(model_type)
        assert label.startswith({"fused": "fused layers", "generic": "generic", "hf": "HF modules"}[path]), label
        assert (path == "fused") == (model_type in POLICIES)
    assert report["other_examples"]["smollm3"].startswith("generic")  # AttentionInterface, no policy
    assert report["other_examples"]["mamba"].startswith("HF modules")  # no attention at all


def test_info_json_via_python_m():
    out = subprocess.run(
        [sys.executable, "-m", "hf_dsinfer", "info", "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert "llama" in report["architectures"] and report["device"]


def test_info_text(capsys, monkeypatch):
    import transformers

    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "transformers" in text and "llama" in text and "kernels:" in text
    assert f"transformers {transformers.__version__}: inside the tested range (5.17.0 to " in text
    assert "any other architecture: HF modules" not in text  # the old, wrong claim (generic path exists)
    for path in ("fused", "generic", "hf"):
        assert f"\n  {path} " in text
    from hf_dsinfer import hf_compat

    monkeypatch.setattr(hf_compat, "transformers_version", lambda: "9.0.0")  # a release after the newest tested
    assert main(["info"]) == 0
    assert "transformers 9.0.0: OUTSIDE the tested range" in capsys.readouterr().out


def test_generate_command(tmp_path, capsys):
    path = save_tiny("llama", tmp_path)
    assert (
        main(
            [
                "generate",
                path,
                "--prompt",
                "Hello world",
                "--prompt",
                "The quick",
                "--dtype",
                "fp32",
                "--max-new-tokens",
                "4",
                "--set",
                "max_out_tokens=128",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("Hello world") and lines[1].startswith("The quick")
    # after the texts: the warm-up call's time (the decode step's compile), then the timed call's figures
    assert lines[2].startswith("-- warm-up call ") and "not counted below" in lines[2]
    assert "prompt tokens:" in lines[3] and "new tokens: 8" in lines[3] and "time to first token:" in lines[3]
    assert "decode " in lines[3] and "overall " in lines[3] and "tokens/s" in lines[3]


def test_generate_json(tmp_path, capsys):
    path = save_tiny("llama", tmp_path)
    assert main(["generate", path, "--prompt", "Hello world", "--max-new-tokens", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["texts"][0].startswith("Hello world") and report["batch_size"] == 1
    assert report["new_tokens"] == 3 and report["prompt_tokens"] > 0
    assert report["time_to_first_token_ms"] > 0 and report["tokens_per_s"] > 0
    assert report["path"].startswith("fast")  # default config: fused layers, hf_dsinfer's loop
    # compile / warm-up apart from the decode rate
    assert report["warmup_ms"] > 0 and report["includes_warmup"] is False and report["decode_tokens_per_s"] > 0


def test_generation_report_without_warmup_says_so(capsys):
    from types import SimpleNamespace

    from hf_dsinfer.cli_generate import generation_report, print_generation

    stats = SimpleNamespace(ttft_ms=5.0, tokens_per_s=3.0, decode_tokens_per_s=2.5, path="fast")
    report = generation_report(["a b"], 2, stats, 1.5, 4)
    assert report["warmup_ms"] is None and report["includes_warmup"] is True
    print_generation(report)
    out = capsys.readouterr().out
    assert "no warm-up call (--no-warmup): the figures include the first call's compile" in out
    assert "decode 2.5 tokens/s, overall 3.0 tokens/s" in out
    warm = generation_report(["a b"], 2, stats, 1.5, 4, warmup_s=2.0)
    assert warm["warmup_ms"] == 2000.0 and warm["includes_warmup"] is False
