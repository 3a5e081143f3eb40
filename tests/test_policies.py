"""The policy API: registry, sources (pack/unpack), injection_policy validation, TP plan, what ``info`` shows."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import build_tiny, save_tiny
from torch import nn

import hf_dsinfer  # noqa: F401
from hf_dsinfer.integration.support import TESTED_ARCHITECTURES, architecture_paths
from hf_dsinfer.policies import (
    POLICIES,
    Cat,
    Param,
    Policy,
    Transposed,
    find_policy,
    get_injection,
    inject,
    register,
    validate_injection_policy,
)

LLAMA_LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"


def test_registry_and_info():
    for model_type in TESTED_ARCHITECTURES:  # every family of the fidelity table has a policy (issue 4)
        assert model_type in POLICIES
        assert architecture_paths()[model_type].startswith("fused layers")
    assert find_policy(build_tiny("llama")) is POLICIES["llama"]
    assert type(find_policy(build_tiny("phi3"))).__name__ == "Phi3Policy"

    class Clash(Policy):
        model_types = ("llama",)

    with pytest.raises(ValueError, match="already served by LlamaPolicy"):
        register(Clash)


def test_sources_round_trip():
    params = {n: torch.randn(r, 4) for n, r in (("a", 3), ("b", 2), ("c", 5))}
    conv = torch.randn(4, 6)  # Conv1D layout [in, out]
    get = {**params, "conv": conv}.__getitem__
    cat = Cat("a", "b", Transposed("conv"))
    packed = cat.pack(get)
    assert packed.shape == (3 + 2 + 6, 4) and cat.names() == ("a", "b", "conv")
    back = cat.unpack(packed)
    assert all(torch.equal(back[n], params[n]) for n in ("a", "b")) and torch.equal(back["conv"], conv)
    p = Param("a")
    assert p.pack(get) is params["a"] and p.shares() and not cat.shares()
    with pytest.raises(ValueError):
        Cat("a")


def test_injection_policy_validation():
    model = build_tiny("llama")
    validate_injection_policy(model, {LLAMA_LAYER: ["self_attn.o_proj", "mlp.down_proj"]})
    validate_injection_policy(model, {"LlamaDecoderLayer": ["self_attn.o_proj"]})
    with pytest.raises(ValueError, match=r"'mlp\.c_proj'.*LlamaDecoderLayer does not have"):
        validate_injection_policy(model, {LLAMA_LAYER: ["self_attn.o_proj", "mlp.c_proj"]})
    with pytest.raises(ValueError, match="GPT2Block.*LlamaDecoderLayer"):
        validate_injection_policy(model, {"GPT2Block": ["attn.c_proj"]})


def test_injection_policy_through_from_pretrained(tmp_path):
    path = save_tiny("llama", tmp_path)
    cfg = {"dtype": "fp32", "replace_with_kernel_inject": True}
    with pytest.raises(ValueError, match="mlp.dense_4h_to_h"):
        transformers.AutoModelForCausalLM.from_pretrained(
            path, inference_config={**cfg, "injection_policy": {LLAMA_LAYER: ("mlp.dense_4h_to_h",)}}
        )
    names = ["self_attn.o_proj", "mlp.down_proj"]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, inference_config={**cfg, "injection_policy": {LLAMA_LAYER: names}}
    )
    assert get_injection(model).injection_policy == {LLAMA_LAYER: names}


def test_tp_plan_declares_kv_head_groups():
    class Cfg:
        max_out_tokens, max_batch_size, injection_policy = 32, 1, None

    plan = get_injection(inject(build_tiny("llama"), Cfg())).tp_plan
    assert plan["qkv"]["sizes"] == (6 * 16, 2 * 16, 2 * 16) and plan["qkv"]["shard_by"] == "kv_head_group"
    assert "attn.o.weight" in plan["row"] and "mlp.up.weight" in plan["column"] and "gate_up" in plan


def test_injection_frees_the_unpacked_weights():
    class Cfg:
        max_out_tokens, max_batch_size, injection_policy = 32, 1, None

    model = build_tiny("llama")
    q = model.model.layers[0].self_attn.q_proj.weight
    norm = model.model.layers[0].input_layernorm.weight
    inject(model, Cfg())
    assert q.numel() == 0, "the q_proj weight packed into qkv must be freed"
    assert model.model.layers[0].attn_norm.weight is norm, "unpacked weights are shared, not copied"
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.attn.qkv.weight" in names and not any("q_proj" in n for n in names)
    total = sum(p.numel() for p in model.parameters())
    assert total == sum(p.numel() for p in build_tiny("llama").parameters())


def test_a_policy_error_leaves_the_model_untouched(monkeypatch):
    class Broken(Policy):
        def layer_spec(self, model, idx, layer):
            return POLICIES["llama"].layer_spec(model, idx, layer)

        def weight_map(self, model, idx, layer):
            return {**POLICIES["llama"].weight_map(model, idx, layer), "mlp.down.weight": "mlp.fc2.weight"}

    class Cfg:
        max_out_tokens, max_batch_size, injection_policy = 32, 1, None

    model = build_tiny("llama")
    before = {n: p.clone() for n, p in model.named_parameters()}
    import hf_dsinfer.policies.injection as injection

    monkeypatch.setattr(injection, "find_policy", lambda m: Broken())
    with pytest.raises(ValueError, match="'mlp.fc2.weight'"):
        inject(model, Cfg())
    assert isinstance(model.model.layers[0], nn.Module) and type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
