"""``hf-dsinfer bench``: the tiny preset runs on CPU, prints the comparison table and writes JSON and markdown."""

from __future__ import annotations

import json

import pytest
import torch

from hf_dsinfer.bench.decode import PRESETS, build_random_model, preset_config
from hf_dsinfer.bench.report import markdown_table, noisy_rows
from hf_dsinfer.cli import main
from hf_dsinfer.real_model import SMOLLM2_INSTALL, smollm2_available


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

    import hf_dsinfer.bench.decode as bench
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
    assert noisy_rows(report), report["rows"]
    assert "(noisy)" in capsys.readouterr().out
    assert any("varied" in r.getMessage() for r in caplog.records)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    import sys

    import hf_dsinfer.bench.report as report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        report.write_plot({"rows": []}, str(tmp_path / "x.png"))


def test_failed_row_for_a_failing_peer(tmp_path, capsys, monkeypatch):
    import hf_dsinfer.bench.decode as bench

    def broken(peer, model, args, device):
        raise RuntimeError("no such backend\nsecond line")

    monkeypatch.setattr(bench, "_prepare", broken)
    argv = ["bench", "--peers", "eager", "--batch-sizes", "1,3", "--new-tokens", "2", "--out", str(tmp_path)]
    assert main(argv) == 0  # only HF's contender failed: reported, but not the bench's failure
    report = json.loads((tmp_path / "bench-tiny.json").read_text())
    assert [(r["peer"], r["batch"]) for r in report["rows"]] == [("eager", 1), ("eager", 3)]
    assert all(r["failed"] and r["error"] == "RuntimeError: no such backend" for r in report["rows"])
    assert all(r["note"] == "FAILED: RuntimeError: no such backend" for r in report["rows"])
    out = capsys.readouterr().out
    assert "| HF eager | 1 | n/a |" in out
    assert "**FAILED:** HF eager at batch 1, 3: RuntimeError: no such backend" in out


def test_failing_hf_dsinfer_fails_the_bench(tmp_path, capsys, monkeypatch):
    """An hf_dsinfer contender that raises: failed rows with the error, no identity claim over them, the plot marks
    it, and the command exits 1."""
    matplotlib_axes = pytest.importorskip("matplotlib.axes")

    import hf_dsinfer.bench.decode as bench

    real_prepare = bench._prepare

    def dsinfer_breaks(peer, model, args, device):
        if peer == "dsinfer":
            raise ValueError("fused layers refused this model")
        return real_prepare(peer, model, args, device)

    labels = []
    real_plot = matplotlib_axes.Axes.plot

    def recording_plot(self, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return real_plot(self, *args, **kwargs)

    monkeypatch.setattr(bench, "_prepare", dsinfer_breaks)
    monkeypatch.setattr(matplotlib_axes.Axes, "plot", recording_plot)
    plot = tmp_path / "bench.png"
    argv = ["bench", "--peers", "eager,dsinfer", "--batch-sizes", "1,2", "--prompt-len", "4", "--new-tokens", "3",
            "--repeats", "1", "--threads", "1", "--out", str(tmp_path), "--plot", str(plot)]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "bench-tiny.json").read_text())
    assert report["hf_dsinfer_failed"] is True
    failed = [r for r in report["rows"] if r["failed"]]
    assert [(r["peer"], r["batch"]) for r in failed] == [("dsinfer", 1), ("dsinfer", 2)]
    assert all(r["error"] == "ValueError: fused layers refused this model" for r in failed)
    assert "**FAILED:** hf_dsinfer at batch 1, 2: ValueError: fused layers refused this model" in out
    assert "in every row" not in out
    assert "Greedy tokens identical to HF eager's in the 2 row(s) that ran; **did not run (failed)**: hf_dsinfer " \
           "at batch 1, 2." in out  # fmt: skip
    assert "hf_dsinfer: FAILED (batch 1, 2)" in labels
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_token_agreement_line_covers_only_rows_that_ran():
    from hf_dsinfer.bench.report import token_agreement_line

    def row(peer, name, batch, match, failed=False):
        return dict(peer=peer, name=name, batch=batch, tokens_match=None if failed else match, failed=failed)

    ok = [row("eager", "HF eager", 1, True), row("dsinfer", "hf_dsinfer", 1, True)]
    assert token_agreement_line({"rows": ok}) == "Greedy tokens identical to HF eager's in every row."
    differ = ok[:1] + [row("dsinfer", "hf_dsinfer", 1, False), row("compile", "HF static+compile", 1, None, True)]
    assert token_agreement_line({"rows": differ}) == (
        "**Greedy tokens differ from HF eager's in 1 row(s)** (see the notes); **did not run (failed)**: "
        "HF static+compile at batch 1."
    )
    eager_failed = [row("eager", "HF eager", 1, None, True), row("dsinfer", "hf_dsinfer", 1, None)]
    assert token_agreement_line({"rows": eager_failed}).startswith("**Greedy tokens not compared**")
    assert token_agreement_line({"rows": [row("compile", "HF static+compile", 1, None)]}) is None


def test_noise_advice_fits_the_flags_given():
    from hf_dsinfer.bench.report import noise_advice

    assert noise_advice(1, 3) == "rerun with more --repeats (this run: 3) or on an idle machine"
    assert noise_advice(2, 5) == "rerun with more --repeats (this run: 5), --threads 1 or on an idle machine"
    report = {
        "preset": "tiny", "device": "cpu", "dtype": "fp32", "copy_gbs": 1.0,
        "settings": dict(prompt_len=4, new_tokens=3, repeats=3, threads=1),
        "rows": [dict(peer="eager", name="HF eager", batch=1, ttft_ms=1.0, decode_tokens_per_s=10.0,
                      tokens_per_s_min=5.0, tokens_per_s_max=12.0, spread=2.4, ms_per_token=100.0,
                      peak_mem_mib=1.0, gbs=1.0, pct_copy_bw=1.0, note="", tokens_match=True, failed=False)],
    }  # fmt: skip
    table = markdown_table(report)
    assert "**Noisy:** 1 row(s)" in table and "--threads 1" not in table
    report["settings"]["threads"] = 2
    assert "--threads 1" in markdown_table(report)


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

    main(
        [
            "bench",
            "--hybrid",
            "--preset",
            "tiny",
            "--batch-sizes",
            "2",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    report = json.loads((tmp_path / "bench-hybrid-tiny.json").read_text())
    assert len(report["rows"]) == 4 and all(r["generate_ms"] and r["generate_ms"] > 0 for r in report["rows"])
    assert "generate_ms" in capsys.readouterr().out


def test_bench_hybrid_inference_dtype_keeps_a_copy_and_reports_its_rounding(tmp_path):
    """``--inference-dtype bf16`` on an fp32 training model: the engine's copy is bf16 (not shared: another dtype),
    and the row's untimed logp_diff shows bf16's rounding, far above the fp32 copy's noise."""
    argv = ["bench", "--hybrid", "--preset", "tiny", "--batch-sizes", "2", "--prompt-len", "8", "--new-tokens", "4",
            "--repeats", "1", "--device", "cpu", "--threads", "1", "--dtype", "fp32"]  # fmt: skip
    main([*argv, "--inference-dtype", "bf16", "--out", str(tmp_path / "bf16")])
    main([*argv, "--out", str(tmp_path / "fp32")])
    rows = {}
    for name in ("bf16", "fp32"):
        report = json.loads((tmp_path / name / "bench-hybrid-tiny.json").read_text())
        assert report["settings"]["inference_dtype"] == name
        rows[name] = {r["mode"]: r for r in report["rows"] if r["peer"] == "hybrid"}
    for mode in ("full", "lora"):
        bf16, fp32 = rows["bf16"][mode], rows["fp32"][mode]
        assert bf16["inference_dtype"] == "bf16" and fp32["inference_dtype"] == "fp32"
        assert "copy dtype bf16" in bf16["note"] and "logp_diff" in bf16["note"]
        assert fp32["logp_diff"] < 1e-4 < bf16["logp_diff"] < 1.0
    assert rows["bf16"]["full"]["memory_mib"]["weights"] > 0  # its own (bf16) weights: nothing to share
    assert rows["fp32"]["full"]["memory_mib"]["weights"] == 0


def test_bench_hybrid_grpo_shape_on_random_weights(tmp_path):
    """``--num-generations 4`` on a random preset: 2 random prompts x 4 sampled rows. Each contender generates the
    full count, the engine prefills each distinct prompt once (its row says so), and the settings record G."""
    main(["bench", "--hybrid", "--preset", "tiny", "--batch-sizes", "8", "--num-generations", "4", "--prompt-len", "6",
          "--new-tokens", "3", "--repeats", "1", "--device", "cpu", "--threads", "1",
          "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "bench-hybrid-tiny.json").read_text())
    assert report["settings"]["num_generations"] == 4 and report["complete"]
    assert {(r["mode"], r["peer"]) for r in report["rows"]} == {("full", "hf"), ("full", "hybrid"), ("lora", "peft"),
                                                                ("lora", "hybrid")}  # fmt: skip
    for r in report["rows"]:
        assert not r["failed"] and r["num_generations"] == 4 and r["tokens_per_s"] == pytest.approx(
            8 * 3e3 / r["generate_ms"], rel=0.01)  # fmt: skip
        if r["peer"] == "hybrid":
            assert (r["prompt_tokens"], r["prefill_tokens_computed"]) == (8 * 6, 2 * 6)


def test_bench_hybrid_report_is_written_after_each_setup(tmp_path, monkeypatch):
    """A run stopped during the LoRA setup (a GPU check step past its time limit) leaves the full fine-tuning rows on
    disk, marked incomplete."""
    import hf_dsinfer.bench.hybrid as hybrid

    real = hybrid.run_hybrid_bench

    def stop_at_lora(*args, modes=("full", "lora"), **kw):
        if "lora" in modes:
            raise KeyboardInterrupt("the time limit")
        return real(*args, modes=modes, **kw)

    monkeypatch.setattr(hybrid, "run_hybrid_bench", stop_at_lora)
    argv = ["bench", "--hybrid", "--preset", "tiny", "--batch-sizes", "2", "--prompt-len", "4", "--new-tokens", "2",
            "--repeats", "1", "--device", "cpu", "--threads", "1", "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    report = json.loads((tmp_path / "bench-hybrid-tiny.json").read_text())
    assert not report["complete"] and {(r["mode"], r["peer"]) for r in report["rows"]} == {("full", "hf"),
                                                                                           ("full", "hybrid")}
    assert all(r["generate_ms"] > 0 for r in report["rows"])


def test_bench_hybrid_grpo_shape_checks_the_batch(tmp_path):
    from hf_dsinfer.bench.hybrid import run_hybrid_bench

    rows = run_hybrid_bench("tiny", batch=6, prompt_len=4, new_tokens=2, device="cpu", dtype="fp32", iterations=1,
                            modes=("full",), num_generations=4)  # fmt: skip
    assert all(r["failed"] and "--num-generations (4) completions" in r["error"] for r in rows)
    with pytest.raises(SystemExit, match="--num-generations .* needs --hybrid"):
        main(["bench", "--preset", "tiny", "--num-generations", "4", "--out", str(tmp_path)])


def test_bench_inference_dtype_needs_hybrid(tmp_path):
    with pytest.raises(SystemExit, match="--inference-dtype .* needs --hybrid"):
        main(["bench", "--preset", "tiny", "--inference-dtype", "bf16", "--out", str(tmp_path)])


def test_bench_hybrid_engine_failure_fails_the_bench(tmp_path, capsys, monkeypatch):
    import hf_dsinfer.hybrid.engine as engine

    def broken(*args, **kwargs):
        raise RuntimeError("engine refused")

    monkeypatch.setattr(engine, "HybridEngine", broken)
    code = main(
        [
            "bench",
            "--hybrid",
            "--preset",
            "tiny",
            "--batch-sizes",
            "1",
            "--prompt-len",
            "4",
            "--new-tokens",
            "2",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 1
    report = json.loads((tmp_path / "bench-hybrid-tiny.json").read_text())
    rows = {(r["mode"], r["peer"]): r for r in report["rows"]}
    assert set(rows) == {("full", "hf"), ("full", "hybrid"), ("lora", "peft"), ("lora", "hybrid")}
    for mode in ("full", "lora"):
        hybrid = rows[(mode, "hybrid")]
        assert hybrid["failed"] and hybrid["error"] == "RuntimeError: engine refused" and hybrid["generate_ms"] is None
        assert "speedup" not in hybrid
    assert rows[("full", "hf")]["generate_ms"] > 0 and not rows[("full", "hf")]["failed"]  # the peer still ran
    assert "**FAILED:** hf_dsinfer HybridEngine (full): RuntimeError: engine refused" in capsys.readouterr().out


def test_token_disagreement_is_reported():
    import torch

    from hf_dsinfer.bench.decode import mark_token_agreement

    same, other = torch.tensor([[5, 6, 7]]), torch.tensor([[5, 6, 8]])
    rows = [
        dict(peer="eager", batch=1, note="", _tokens=same),
        dict(peer="dsinfer", batch=1, note="", _tokens=same),
        dict(peer="compile", batch=1, note="", _tokens=other),
        dict(peer="dsinfer", batch=2, note="", _tokens=same),
    ]
    mark_token_agreement(rows)
    assert [r["tokens_match"] for r in rows] == [True, True, False, None]
    assert rows[2]["note"] == "greedy tokens differ from HF eager" and all("_tokens" not in r for r in rows)


def test_kernel_bench_reports_a_failing_group_and_exits_1(monkeypatch, capsys, tmp_path):
    """kernels/bench.py (GPU only): a kernel group that raises is printed as FAILED, the others still run, exit 1."""
    from hf_dsinfer.kernels import bench as kbench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kbench.main([]) == 1  # no CUDA: nothing measured is not a pass
    assert "needs a CUDA device" in capsys.readouterr().err
    row = dict(kernel="rms_norm", shape="[1, 4096]", dtype="bfloat16", triton_ms=0.01, ref_ms=0.02)

    def broken(*args, **kwargs):
        raise RuntimeError("PTX compile failed\nmore")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "fake GPU")
    monkeypatch.setattr(kbench, "measure_copy_gbs", lambda dev: 100.0)
    monkeypatch.setattr(kbench, "run_benchmarks", lambda *a, **k: [row])
    monkeypatch.setattr(kbench, "run_attention_benchmarks", broken)
    monkeypatch.setattr(kbench, "run_quant_benchmarks", lambda *a, **k: [])
    out_json = tmp_path / "k.json"
    assert kbench.main(["--json", str(out_json)]) == 1
    out = capsys.readouterr().out
    assert "| rms_norm |" in out and "**FAILED:** attention: RuntimeError: PTX compile failed" in out
    assert json.loads(out_json.read_text())["failed"] == {"attention": "RuntimeError: PTX compile failed"}


@pytest.mark.skipif(not smollm2_available(), reason=f"SmolLM2 is not installed: `{SMOLLM2_INSTALL}`")
@pytest.mark.xdist_group("smollm2")
def test_real_preset_times_the_trained_model(tmp_path, capsys):
    # issue 27: decode speed of the quantized real model next to its perplexity (one eager and one int8 token run;
    # int4-gptq shares the code path and is timed in docs/quantization.md)
    argv = ["bench", "--preset", "smollm2-real", "--peers", "eager,dsinfer", "--quant", "int8", "--batch-sizes", "1",
            "--prompt-len", "4", "--new-tokens", "3", "--repeats", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "bench-smollm2-real.json").read_text())
    rows = {r["peer"]: r for r in report["rows"]}
    assert set(rows) == {"eager", "dsinfer", "dsinfer-int8"} and not any(r["failed"] for r in rows.values())
    assert rows["dsinfer"]["tokens_match"] is True  # trained weights: fp32 injection gives HF eager's tokens
    assert preset_config("smollm2-real").hidden_size == 576  # the real config, not the random-weight twin's
    with pytest.raises(SystemExit, match="int4-gptq"):
        main(["bench", "--quant", "int3"])
