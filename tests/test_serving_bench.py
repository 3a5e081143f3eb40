"""The serving benchmark's pieces on a tiny model (the figures themselves are docs/serving.md's, not tested): the
workload is fixed by its seed, every contender answers every request with its own number of tokens, the report
renders."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import save_tiny

import hf_dsinfer  # noqa: F401 - registers inference_config=
from hf_dsinfer.bench.serving import arrivals, markdown, mixed_workload, run_manager, run_padded, write_plot

pytestmark = pytest.mark.usefixtures("one_thread")


def test_workload_and_arrivals_are_fixed_by_the_seed():
    a, b = mixed_workload(16, seed=3, vocab=100), mixed_workload(16, seed=3, vocab=100)
    assert a == b and a != mixed_workload(16, seed=4, vocab=100)
    assert all(16 <= len(p) <= 256 and 16 <= n <= 128 and all(3 <= t < 100 for t in p) for p, n in a)
    assert arrivals(4, None, 0) == [0.0] * 4
    poisson = arrivals(50, 10.0, 0)
    assert poisson == sorted(poisson) and 2.0 < poisson[-1] < 10.0  # ~49 gaps of 0.1 s


def test_contenders_answer_every_request(tmp_path):
    path = save_tiny("llama", tmp_path / "llama")
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        path, inference_config={"dtype": "fp32", "max_out_tokens": 96, "max_batch_size": 8}
    ).eval()
    work = [(p[:20], n) for p, n in mixed_workload(3, seed=0, vocab=300)]
    offsets = arrivals(3, 50.0, 0)
    cb = run_manager(ours, work, offsets)
    padded = run_padded(ours, work, offsets)
    want = sum(n for _, n in work)
    assert cb["tokens"] == padded["tokens"] == want and len(cb["ttft"]) == len(padded["ttft"]) == 3
    assert cb["preemptions"] == 0 and all(t > 0 for t in cb["ttft"] + padded["ttft"])
    report = {"preset": "tiny", "device": "cpu", "dtype": "fp32", "threads": torch.get_num_threads(), "requests": 3,
              "repeats": 1, "load_before": (0.0,), "load_after": (0.0,), "torch": "x", "transformers": "y",
              "rows": [{"workload": "mixed", "contender": "cb", "tokens_per_s": 1.0, "tokens_per_s_min": 1.0,
                        "tokens_per_s_max": 1.0, "ttft_p50_ms": 2.0, "ttft_p99_ms": 3.0}]}  # fmt: skip
    assert "| mixed | cb | 1.0 (1.0-1.0) | 2 / 3 |" in markdown(report)
    pytest.importorskip("matplotlib")
    write_plot(report, str(tmp_path / "serve.png"))
    assert (tmp_path / "serve.png").stat().st_size > 1000
