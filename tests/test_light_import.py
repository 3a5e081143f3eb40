"""``import hf_dsinfer`` and ``hf-dsinfer --help`` stay light, and the lazy registration still reaches every way in.

Checked in fresh interpreters (this test process has imported everything already). What gets imported
(``sys.modules``) is asserted, not timing: import times depend on the machine and its load (docs/performance.md
has measured times).
"""

import os
import subprocess
import sys
import textwrap

import pytest
from tiny_models import save_tiny

# Never loaded by `import hf_dsinfer`: the Hybrid Engine's dependencies, torch, and transformers' model code (which
# pulls torch._dynamo, torch.distributed, sympy and scipy in: several CPU-seconds).
HEAVY = (
    "torch",
    "triton",
    "peft",
    "trl",
    "transformers.trainer",
    "transformers.modeling_utils",
    "transformers.quantizers.auto",
    "torch._dynamo",
)
HOOKED = 'transformers.PreTrainedModel.__dict__["from_pretrained"].__func__._hf_dsinfer_hook'


def _run(script: str, cwd: str | None = None) -> str:
    # Run outside the repository root: there `kernels/` would shadow the kernels-hub package transformers probes.
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300, cwd=cwd or "/"
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_import_loads_no_torch_no_model_code_no_peft():
    _run(
        f"""
        import sys
        import hf_dsinfer
        loaded = [m for m in {HEAVY!r} if m in sys.modules]
        assert not loaded, f"import hf_dsinfer loaded {{loaded}}"
        assert hf_dsinfer.__version__
        """
    )


def test_registration_when_transformers_came_first():
    """Model code imported before hf_dsinfer: registered at import, once, and a reload does not wrap twice."""
    _run(
        f"""
        import importlib, sys
        import transformers
        from transformers.modeling_utils import PreTrainedModel
        import hf_dsinfer
        from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
        assert "dsinfer" in AUTO_QUANTIZER_MAPPING and {HOOKED}
        hook = PreTrainedModel.__dict__["from_pretrained"].__func__
        importlib.reload(hf_dsinfer)
        assert PreTrainedModel.__dict__["from_pretrained"].__func__ is hook
        assert not any(getattr(f, "_hf_dsinfer_post_import", False) for f in sys.meta_path)
        """
    )


@pytest.mark.parametrize("entry", ["--help", "generate --help"])
def test_cli_help_imports_no_torch(entry):
    out = _run(
        f"""
        import sys
        from hf_dsinfer.cli import main
        try:
            main({entry.split()!r})
        except SystemExit as e:
            assert e.code == 0, e.code
        loaded = [m for m in ("torch", "transformers", "triton") if m in sys.modules]
        assert not loaded, f"hf-dsinfer {entry} loaded {{loaded}}"
        """
    )
    assert "usage: hf-dsinfer" in out
    if entry == "--help":
        assert all(cmd in out for cmd in ("info", "generate", "bench"))


def test_bench_help_still_lists_its_options():
    out = _run("from hf_dsinfer.cli import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n")
    assert "--repeats" in out and "--preset" in out


def test_every_way_in_works_when_hf_dsinfer_is_imported_first(tmp_path):
    """Imported first, hf_dsinfer registers when transformers loads the modules it patches, and only then; then
    from_pretrained(inference_config=), pipeline(model_kwargs=), a saved model's reload and init_inference work in
    that interpreter (the lazy registration is the one in use)."""
    path = str(save_tiny("llama", tmp_path / "llama"))
    _run(
        f"""
        import sys
        import hf_dsinfer
        import transformers
        from transformers import AutoModelForCausalLM  # a lazy name: model code not loaded yet
        assert "transformers.modeling_utils" not in sys.modules
        from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, AutoQuantizationConfig  # the registry alone
        cfg = AutoQuantizationConfig.from_dict({{"quant_method": "dsinfer", "dtype": "fp32"}})
        assert type(cfg).__name__ == "InferenceConfig" and cfg.dtype == "float32", cfg
        assert AUTO_QUANTIZER_MAPPING["dsinfer"].__name__ == "DsInferQuantizer"
        assert "transformers.modeling_utils" not in sys.modules
        assert {HOOKED}  # touching PreTrainedModel imports modeling_utils: the hook is in place
        assert not any(getattr(f, "_hf_dsinfer_post_import", False) for f in sys.meta_path)  # finder removed
        assert "HybridEngineCallback" in dir(hf_dsinfer) and "init_inference" in dir(hf_dsinfer)
        import torch
        from transformers import pipeline

        from hf_dsinfer.integration.apply import get_inference_config

        model = AutoModelForCausalLM.from_pretrained({path!r}, inference_config={{"dtype": "fp32"}})
        assert get_inference_config(model) is not None and model.hf_quantizer is not None
        pipe = pipeline("text-generation", model={path!r}, model_kwargs={{"inference_config": {{"dtype": "fp32"}}}})
        assert get_inference_config(pipe.model) is not None
        model.save_pretrained({str(tmp_path / "saved")!r})
        again = AutoModelForCausalLM.from_pretrained({str(tmp_path / "saved")!r})  # config.json names dsinfer
        assert get_inference_config(again) is not None and again.hf_quantizer is not None
        ids = torch.tensor([[5, 17, 42, 99]])
        torch.testing.assert_close(again(ids).logits, model(ids).logits)
        plain = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32)
        engine = hf_dsinfer.init_inference(plain, dtype=torch.float32)
        assert get_inference_config(engine.module) is not None
        assert "peft" not in sys.modules
        engine = hf_dsinfer.HybridEngine  # first use imports the hybrid package
        assert engine.__name__ == "HybridEngine" and "hf_dsinfer.hybrid.engine" in sys.modules
        """,
        cwd=os.fspath(tmp_path),
    )


def test_post_import_hook_runs_once_and_never_breaks_the_import(tmp_path, monkeypatch, caplog):
    from hf_dsinfer.integration.post_import import when_imported

    (tmp_path / "hf_dsinfer_probe_mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def failing(module):
        raise RuntimeError("registration bug")

    when_imported("hf_dsinfer_probe_mod", lambda m: seen.append(m.VALUE + 1))
    when_imported("hf_dsinfer_probe_mod", failing)
    assert not seen  # nothing yet: the module is not imported
    import hf_dsinfer_probe_mod  # noqa: F401

    assert seen == [42]  # ran right after the module body, once
    assert "could not register with hf_dsinfer_probe_mod" in caplog.text  # the failing callback: a warning only
    finders = [f for f in sys.meta_path if getattr(f, "_hf_dsinfer_post_import", False)]
    assert all("hf_dsinfer_probe_mod" not in f.pending for f in finders)  # nothing left to watch for it
    when_imported("hf_dsinfer_probe_mod", lambda m: seen.append(0))  # already imported: runs at once
    assert seen == [42, 0]
    sys.modules.pop("hf_dsinfer_probe_mod")
