"""InferenceConfig: DeepSpeed's names, defaults and aliases, merging rules, validation and serialization."""

import json
import warnings

import pytest
import torch

from hf_dsinfer import InferenceConfig


def test_deepspeed_defaults():
    cfg = InferenceConfig()
    # The two defaults that differ from DeepSpeed's on purpose (docs/migration.md; tests/test_defaults.py).
    assert cfg.dtype == "auto" and cfg.replace_with_kernel_inject == "auto" and cfg.injects
    assert cfg.tensor_parallel.tp_size == 1 and cfg.tp_size == 1
    assert cfg.enable_cuda_graph is False
    assert cfg.max_out_tokens == 1024 and cfg.min_out_tokens == 1
    assert cfg.injection_policy is None and cfg.checkpoint is None and cfg.base_dir == ""
    assert cfg.keep_module_on_host is False and cfg.save_mp_checkpoint_path is None
    assert cfg.quant_method == "dsinfer"


@pytest.mark.parametrize(
    "spelling, canon",
    [
        ("fp16", "float16"),
        ("float16", "float16"),
        ("half", "float16"),
        (torch.float16, "float16"),
        ("bf16", "bfloat16"),
        ("bfloat16", "bfloat16"),
        (torch.bfloat16, "bfloat16"),
        ("fp32", "float32"),
        ("float32", "float32"),
        ("float", "float32"),
        (torch.float32, "float32"),
    ],
)
def test_dtype_spellings(spelling, canon):
    assert InferenceConfig(dtype=spelling).dtype == canon


def test_aliases():
    cfg = InferenceConfig(kernel_inject=True, tp={"tp_size": 2}, max_tokens=64, min_tokens=2)
    assert cfg.replace_with_kernel_inject is True
    assert cfg.tensor_parallel.tp_size == 2
    assert cfg.max_out_tokens == 64 and cfg.min_out_tokens == 2


def test_alias_and_name_with_different_values_conflict():
    with pytest.raises(ValueError, match="max_tokens and max_out_tokens|max_out_tokens and max_tokens"):
        InferenceConfig(max_tokens=64, max_out_tokens=32)


def test_deprecated_mp_size_maps_to_tp_size():
    with pytest.warns(FutureWarning, match="mp_size"):
        cfg = InferenceConfig(mp_size=2)
    assert cfg.tensor_parallel.tp_size == 2
    with pytest.raises(ValueError, match="tensor_parallel.tp_size"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            InferenceConfig(mp_size=2, tensor_parallel={"tp_size": 4})


def test_unknown_key_named_with_suggestion():
    with pytest.raises(ValueError, match="'foo'"):
        InferenceConfig(foo=1)
    with pytest.raises(ValueError, match="Did you mean 'max_out_tokens'"):
        InferenceConfig(max_out_token=5)
    with pytest.raises(ValueError, match="tensor_parallel key 'tp_sise'"):
        InferenceConfig(tensor_parallel={"tp_sise": 2})


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(tensor_parallel={"tp_size": 0}), "tensor_parallel.tp_size"),
        (dict(max_out_tokens=4, min_out_tokens=8), "max_out_tokens"),
        (dict(max_out_tokens=0), "max_out_tokens"),
        (dict(dtype="fp8"), "dtype"),
        (dict(dtype="int8", quant={"weight": {"num_bits": 4}}), "quant.weight.num_bits"),
        (dict(enable_cuda_graph="yes"), "enable_cuda_graph"),
        (dict(cuda_graph_batch_sizes=[0, 2]), "cuda_graph_batch_sizes"),
        (dict(cuda_graph_batch_sizes=[1, 64], max_batch_size=8), "max_batch_size"),
        (dict(quant={"enabled": True, "weight": {"num_bits": 3}}), "quant.weight.num_bits"),
        (dict(quant={"weight": {"q_groups": 2, "group_size": 64}}), "quant.weight.q_groups"),
        (dict(quant={"activation": {"enabled": True, "num_bits": 4}}), "quant.activation.num_bits"),
        (dict(quant={"activation": {"q_groups": 8}}), "quant.activation.q_groups"),
        (dict(quant={"qkv": {"enabled": True, "bits": 4}}), "quant.qkv key 'bits'"),
        (dict(injection_policy={"LlamaDecoderLayer": 3}), "injection_policy"),
    ],
)
def test_validation_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        InferenceConfig(**kwargs)


def test_injection_policy_accepts_classes_and_serializes_names():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = InferenceConfig(injection_dict={LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")})
    key = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    assert cfg.injection_policy == {key: ["self_attn.o_proj", "mlp.down_proj"]}
    assert json.loads(cfg.to_json_string())["injection_policy"] == {key: ["self_attn.o_proj", "mlp.down_proj"]}


def test_cuda_graph_batch_sizes_sorted_unique():
    assert InferenceConfig(cuda_graph_batch_sizes=[4, 1, 4, 2]).cuda_graph_batch_sizes == [1, 2, 4]


def test_from_any_dict_json_path_and_config(tmp_path):
    d = {"dtype": "bf16", "tensor_parallel": {"tp_size": 2}, "max_out_tokens": 128}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(d))
    from_dict = InferenceConfig.from_any(d)
    from_path = InferenceConfig.from_any(str(path))
    from_cfg = InferenceConfig.from_any(from_dict)
    assert from_dict == from_path == from_cfg
    assert from_path.tensor_parallel.tp_size == 2 and from_path.max_out_tokens == 128


def test_from_any_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="not a JSON file"):
        InferenceConfig.from_any(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        InferenceConfig.from_any(str(bad))
    with pytest.raises(ValueError, match="config must be"):
        InferenceConfig.from_any(3)


def test_merge_config_and_kwargs():
    cfg = InferenceConfig.from_any({"dtype": "fp32"}, max_out_tokens=64, dtype="float32")
    assert cfg.dtype == "float32" and cfg.max_out_tokens == 64


def test_merge_conflicts_name_every_key():
    with pytest.raises(ValueError) as err:
        InferenceConfig.from_any({"dtype": "fp32", "max_out_tokens": 8}, dtype="fp16", max_tokens=16)
    assert "dtype" in str(err.value) and "max_out_tokens" in str(err.value)


def test_round_trip_dict_and_json():
    cfg = InferenceConfig(dtype="bf16", tp={"tp_size": 2}, enable_cuda_graph=True, cuda_graph_batch_sizes=[1, 2])
    assert InferenceConfig.from_dict(cfg.to_dict()) == cfg
    assert InferenceConfig.from_dict(json.loads(cfg.to_json_string(use_diff=False))) == cfg
    assert InferenceConfig.from_dict(json.loads(cfg.to_json_string())) == cfg  # diff form
    json.dumps(cfg.to_dict())  # JSON-serializable


def test_process_groups_are_kept_but_never_serialized():
    group = object()
    cfg = InferenceConfig(tensor_parallel={"tp_size": 1, "tp_group": group})
    assert cfg.tensor_parallel.tp_group is group
    assert "tp_group" not in cfg.to_dict()["tensor_parallel"]
    import copy

    assert copy.deepcopy(cfg).tensor_parallel.tp_group is group
