"""DeepSpeed's ``hybrid_engine`` section: DeepSpeed's names and defaults, unknown keys refused by name, keys without
meaning here accepted with one info log, and what the engine and the callback do with it."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from tiny_models import PAD, build_tiny, left_pad, prompts

from hf_dsinfer.hybrid import HybridEngine, HybridEngineCallback
from hf_dsinfer.hybrid import config as he_config
from hf_dsinfer.hybrid.config import HybridEngineSettings, read_hybrid_engine_config
from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.policies import get_injection

DS_CONFIG = {
    "train_batch_size": 8,
    "zero_optimization": {"stage": 2},
    "hybrid_engine": {
        "enabled": True,
        "max_out_tokens": 96,
        "inference_tp_size": 1,
        "release_inference_cache": True,
        "pin_parameters": True,
        "tp_gather_partition_size": 4,
    },
}


def test_deepspeed_defaults_and_names():
    assert read_hybrid_engine_config({"hybrid_engine": {}}) == HybridEngineSettings(
        enabled=False, max_out_tokens=512, inference_tp_size=1, release_inference_cache=False, pin_parameters=True,
        tp_gather_partition_size=8,
    )  # fmt: skip
    s = read_hybrid_engine_config(DS_CONFIG)
    assert (s.enabled, s.max_out_tokens, s.release_inference_cache, s.tp_gather_partition_size) == (True, 96, True, 4)
    assert read_hybrid_engine_config(DS_CONFIG["hybrid_engine"]) == s  # the section on its own


def test_unknown_key_refused_with_did_you_mean():
    with pytest.raises(ValueError, match=r"Unknown key 'max_out_token' .*Did you mean 'max_out_tokens'"):
        read_hybrid_engine_config({"hybrid_engine": {"enabled": True, "max_out_token": 64}})
    with pytest.raises(ValueError, match=r"hybrid_engine.max_out_tokens must be an integer >= 1, got 0"):
        read_hybrid_engine_config({"hybrid_engine": {"max_out_tokens": 0}})
    with pytest.raises(ValueError, match=r"hybrid_engine.enabled must be true or false"):
        read_hybrid_engine_config({"hybrid_engine": {"enabled": "yes"}})


def test_keys_without_meaning_here_log_once(caplog, monkeypatch):
    monkeypatch.setattr(he_config, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        read_hybrid_engine_config(DS_CONFIG)
        read_hybrid_engine_config(DS_CONFIG)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("pin_parameters has no effect here" in m for m in infos) == 1
    assert sum("tp_gather_partition_size has no effect here" in m for m in infos) == 1


def test_engine_reads_a_deepspeed_config_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS_CONFIG))
    model = build_tiny("llama", seed=0)
    he = HybridEngine(model, config=str(path))
    assert he.enabled and he.config.max_out_tokens == 96 and he.release_inference_cache
    ids, mask = left_pad(prompts((5, 9)))
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    with he.inference():
        out = he.generate(**gen)
    assert not get_injection(he.module).runtime.cache.keys, "release_inference_cache from the section"
    assert torch.equal(out, model.generate(**gen))
    with pytest.raises(ValueError, match=r"hybrid_engine.max_out_tokens=96 .* conflicts with max_out_tokens=64"):
        HybridEngine(model, inference_config={"max_out_tokens": 64}, config=DS_CONFIG)


def test_disabled_section_generates_on_the_training_model(caplog):
    model = build_tiny("llama", seed=0)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        he = HybridEngine(model, config={"train_batch_size": 8})  # no section: DeepSpeed's default, disabled
    assert not he.enabled and he.module is None
    assert any("no 'hybrid_engine' section" in r.getMessage() for r in caplog.records)
    ids, mask = left_pad(prompts((4,)))
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert torch.equal(he.generate(**gen), model.generate(**gen))

    callback = HybridEngineCallback(config={"hybrid_engine": {"enabled": False}})
    callback.attach(model)
    assert "generate" not in model.__dict__, "a disabled engine routes nothing"
    callback.detach()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_memory_beyond_the_training_model(dtype):
    """The engine holds one packed copy of the weights in the inference dtype plus the KV cache, nothing else; the
    KV cache is freed after each generation with release_inference_cache=True."""
    from peft import LoraConfig, get_peft_model

    base = build_tiny("llama", seed=0)
    elem = {"fp32": 4, "bf16": 2}[dtype]
    plain = sum(p.numel() for p in base.parameters()) + sum(b.numel() for b in base.buffers())
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear"))
    settings = {"hybrid_engine": {"enabled": True, "max_out_tokens": 32, "release_inference_cache": True}}
    # share_base=False: the copy path (tests/test_hybrid_shared_base.py covers the shared frozen base)
    he = HybridEngine(model, inference_config={"dtype": dtype, "max_batch_size": 2}, config=settings, share_base=False)
    training_ptrs = {t.untyped_storage().data_ptr() for t in model.parameters()}
    assert not training_ptrs & {t.untyped_storage().data_ptr() for t in he.module.parameters()}
    held = he.memory()
    assert held["kv_cache"] == 0  # allocated at the first generation
    # LoRA factors are fused away: the copy is the plain model's size in the inference dtype (rotary buffers kept fp32)
    inv_freq = sum(b.numel() for b in base.buffers())
    assert held["weights"] == (plain - inv_freq) * elem + inv_freq * 4
    cfg = base.config
    kv_expected = 2 * cfg.num_hidden_layers * 2 * 32 * cfg.num_key_value_heads * (cfg.hidden_size // 6) * elem
    ids, mask = left_pad(prompts((5, 9)))
    with he.inference():
        he.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
        assert he.memory()["kv_cache"] == kv_expected
    assert he.memory()["kv_cache"] == 0, "release_inference_cache=True frees the cache after the generation"


def test_inference_tp_size_without_torchrun_is_refused_by_name(monkeypatch):
    # inference_tp_size > 1 needs one process per rank (tests/test_hybrid_tp.py runs it on 2 gloo processes)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    settings = {"hybrid_engine": {"enabled": True, "inference_tp_size": 2}}
    with pytest.raises(ValueError, match=r"hybrid_engine.inference_tp_size=2 splits.*or set hybrid_engine"):
        HybridEngine(build_tiny("llama", seed=0), config=settings)
