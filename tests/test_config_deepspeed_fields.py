"""Every field and alias of DeepSpeed's inference and hybrid-engine configs is accepted or refused with a reason.

The field lists below are copied from DeepSpeed 0.16.5 (commit 38327e07f6cd39b63418f60cedd1651b0be3e7c3):
``deepspeed/inference/config.py`` (``DeepSpeedInferenceConfig`` and its sections) and ``deepspeed/runtime/config.py``
(``HybridEngineConfig``). A field missing from hf_dsinfer's handling fails here, and so does a field missing from the
table in docs/migration.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings

import pytest
import torch

from hf_dsinfer import InferenceConfig
from hf_dsinfer.hybrid.config import HybridEngineSettings, read_hybrid_engine_config
from hf_dsinfer.integration import config_compat
from hf_dsinfer.log import LOGGER_NAME

DEEPSPEED = "0.16.5 (38327e07f6cd39b63418f60cedd1651b0be3e7c3)"

# DeepSpeedInferenceConfig: name -> (aliases, DeepSpeed's default). Deprecated fields included.
DS_INFERENCE_FIELDS = {
    "replace_with_kernel_inject": (("kernel_inject",), False),
    "dtype": ((), torch.float16),
    "tensor_parallel": (("tp",), {}),
    "enable_cuda_graph": ((), False),
    "use_triton": ((), False),
    "triton_autotune": ((), False),
    "zero": ((), {}),
    "triangular_masking": (("tm",), True),
    "moe": ((), {}),
    "keep_module_on_host": ((), False),
    "quant": ((), {}),
    "checkpoint": ((), None),
    "base_dir": ((), ""),
    "set_empty_params": ((), False),
    "save_mp_checkpoint_path": ((), None),
    "checkpoint_config": (("ckpt_config",), {}),
    "return_tuple": ((), True),
    "training_mp_size": ((), 1),
    "replace_method": ((), "auto"),
    "injection_policy": (("injection_dict",), None),
    "injection_policy_tuple": ((), None),
    "config": (("args",), None),
    "max_out_tokens": (("max_tokens",), 1024),
    "min_out_tokens": (("min_tokens",), 1),
    "transposed_mode": ((), False),
    "mp_size": ((), 1),
    "mpu": ((), None),
    "ep_size": ((), 1),
    "ep_group": (("expert_group",), None),
    "ep_mp_group": (("expert_mp_group",), None),
    "moe_experts": ((), [1]),
    "moe_type": ((), "standard"),
}
DS_TP_FIELDS = {"enabled": True, "tp_size": 1, "tp_grain_size": 64, "mpu": None, "tp_group": None}
DS_MOE_FIELDS = {  # name -> (aliases, default)
    "enabled": ((), True),
    "ep_size": ((), 1),
    "moe_experts": (("num_experts",), [1]),
    "type": ((), "standard"),
    "ep_mp_group": ((), None),
    "ep_group": (("expert_group",), None),
}
# QuantizationConfig().model_dump(): what a DeepSpeed user's dumped config holds.
DS_QUANT_DEFAULTS = {
    "enabled": True,
    "activation": {"enabled": True, "num_bits": 8, "q_type": "symmetric", "q_groups": 1},
    "weight": {
        "enabled": True, "num_bits": 8, "q_type": "symmetric", "q_groups": 1,
        "quantized_initialization": {}, "post_init_quant": {},
    },
    "qkv": {"enabled": True},
}  # fmt: skip
DS_CHECKPOINT_CONFIG_FIELDS = {"checkpoint_dir": None, "save_mp_checkpoint_path": None, "base_dir": None}
DS_HYBRID_ENGINE_FIELDS = {
    "enabled": False,
    "max_out_tokens": 512,
    "inference_tp_size": 1,
    "release_inference_cache": False,
    "pin_parameters": True,
    "tp_gather_partition_size": 8,
}

# How hf_dsinfer treats each field that DeepSpeed has and it does not implement, with a non-default value that shows
# it: "no effect" fields log one info line naming the field, "refused" fields raise naming it.
NO_EFFECT = {
    "zero": {"stage": 3, "offload_param": {"device": "cpu"}},
    "triangular_masking": False,
    "set_empty_params": True,
    "transposed_mode": True,
    "replace_method": "auto",
    "use_triton": True,
    "triton_autotune": True,
    "return_tuple": False,
}
REFUSED = {
    "config": {"hidden_size": 64},
    "injection_policy_tuple": (object,),
    "checkpoint_config": {"checkpoint_dir": "/ckpt"},
    "training_mp_size": 2,
}

MIGRATION_DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "migration.md")


def _build(**kwargs) -> InferenceConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated DeepSpeed names warn, as in DeepSpeed
        return InferenceConfig(**kwargs)


@pytest.mark.parametrize("name", [n for field, (aliases, _) in DS_INFERENCE_FIELDS.items() for n in (field, *aliases)])
def test_every_deepspeed_field_and_alias_accepted_at_its_default(name):
    field = next(f for f, (aliases, _) in DS_INFERENCE_FIELDS.items() if name in (f, *aliases))
    cfg = _build(**{name: DS_INFERENCE_FIELDS[field][1]})
    json.dumps(cfg.to_dict())  # and still serializable into config.json


def test_a_whole_deepspeed_default_config_loads():
    """Every field at once, as DeepSpeedInferenceConfig().model_dump() would give it (sections expanded)."""
    values = {field: default for field, (_, default) in DS_INFERENCE_FIELDS.items()}
    values.update(tensor_parallel=DS_TP_FIELDS, quant=DS_QUANT_DEFAULTS, checkpoint_config=DS_CHECKPOINT_CONFIG_FIELDS)
    values["moe"] = {name: default for name, (_, default) in DS_MOE_FIELDS.items()}
    for deprecated in ("mp_size", "mpu", "ep_size", "ep_group", "ep_mp_group", "moe_experts", "moe_type"):
        values.pop(deprecated)  # DeepSpeed moves them into their sections; both at once is a conflict there too
    cfg = _build(**values)
    assert cfg.dtype == torch.float16 and cfg.dtype == "float16"
    assert cfg.quant_settings.num_bits == 8  # the weight section is what this package reads (docs/quantization.md)


def test_every_field_is_in_the_migration_table():
    with open(MIGRATION_DOC, encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`([a-z_\.]+)`", row.split("|")[1])}
    names = [n for field, (aliases, _) in DS_INFERENCE_FIELDS.items() for n in (field, *aliases)]
    names += [f"hybrid_engine.{n}" for n in DS_HYBRID_ENGINE_FIELDS] + ["hybrid_engine.enable_cuda_graph"]
    missing = [n for n in names if n not in documented]
    assert not missing, f"docs/migration.md has no table row naming {missing}"


def test_every_field_has_a_treatment():
    """A field hf_dsinfer neither stores nor handles as DeepSpeed-only would fail at construction; this names it."""
    from hf_dsinfer.integration import config as cfg_module
    from hf_dsinfer.integration.moe_config import MOE_TOP_LEVEL

    known = (set(cfg_module.FIELDS) | set(cfg_module.ALIASES) | set(cfg_module.DEPRECATED) | set(MOE_TOP_LEVEL)
             | set(config_compat.COMPAT_FIELDS) | set(config_compat.COMPAT_ALIASES))  # fmt: skip
    names = [n for field, (aliases, _) in DS_INFERENCE_FIELDS.items() for n in (field, *aliases)]
    assert not [n for n in names if n not in known]
    assert set(NO_EFFECT) | set(REFUSED) >= set(config_compat.COMPAT_FIELDS) - {"checkpoint_config"} - {"config"}


@pytest.mark.parametrize("name", list(NO_EFFECT))
def test_no_effect_fields_log_one_info_line(name, caplog, monkeypatch):
    monkeypatch.setattr(config_compat, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        _build(**{name: NO_EFFECT[name]})
        _build(**{name: NO_EFFECT[name]})
    lines = [
        r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "has no effect here" in r.getMessage()
    ]
    assert len(lines) == 1 and name in lines[0], lines


@pytest.mark.parametrize("name", list(REFUSED))
def test_fields_that_would_change_results_are_refused_by_name(name):
    with pytest.raises(ValueError, match=re.escape(name)):
        _build(**{name: REFUSED[name]})


def test_aliases_of_refused_fields_are_named():
    with pytest.raises(ValueError, match=r"config \(alias args\) is not supported"):
        InferenceConfig(args={"hidden_size": 64})
    with pytest.raises(ValueError, match=r"checkpoint_config=.*set the top-level fields instead"):
        InferenceConfig(ckpt_config={"base_dir": "/x"})


def test_moe_aliases_top_level_and_in_section():
    group = object()
    with pytest.warns(FutureWarning, match="expert_group is deprecated; use moe.ep_group"):
        cfg = InferenceConfig(expert_group=group)
    assert cfg.moe.ep_group is group
    assert InferenceConfig(moe={"expert_group": group}).moe.ep_group is group
    with pytest.warns(FutureWarning, match="expert_mp_group"):
        assert InferenceConfig(expert_mp_group=None).moe.ep_mp_group is None
    with pytest.raises(ValueError, match=r"moe\.ep_mp_group \(expert_mp_group\) is not supported"):
        InferenceConfig(moe={"expert_mp_group": object()})
    for name, (aliases, default) in DS_MOE_FIELDS.items():
        for n in (name, *aliases):
            InferenceConfig(moe={n: default})


def test_tensor_parallel_section_and_old_top_level_grain():
    cfg = InferenceConfig(tensor_parallel=DS_TP_FIELDS)
    assert cfg.tensor_parallel.tp_grain_size == 64
    with pytest.warns(FutureWarning, match="tp_grain_size is deprecated"):  # a top-level field before 0.16.5
        assert InferenceConfig(tp_grain_size=32).tensor_parallel.tp_grain_size == 32


@pytest.mark.parametrize(
    "quant",
    [
        DS_QUANT_DEFAULTS,
        {"activation": {"enabled": True}, "qkv": {"enabled": True}},
        {"activation": {"enabled": False, "num_bits": 4}},  # disabled: its values are never read
        {"weight": {"num_bits": 4}, "qkv": {"enabled": False}},
    ],
)
def test_quant_sections_with_deepspeed_defaults_load(quant):
    assert InferenceConfig(quant=quant).quant_settings is not None


@pytest.mark.parametrize(
    "quant, named",
    [
        ({"activation": {"num_bits": 4}}, "quant.activation.num_bits=4"),
        ({"activation": {"enabled": True, "q_type": "asymmetric"}}, "quant.activation.q_type='asymmetric'"),
        ({"activation": {"q_groups": 64}}, "quant.activation.q_groups=64"),
        ({"activation": {"bits": 4}}, "quant.activation key 'bits'"),
        ({"qkv": {"enabled": True, "num_bits": 4}}, "quant.qkv key 'num_bits'"),
        ({"qkv": "yes"}, "quant.qkv must be a dict"),
    ],
)
def test_activation_quantization_beyond_the_defaults_is_refused_by_name(quant, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        InferenceConfig(quant=quant)


@pytest.mark.parametrize("spelling", ["bfloat", "bf16", "bfloat16", "torch.bfloat16", torch.bfloat16])
def test_dtype_spellings_of_deepspeed_dtype_enum(spelling):
    assert InferenceConfig(dtype=spelling).dtype == torch.bfloat16


def test_dtype_compares_with_torch_dtypes_and_stays_json():
    """DeepSpeed's ``config.dtype`` is a torch.dtype; ours is a str that compares equal to it (item 6 of issue 26)."""
    cfg = InferenceConfig(dtype="fp16")
    assert cfg.dtype == torch.float16 and torch.float16 == cfg.dtype and cfg.dtype != torch.bfloat16
    assert cfg.dtype == "float16" and isinstance(cfg.dtype, str) and cfg.torch_dtype is torch.float16
    assert cfg.dtype in (torch.float16, torch.bfloat16)  # DeepSpeed users' membership checks
    auto = InferenceConfig()
    assert auto.dtype == "auto" and auto.dtype != torch.float32  # nothing resolved yet
    auto.resolve_dtype(torch.float16, "cpu")  # fp16 on a CPU -> fp32
    assert auto.dtype == torch.float32 and auto.dtype == "auto"
    saved = json.loads(auto.to_json_string(use_diff=False))
    assert saved["dtype"] == "auto" and type(auto.to_dict()["dtype"]) is str
    assert InferenceConfig.from_dict(saved).dtype == "auto"
    import copy
    import pickle

    assert copy.deepcopy(auto).dtype == torch.float32 and pickle.loads(pickle.dumps(cfg.dtype)) == torch.float16


def test_dtype_survives_save_and_reload(tmp_path):
    """The config is written into config.json by save_pretrained and read back by from_pretrained."""
    import transformers
    from tiny_models import save_tiny

    path = save_tiny("llama", tmp_path / "tiny")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config={"dtype": "bfloat"})
    assert model.config.quantization_config.dtype == torch.bfloat16
    model.save_pretrained(tmp_path / "saved")
    with open(tmp_path / "saved" / "config.json", encoding="utf-8") as f:
        assert json.load(f)["quantization_config"]["dtype"] == "bfloat16"
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert again.config.quantization_config.dtype == torch.bfloat16
    assert next(again.parameters()).dtype == torch.bfloat16


def test_engine_inference_config_dtype_compares_like_deepspeed():
    from tiny_models import build_tiny

    import hf_dsinfer

    engine = hf_dsinfer.init_inference(build_tiny("llama", seed=0), replace_with_kernel_inject=False)
    assert engine.inference_config.dtype == torch.float32  # "auto" on a fp32 model, resolved
    assert engine.inference_config.dtype == next(engine.module.parameters()).dtype


def test_every_hybrid_engine_field_accepted_and_enable_cuda_graph_read():
    settings = read_hybrid_engine_config({"hybrid_engine": DS_HYBRID_ENGINE_FIELDS})
    assert settings == HybridEngineSettings(**DS_HYBRID_ENGINE_FIELDS)
    section = {**DS_HYBRID_ENGINE_FIELDS, "enabled": True, "enable_cuda_graph": True}
    settings = read_hybrid_engine_config({"hybrid_engine": section})
    assert settings.enable_cuda_graph is True and settings.inference_fields()["enable_cuda_graph"] is True
    with pytest.raises(ValueError, match=r"hybrid_engine\.enable_cuda_graph must be true or false"):
        read_hybrid_engine_config({"hybrid_engine": {"enable_cuda_graph": "yes"}})


def test_hybrid_engine_with_enable_cuda_graph_in_the_deepspeed_config():
    from tiny_models import PAD, build_tiny, left_pad, prompts

    from hf_dsinfer.hybrid import HybridEngine

    model = build_tiny("llama", seed=0)
    ds_config = {"train_batch_size": 8, "hybrid_engine": {"enabled": True, "enable_cuda_graph": True}}
    he = HybridEngine(model, config=ds_config)
    assert he.config.enable_cuda_graph is True
    ids, mask = left_pad(prompts((5, 9)))
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    with he.inference():
        out = he.generate(**gen)
    assert torch.equal(out, model.generate(**gen))
    with pytest.raises(ValueError, match=r"hybrid_engine\.enable_cuda_graph=True .* conflicts with enable_cuda_graph"):
        HybridEngine(model, inference_config={"enable_cuda_graph": False}, config=ds_config)
