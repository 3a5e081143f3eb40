"""hf_dsinfer/bench/speculation.py on a tiny random Llama: every round of every workload is reported, both contenders
give the same tokens, and the acceptance counters come from the engine."""

from __future__ import annotations

import pytest
from tiny_models import load_pair, make_tokenizer

from hf_dsinfer.bench.speculation import run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_speculation_bench_reports_every_round(tmp_path):
    _, opt, _ = load_pair("llama", tmp_path, {"dtype": "fp32", "replace_with_kernel_inject": True,
                                              "max_out_tokens": 256})  # fmt: skip
    report = run(opt, make_tokenizer(), rounds=2, new_tokens=24)
    rows = report["rows"]
    assert [(r["round"], r["workload"]) for r in rows] == [
        (i, w) for i in range(2) for w in ("copy", "chat", "copy-sampled")
    ]
    assert report["same_tokens"] == {"copy": True, "chat": True, "copy-sampled": True}
    for r in rows:
        assert r["plain_tokens"] == r["ngram_tokens"] > 0 and r["plain_s"] > 0 and r["ngram_s"] > 0
    assert any(r["acceptance"] is not None for r in rows)
