"""``hf-dsinfer bench --compile-pending``'s report arithmetic (hf_dsinfer/bench/compile_pending.py), on a made-up run:
the child itself needs the real SmolLM2 and minutes of compiling, and runs from the CLI only."""

from __future__ import annotations

import pytest

from hf_dsinfer.bench import compile_pending


def _run() -> dict:
    calls = [
        dict(who="hf", state="alone", ms=50.0, load=0.5),
        dict(who="hf", state="alone", ms=60.0, load=0.5),
        dict(who="hf", state="alone", ms=55.0, load=0.6),
        dict(who="ours", state="pending", ms=45.0, load=0.7, t=[0.0, 1.0]),
        dict(who="hf", state="pending", ms=90.0, load=0.8),
        dict(who="ours", state="pending", ms=58.0, load=0.9, t=[2.0, 3.0]),
        dict(who="hf", state="pending", ms=50.0, load=1.0),
        dict(who="ours", state="compiled", ms=30.0, load=1.1, t=[4.0, 5.0]),
        dict(who="hf", state="alone", ms=52.0, load=1.2),
    ]
    # full collections: one inside the second call (0.25 s), one straddling its end (0.1 s inside), one unfinished
    gcs = [[2.25, 2.5], [2.9, 3.3], [1.5, 1.6], [6.0, float("nan")]]
    return dict(calls=calls, compile_s=120.0, failed=False, threads=2, parked_s=1.0, lent_s=0.5, full_gcs=gcs,
                variant="default", run=0)


def test_summary_counts_calls_and_full_collections():
    run = _run()
    summary = compile_pending._summary(run)
    assert summary["hf_alone_ms"] == 53.5  # the median of HF calls with nothing compiling (before and after)
    assert summary["ours_pending_ms"] == [45.0, 58.0]
    assert summary["slower_than_hf"] == 1
    assert summary["ours_compiled_ms"] == [30.0]
    assert summary["ratio_to_next_hf"] == [pytest.approx(0.5), pytest.approx(1.16)]
    assert summary["slower_than_next_hf"] == 1
    assert summary["full_gc_ms"] == [250, 400, 100]  # the unfinished one is left out
    assert summary["full_gc_in_pending_ms"] == [0, 350]  # 250 ms inside + 100 ms of the straddling one
    run.update(summary)
    row = compile_pending._row(run)
    assert "| 1 of 2 |" in row and "250, 400, 100; in our calls: call 2: 350" in row
    assert row.count("|") == compile_pending.HEADER.splitlines()[0].count("|")


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit, match="--pending-variants"):
        compile_pending.run_pending_bench(1, 8, 8, None, ["nope"])
