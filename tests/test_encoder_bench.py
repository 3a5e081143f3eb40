"""``hf-dsinfer bench --encoder`` on a tiny random BERT: every contender timed, the fused one exact, the files written.

Speed is not asserted (it depends on the machine and its load); docs/performance.md has measured runs on the real
all-MiniLM-L6-v2.
"""

import json

import pytest
from tiny_models import save_tiny

from hf_dsinfer.bench.encoder import CONTENDERS, SENTENCES, markdown_table, run_encoder_bench
from hf_dsinfer.cli import main


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return save_tiny("bert", tmp_path_factory.mktemp("bert"))


def test_encoder_bench_report_mean_pooling(bert_dir, one_thread):
    report = run_encoder_bench(bert_dir, batch_size=16, repeats=2, use_st=False, sentences=SENTENCES[:20])
    rows = {r["name"]: r for r in report["rows"]}
    assert tuple(rows) == CONTENDERS
    assert report["settings"]["pooling"] == "mean pooling" and report["settings"]["threads"] == 1
    for row in rows.values():
        assert 0 < row["min"] <= row["sentences_per_s"] <= row["max"]
        assert row["max_abs_diff_vs_eager"] < 1e-4, row  # fp32: the fused layers give HF's embeddings
    assert rows["hf-eager"]["vs_eager"] == 1.0 and rows["hf-sdpa"]["vs_sdpa"] == 1.0
    assert "| hf_dsinfer |" in markdown_table(report)


def test_bench_encoder_cli(bert_dir, tmp_path, capsys, one_thread):
    """The CLI flag; sentence-transformers (when installed) wraps the tiny model with its default mean pooling."""
    main(["bench", "--encoder", "--model", bert_dir, "--batch-sizes", "32", "--repeats", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench-encoder.json").read_text())
    assert report["settings"]["batch_size"] == 32 and len(report["rows"]) == 3
    assert all(r["max_abs_diff_vs_eager"] < 1e-4 for r in report["rows"])
    assert "sentences/s" in capsys.readouterr().out


def test_bench_encoder_bad_arguments(bert_dir, tmp_path):
    with pytest.raises(SystemExit, match="one batch size"):
        main(["bench", "--encoder", "--model", bert_dir, "--batch-sizes", "8,16", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="CPU path"):
        main(["bench", "--encoder", "--model", bert_dir, "--device", "cuda", "--out", str(tmp_path)])


def test_bench_encoder_failing_hf_dsinfer_fails_the_bench(bert_dir, tmp_path, capsys, monkeypatch, one_thread):
    """hf_dsinfer raising: its row is failed with the error, the HF rows still run, the command exits 1."""
    import hf_dsinfer.bench.encoder as bench_encoder

    real = bench_encoder.load_embedder

    def broken(path, contender, use_st):
        if contender == "hf_dsinfer":
            raise ValueError("no fused encoder here")
        return real(path, contender, use_st)

    monkeypatch.setattr(bench_encoder, "load_embedder", broken)
    argv = ["bench", "--encoder", "--model", bert_dir, "--batch-sizes", "32", "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 1
    report = json.loads((tmp_path / "bench-encoder.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert report["hf_dsinfer_failed"] is True
    assert rows["hf_dsinfer"]["failed"] and rows["hf_dsinfer"]["error"] == "ValueError: no fused encoder here"
    assert rows["hf_dsinfer"]["sentences_per_s"] is None
    assert rows["hf-sdpa"]["sentences_per_s"] > 0 and rows["hf-sdpa"]["max_abs_diff_vs_eager"] < 1e-4
    out = capsys.readouterr().out
    assert "| hf_dsinfer | FAILED: ValueError: no fused encoder here |" in out
    assert "**FAILED:** hf_dsinfer (ValueError: no fused encoder here)" in out
