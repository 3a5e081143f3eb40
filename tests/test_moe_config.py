"""DeepSpeed's ``moe`` section and its deprecated top-level keys in InferenceConfig."""

import json
import os
import sys

import pytest

from hf_dsinfer import InferenceConfig
from hf_dsinfer.integration.moe_config import MoEConfig


def test_moe_true_means_enabled_defaults():
    cfg = InferenceConfig(moe=True)
    assert isinstance(cfg.moe, MoEConfig) and cfg.moe.enabled and cfg.moe.ep_size == 1
    assert cfg.moe.type == "standard" and cfg.moe.moe_experts == [1]
    for off in (None, False, {}):
        assert InferenceConfig(moe=off).moe is None


def test_section_names_and_aliases():
    cfg = InferenceConfig(moe={"enabled": True, "ep_size": 2, "num_experts": [8], "moe_type": "standard"})
    assert (cfg.moe.ep_size, cfg.moe.moe_experts, cfg.moe.type) == (2, [8], "standard")
    group = object()  # a process group stands in: kept by reference, never serialized
    cfg = InferenceConfig(moe={"ep_size": 2, "expert_group": group})
    assert cfg.moe.ep_group is group
    assert json.loads(json.dumps(cfg.to_dict()))["moe"] == {
        "enabled": True, "ep_size": 2, "moe_experts": [1], "type": "standard",
    }  # fmt: skip
    assert InferenceConfig.from_dict(cfg.to_dict()).moe.ep_size == 2  # config.json round trip
    assert cfg == InferenceConfig(moe={"ep_size": 2, "ep_group": group})


def test_top_level_keys_map_into_the_section():
    with pytest.warns(FutureWarning, match="ep_size is deprecated; use moe.ep_size"):
        cfg = InferenceConfig(ep_size=2, moe_experts=[4], moe_type="standard")
    assert (cfg.moe.enabled, cfg.moe.ep_size, cfg.moe.moe_experts) == (True, 2, [4])
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="conflicts with the top-level ep_size"):
        InferenceConfig(moe={"ep_size": 4}, ep_size=2)


@pytest.mark.parametrize(
    "moe, match",
    [
        ({"type": "residual"}, r"moe.type='residual' is not supported"),
        ({"ep_size": 0}, r"moe.ep_size must be an integer >= 1"),
        ({"moe_experts": [0]}, r"moe.moe_experts must be a list"),
        ({"enabled": "yes"}, r"moe.enabled must be True or False"),
        ({"ep_mp_group": object()}, r"moe.ep_mp_group \(expert_mp_group\) is not supported"),
        ({"ep_sise": 2}, r"Unknown moe key 'ep_sise'. Did you mean 'ep_size'"),
        ("on", r"moe must be True/False or a dict"),
    ],
)
def test_unsupported_values_are_refused_by_name(moe, match):
    with pytest.raises(ValueError, match=match):
        InferenceConfig(moe=moe)


def test_ep_size_combines_with_a_larger_tp_size():
    """ep_size 2 with tp_size 4 (two expert groups of two ranks) is a valid section; the split itself is checked
    against the model's experts when it is planned (tests/test_moe_parallel.py)."""
    cfg = InferenceConfig(tensor_parallel={"tp_size": 4}, moe={"ep_size": 2})
    assert (cfg.tensor_parallel.tp_size, cfg.moe.expert_parallel_size) == (4, 2)
    off = InferenceConfig(tensor_parallel={"tp_size": 4}, moe={"ep_size": 2, "enabled": False})
    assert off.moe.expert_parallel_size == 1


def test_ep_size_without_tensor_parallelism_is_refused_and_model_untouched():
    """Expert parallelism runs over the tensor-parallel ranks: ep_size > 1 on one process is refused by name, before
    anything changes on the model."""
    import transformers

    import hf_dsinfer
    from hf_dsinfer.integration.apply import get_inference_config

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tiny_models import build_tiny

    model = build_tiny("mixtral").train()
    with pytest.raises(ValueError, match=r"moe\.ep_size=2 needs tensor parallelism.*moe\.ep_size=1"):
        hf_dsinfer.init_inference(model, moe={"ep_size": 2}, dtype="fp32")
    assert get_inference_config(model) is None
    assert isinstance(model, transformers.MixtralForCausalLM) and model.training is True
