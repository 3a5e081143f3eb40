"""init_inference / InferenceEngine: DeepSpeed's entry point for a model that is already built."""

import json

import pytest
import torch
from tiny_models import PAD, build_tiny
from tolerances import MODEL_LOGITS_TOL, assert_close

import hf_dsinfer
from hf_dsinfer import InferenceEngine, init_inference
from hf_dsinfer.integration.apply import check_dtype_supported, get_inference_config

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])


@torch.no_grad()
def test_engine_wraps_and_matches_model():
    model = build_tiny("llama")
    expected = model(IDS).logits
    engine = init_inference(model, config={"dtype": "fp32"})
    assert isinstance(engine, InferenceEngine) and isinstance(engine, torch.nn.Module)
    assert engine.module is model
    assert get_inference_config(engine).dtype == "float32"
    # replace_with_kernel_inject="auto" (the default): fused layers, so HF's logits up to fp32 rounding
    assert_close(engine(input_ids=IDS).logits, expected, MODEL_LOGITS_TOL)
    out = engine.generate(IDS, max_new_tokens=5, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, model.generate(IDS, max_new_tokens=5, do_sample=False, pad_token_id=PAD))
    assert engine.config.model_type == "llama"  # HF attributes read through to the model


def test_config_and_kwargs_conflict_names_the_key():
    with pytest.raises(ValueError, match="dtype"):
        init_inference(build_tiny("llama"), config={"dtype": "fp32"}, dtype="fp16")


def test_unknown_kwarg_is_named():
    with pytest.raises(ValueError, match="'foo'"):
        init_inference(build_tiny("llama"), foo=1)


@torch.no_grad()
def test_dtype_conversion_and_json_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"dtype": "bf16", "max_tokens": 64}))
    engine = init_inference(build_tiny("gpt2"), config=str(path))
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    assert engine.inference_config.max_out_tokens == 64
    assert engine(input_ids=IDS).logits.dtype == torch.bfloat16


def test_keep_module_on_host_keeps_the_device():
    engine = init_inference(build_tiny("llama"), dtype="fp32", keep_module_on_host=True)
    assert next(engine.module.parameters()).device.type == "cpu"


@torch.no_grad()
def test_profile_model_time_records_and_clears():
    engine = init_inference(build_tiny("llama"), dtype="fp32")
    engine(input_ids=IDS)
    assert engine.model_times() == []  # not profiling yet
    engine.profile_model_time()
    engine(input_ids=IDS)
    engine(input_ids=IDS)
    times = engine.model_times()
    assert len(times) == 2 and all(isinstance(t, float) and t > 0 for t in times)
    assert engine.model_times() == []  # cleared when read


def test_bf16_on_a_device_without_it_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Fake V100")
    with pytest.raises(ValueError, match="dtype='bf16'.*Fake V100.*fp16"):
        check_dtype_supported(torch.bfloat16, torch.device("cuda", 0))
    check_dtype_supported(torch.float16, torch.device("cuda", 0))  # fp16 is fine


def test_rejects_non_modules_and_engines():
    with pytest.raises(TypeError, match="nn.Module"):
        init_inference("not a model")
    engine = init_inference(build_tiny("llama"), dtype="fp32")
    with pytest.raises(ValueError, match="engine.module"):
        init_inference(engine)


def test_unsupported_tp_leaves_model_usable():
    model = build_tiny("llama")
    with pytest.raises(ValueError, match="tensor_parallel.tp_size"):
        hf_dsinfer.init_inference(model, dtype="fp32", tensor_parallel={"tp_size": 2})
    assert model(IDS).logits.shape == (1, IDS.shape[1], 500)
