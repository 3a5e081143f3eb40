"""The defaults that give the fast path: ``dtype="auto"`` and ``replace_with_kernel_inject="auto"``.

They differ from DeepSpeed's (fp16, False) on purpose (docs/migration.md). Checked in every way in: the config
itself and its JSON round trip, ``from_pretrained``, ``pipeline``, ``init_inference`` and ``HybridEngine``.
"""

import json
import logging

import pytest
import torch
from tiny_models import build_tiny, save_tiny
from transformers import AutoModelForCausalLM, pipeline

import hf_dsinfer
from hf_dsinfer import InferenceConfig
from hf_dsinfer.integration.config import auto_dtype
from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.policies import is_injected


def test_auto_round_trips_through_json(tmp_path):
    cfg = InferenceConfig()
    assert cfg.to_dict()["dtype"] == "auto" and cfg.to_dict()["replace_with_kernel_inject"] == "auto"
    again = InferenceConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.dtype == "auto" and again.replace_with_kernel_inject == "auto"
    # Resolving "auto" for one model is not part of the config's identity and is never written out.
    cfg.resolve_dtype(torch.bfloat16, "cpu")
    assert cfg.to_dict()["dtype"] == "auto" and cfg == InferenceConfig()


def test_auto_dtype_rule(caplog):
    assert auto_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert auto_dtype(torch.float32, "cpu") == torch.float32
    assert auto_dtype(None, "cpu") == torch.get_default_dtype()
    assert auto_dtype(torch.float16, None) == torch.float16  # no device: as given (an explicit choice)
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        assert auto_dtype(torch.float16, "cpu") == torch.float32
    assert [r.levelno for r in caplog.records if "dtype='auto'" in r.getMessage()] == [logging.INFO]


def test_unresolved_auto_dtype_and_bad_inject_values_are_named():
    with pytest.raises(RuntimeError, match="dtype='auto'"):
        _ = InferenceConfig().torch_dtype
    with pytest.raises(ValueError, match="replace_with_kernel_inject must be True, False or 'auto'"):
        InferenceConfig(replace_with_kernel_inject="yes")
    assert InferenceConfig(kernel_inject="AUTO").replace_with_kernel_inject == "auto"
    assert InferenceConfig(replace_with_kernel_inject=False).injects is False
    assert InferenceConfig(dtype="bf16").resolve_dtype(torch.float32, "cpu") == torch.bfloat16  # explicit wins


def test_from_pretrained_default_config_is_fused_in_checkpoint_dtype(tmp_path):
    path = save_tiny("llama", tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path, inference_config={})
    assert is_injected(model) and next(model.parameters()).dtype == torch.float32
    # A saved model keeps "auto" in config.json and reloads the same way.
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved["dtype"] == "auto" and saved["replace_with_kernel_inject"] == "auto"
    assert is_injected(AutoModelForCausalLM.from_pretrained(tmp_path / "saved"))


def test_fp16_checkpoint_runs_in_fp32_on_cpu_with_one_info_line(tmp_path, caplog):
    path = tmp_path / "m"
    build_tiny("llama").to(torch.float16).save_pretrained(path)
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        model = AutoModelForCausalLM.from_pretrained(path, inference_config={})
    assert next(model.parameters()).dtype == torch.float32
    assert len([r for r in caplog.records if "dtype='auto'" in r.getMessage()]) == 1
    # An explicit dtype (from_pretrained's or the config's) is kept as given.
    explicit = AutoModelForCausalLM.from_pretrained(path, inference_config={}, dtype=torch.float16)
    assert next(explicit.parameters()).dtype == torch.float16
    configured = AutoModelForCausalLM.from_pretrained(path, inference_config={"dtype": "bf16"})
    assert next(configured.parameters()).dtype == torch.bfloat16


def test_kernel_inject_false_keeps_hf_modules(tmp_path):
    path = save_tiny("llama", tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path, inference_config={"replace_with_kernel_inject": False})
    assert not is_injected(model)


def test_pipeline_and_init_inference_defaults_are_fused(tmp_path):
    path = save_tiny("llama", tmp_path / "m")
    pipe = pipeline("text-generation", model=path, model_kwargs={"inference_config": {}})
    assert is_injected(pipe.model)
    built = build_tiny("llama").to(torch.bfloat16)
    engine = hf_dsinfer.init_inference(built)
    assert is_injected(engine.module) and next(engine.module.parameters()).dtype == torch.bfloat16


def test_hybrid_engine_default_config_is_fused_in_training_dtype():
    model = build_tiny("llama").to(torch.bfloat16)
    he = hf_dsinfer.HybridEngine(model, inference_config=InferenceConfig())
    assert he.config.torch_dtype == torch.bfloat16 and is_injected(he.module)
