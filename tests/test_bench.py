"""``hf-dsinfer bench``: the tiny preset runs on CPU, prints the comparison table and writes JSON and markdown."""

from __future__ import annotations

import json

import pytest
import torch

from hf_dsinfer.bench import PRESETS, build_random_model, markdown_table, preset_config
from hf_dsinfer.cli import main


def test_bench_tiny_prints_table_and_writes_json(tmp_path, capsys):
    argv = ["bench", "--preset", "tiny", "--batch-sizes", "1,2", "--prompt-len", "8", "--new-tokens", "6",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| contender | batch |" in out
    for name in ("HF eager", "HF static+compile", "hf_dsinfer"):
        assert name in out
    report = json.loads((tmp_path / "bench-tiny.json").read_text())
    assert (tmp_path / "bench-tiny.md").read_text() == markdown_table(report)
    assert report["copy_gbs"] > 0
    rows = {(r["peer"], r["batch"]): r for r in report["rows"]}
    assert set(rows) == {(p, b) for p in ("eager", "compile", "dsinfer") for b in (1, 2)}
    for peer in ("eager", "dsinfer"):  # these must always run; compile may report n/a with its reason
        for b in (1, 2):
            r = rows[(peer, b)]
            assert r["note"] == "", r["note"]
            assert r["decode_tokens_per_s"] > 0 and r["ttft_ms"] > 0 and r["gbs"] > 0
    for b in (1, 2):
        assert rows[("dsinfer", b)]["tokens_match"] is True  # greedy tokens compared with HF eager's
        r = rows[("compile", b)]
        assert r["decode_tokens_per_s"] or r["note"].startswith("n/a: ")
    # three repeats by default, each row with its spread
    assert report["settings"]["repeats"] == 3
    for peer in ("eager", "dsinfer"):
        r = rows[(peer, 1)]
        assert 0 < r["tokens_per_s_min"] <= r["decode_tokens_per_s"] <= r["tokens_per_s_max"]
        assert r["spread"] >= 1.0


def test_noisy_rows_are_flagged_and_plotted(tmp_path, capsys, caplog):
    import logging

    import hf_dsinfer.bench as bench
    from hf_dsinfer.log import LOGGER_NAME

    pytest.importorskip("matplotlib")
    plot = tmp_path / "bench.png"
    argv = ["bench", "--peers", "eager", "--batch-sizes", "1,2", "--prompt-len", "4", "--new-tokens", "3",
            "--out", str(tmp_path), "--plot", str(plot)]  # fmt: skip
    calls = iter(range(10**6))
    real = bench._timed

    def jittery(device, fn):  # every other full run 2x slower: a spread far above the 1.3x threshold
        ms = real(device, fn)
        return ms * (3 if next(calls) % 4 == 3 else 1)

    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        bench_jitter = pytest.MonkeyPatch.context()
        with bench_jitter as m:
            m.setattr(bench, "_timed", jittery)
            assert main(argv) == 0
    report = json.loads((tmp_path / "bench-tiny.json").read_text())
    assert bench.noisy_rows(report), report["rows"]
    assert "(noisy)" in capsys.readouterr().out
    assert any("varied" in r.getMessage() for r in caplog.records)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    import sys

    import hf_dsinfer.bench as bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        bench.write_plot({"rows": []}, str(tmp_path / "x.png"))


def test_na_row_for_a_failing_peer(tmp_path, capsys, monkeypatch):
    import hf_dsinfer.bench as bench

    def broken(peer, model, args, device):
        raise RuntimeError("no such backend\nsecond line")

    monkeypatch.setattr(bench, "_prepare", broken)
    argv = ["bench", "--peers", "eager", "--batch-sizes", "1,3", "--new-tokens", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "bench-tiny.json").read_text())
    assert [(r["peer"], r["batch"]) for r in report["rows"]] == [("eager", 1), ("eager", 3)]
    assert all(r["note"] == "n/a: RuntimeError: no such backend" for r in report["rows"])
    assert "| HF eager | 1 | n/a |" in capsys.readouterr().out


def test_random_model_keeps_ties_and_buffers():
    config = preset_config("qwen2-1.5b")
    config.num_hidden_layers, config.hidden_size, config.intermediate_size = 1, 96, 128
    config.num_attention_heads, config.num_key_value_heads, config.vocab_size = 6, 2, 300
    model = build_random_model(config, torch.device("cpu"), torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.is_meta for p in model.parameters())
    rot = model.model.rotary_emb.inv_freq
    assert torch.isfinite(rot).all() and rot[0] == 1.0
    assert set(PRESETS) >= {"tiny", "llama2-7b", "llama3-8b", "mistral-7b", "qwen2-1.5b", "opt-1.3b"}
    out = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


def test_bench_hybrid_mode_writes_table(tmp_path, capsys):
    from hf_dsinfer.cli import main

    main(["bench", "--hybrid", "--preset", "tiny", "--batch-sizes", "2", "--prompt-len", "8", "--new-tokens", "4",
          "--repeats", "1", "--device", "cpu", "--threads", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench-hybrid-tiny.json").read_text())
    assert len(report["rows"]) == 4 and all(r["generate_ms"] and r["generate_ms"] > 0 for r in report["rows"])
    assert "generate_ms" in capsys.readouterr().out


def test_token_disagreement_is_reported():
    import torch

    from hf_dsinfer.bench import mark_token_agreement

    same, other = torch.tensor([[5, 6, 7]]), torch.tensor([[5, 6, 8]])
    rows = [dict(peer="eager", batch=1, note="", _tokens=same), dict(peer="dsinfer", batch=1, note="", _tokens=same),
            dict(peer="compile", batch=1, note="", _tokens=other), dict(peer="dsinfer", batch=2, note="", _tokens=same)]
    mark_token_agreement(rows)
    assert [r["tokens_match"] for r in rows] == [True, True, False, None]
    assert rows[2]["note"] == "greedy tokens differ from HF eager" and all("_tokens" not in r for r in rows)
