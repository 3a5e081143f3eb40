"""``hf-dsinfer bench --prefill`` (hf_dsinfer/bench/prefill.py): forward-only scoring, hf_dsinfer vs HF sdpa."""

from __future__ import annotations

import pytest
import torch

from hf_dsinfer.bench.prefill import parse_points, prefill_table, run_prefill_bench


def test_prefill_bench_alternates_and_agrees_with_sdpa():
    threads = torch.get_num_threads()
    report = run_prefill_bench("tiny", points=((2, 24), (1, 40)), rounds=2, threads=1)
    assert torch.get_num_threads() == threads
    runs = report["runs"]
    assert [(r["batch"], r["length"], r["round"], r["name"]) for r in runs] == [
        (b, n, k, name) for b, n in ((2, 24), (1, 40)) for k in (1, 2) for name in ("HF sdpa", "hf_dsinfer")]
    assert all(r["error"] is None and r["tok_s"] > 0 for r in runs)
    # the fused model scores what HF's sdpa model scores (fp32: summation order only)
    assert set(report["logits_rel_diff"]) == {"2x24", "1x40"}
    assert max(report["logits_rel_diff"].values()) < 1e-4
    table = prefill_table(report)
    assert "| 2x24 |" in table and table.count("| hf_dsinfer |") == 4  # every run listed


def test_points_parse_and_refuse_bad_input():
    assert parse_points("1x512, 8X1024") == ((1, 512), (8, 1024))
    for bad in ("1x", "x512", "0x512", "", "1x512x3"):
        with pytest.raises(SystemExit, match="--prefill-points"):
            parse_points(bad)


def test_too_long_for_the_preset_is_refused():
    with pytest.raises(ValueError, match="at most 1024 positions"):
        run_prefill_bench("tiny", points=((1, 2048),), rounds=1, threads=1)
