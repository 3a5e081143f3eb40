"""What the Hybrid Engine builds from: the modules the training model has (layers popped after loading, as
DeepSpeed's test_he_llama does), DeepSpeed-Chat's LoRA layers fused exactly, unknown adapters refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from peft import LoraConfig, get_peft_model
from tiny_models import PAD, build_tiny, left_pad, prompts, randomize_lora
from torch import nn

from hf_dsinfer.hybrid import HybridEngine, UnsupportedAdapterError
from hf_dsinfer.policies import find_policy

CFG = {"max_out_tokens": 64}


pytestmark = pytest.mark.usefixtures("one_thread")


def _gen() -> dict:
    ids, mask = left_pad(prompts((5, 9, 3)))
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)


class ChatLoRALinear(nn.Module):
    """The interface of DeepSpeed-Chat's ``LinearLayer_LoRA`` (written for this test): the frozen Linear's weight and
    bias, ``lora_right_weight [in, r]``, ``lora_left_weight [r, out]``, ``lora_scaling = alpha / r``, ``fuse_lora``."""

    def __init__(self, linear: nn.Linear, r: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        out_features, in_features = linear.weight.shape
        self.lora_right_weight = nn.Parameter(torch.randn(in_features, r, generator=generator) * 0.3)
        self.lora_left_weight = nn.Parameter(torch.randn(r, out_features, generator=generator) * 0.3)
        self.lora_scaling = alpha / r
        self.fuse_lora = False

    def fuse_lora_weight(self) -> None:
        with torch.no_grad():
            self.weight += self.lora_scaling * (self.lora_right_weight @ self.lora_left_weight).t()
        self.fuse_lora = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.fuse_lora:
            return y
        return y + (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


class ScaledLinear(nn.Linear):
    """An unknown adapter: a Linear subclass with an extra trainable vector on the forward path."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.weight = linear.weight
        self.gain = nn.Parameter(torch.ones(linear.out_features))

    def forward(self, x):
        return super().forward(x) * self.gain


class Wrapper(nn.Module):
    """An unknown adapter: a wrapper holding the Linear and an adapter next to it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.inner = linear
        self.adapter = nn.Linear(linear.in_features, linear.out_features, bias=False)

    def forward(self, x):
        return self.inner(x) + self.adapter(x)


def _convert(model: nn.Module, names: tuple[str, ...], make) -> nn.Module:
    for path, module in list(model.named_modules()):
        if path.rpartition(".")[2] in names and isinstance(module, nn.Linear):
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent), leaf, make(module))
    return model


def _chat_lora_model() -> nn.Module:
    g = torch.Generator().manual_seed(5)
    names = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
    return _convert(build_tiny("llama", seed=0), names, lambda m: ChatLoRALinear(m, r=4, alpha=8.0, generator=g))


def test_layers_popped_after_loading_follow_the_model():
    model = build_tiny("llama", seed=0, num_hidden_layers=4)
    for _ in range(2):
        model.model.layers.pop(-1)  # DeepSpeed's test_he_llama shrinks models this way; config still says 4
    expected = model.generate(**_gen())
    he = HybridEngine(model, inference_config=CFG)
    assert len(he.module.model.layers) == 2 and he.module.config.num_hidden_layers == 2
    assert torch.equal(he.generate(**_gen()), expected)


def test_layers_removed_from_the_middle_are_refused():
    model = build_tiny("llama", seed=0, num_hidden_layers=3)
    del model.model.layers[1]
    with pytest.raises(ValueError, match=r"'model.layers' holds 2 modules but its config builds 3"):
        HybridEngine(model, inference_config=CFG)


@pytest.mark.parametrize("frozen_base", [False, True])
def test_deepspeed_chat_lora_is_fused_exactly(frozen_base):
    model = _chat_lora_model().eval()
    if frozen_base:  # DeepSpeed-Chat's only_optimize_lora: a frozen W must still not be shared (its delta is fused)
        for m in model.modules():
            if isinstance(m, ChatLoRALinear):
                m.weight.requires_grad_(False)
    expected = model.generate(**_gen())  # the training model's own (unfused) forward is the oracle
    he = HybridEngine(model, inference_config=CFG)
    with he.inference():
        out = he.generate(**_gen())
        layer = he.module.model.layers[0]
        q_rows = model.model.layers[0].self_attn.q_proj.weight.shape[0]
        fused_q = layer.attn.qkv.weight[:q_rows]
    assert torch.equal(out, expected)
    q = model.model.layers[0].self_attn.q_proj
    want = q.weight + (q.lora_right_weight @ q.lora_left_weight).t() * q.lora_scaling
    torch.testing.assert_close(fused_q, want, rtol=0, atol=1e-6)

    for m in model.modules():  # after DeepSpeed-Chat's own fuse, the delta lives in W: counted once
        if isinstance(m, ChatLoRALinear):
            m.fuse_lora_weight()
    with he.inference():
        assert torch.equal(he.generate(**_gen()), expected)


def test_unknown_adapters_are_refused_by_name():
    model = _convert(build_tiny("llama", seed=0), ("k_proj",), ScaledLinear)
    with pytest.raises(UnsupportedAdapterError, match=r"model.layers.0.self_attn.k_proj: .*ScaledLinear.*'gain'"):
        HybridEngine(model, inference_config=CFG)
    model = _convert(build_tiny("llama", seed=0), ("up_proj",), Wrapper)
    with pytest.raises(UnsupportedAdapterError, match=r"mlp.up_proj: .*Wrapper.*'adapter.weight'"):
        HybridEngine(model, inference_config=CFG)


# -- architectures without a policy: the inference copy keeps HF's modules, whose parameters sit next to sub-modules --

_RECURRENT = dict(vocab_size=500, hidden_size=64, num_hidden_layers=2, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
FALLBACK_ARCHS = {
    "mamba": dict(state_size=8),  # MambaMixer: A_log, D next to in_proj / conv1d / x_proj / dt_proj / out_proj
    "mamba2": dict(num_heads=8, head_dim=16, state_size=8, n_groups=1, chunk_size=16),  # + dt_bias and a norm child
    "rwkv": dict(
        attention_hidden_size=64, intermediate_size=128, context_length=64
    ),  # time_decay / time_mix_* + Linear
}


def _fallback_model(model_type: str) -> nn.Module:
    config = transformers.AutoConfig.for_model(model_type, **_RECURRENT, **FALLBACK_ARCHS[model_type])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _train_step(model: nn.Module, lr: float = 5.0) -> None:
    """One SGD step on a language-model loss (large lr: the greedy tokens must move)."""
    ids, mask = left_pad(prompts((7, 7), seed=3))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("model_type", list(FALLBACK_ARCHS))
def test_architectures_without_a_policy_run_eval_generate_train(model_type):
    model = _fallback_model(model_type)
    assert find_policy(model) is None, f"{model_type} has a policy now: pick another fallback architecture"
    expected = model.generate(**_gen())
    he = HybridEngine(model, inference_config=CFG)
    he.eval()
    assert torch.equal(he.generate(**_gen()), expected)
    he.train()
    before = {n: p.detach().clone() for n, p in he.module.named_parameters()}
    _train_step(model)
    model.eval()
    expected_after = model.generate(**_gen())  # the training model's own forward with its new weights
    he.eval()
    out = he.generate(**_gen())
    he.train()
    assert torch.equal(out, expected_after)
    changed = [n for n, p in he.module.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "the optimizer step did not reach the inference copy"
    assert not torch.equal(expected_after, expected), "the step did not move the greedy tokens: the test proves less"


def test_lora_inside_a_module_that_owns_parameters_is_fused():
    model = get_peft_model(
        _fallback_model("mamba"), LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj", "x_proj", "dt_proj"])
    )
    randomize_lora(model)
    expected = copy.deepcopy(model).merge_and_unload().eval().generate(**_gen())
    he = HybridEngine(model, inference_config=CFG)
    with he.inference():
        assert torch.equal(he.generate(**_gen()), expected)


def test_unknown_adapters_inside_fallback_and_plain_containers_are_refused():
    model = _fallback_model("mamba")
    mixer = model.backbone.layers[0].mixer
    mixer.out_proj = ScaledLinear(mixer.out_proj)  # a child with an extra factor inside a module owning A_log, D
    with pytest.raises(UnsupportedAdapterError, match=r"layers.0.mixer.out_proj: .*ScaledLinear.*'gain'"):
        HybridEngine(model, inference_config=CFG)
    model = _fallback_model("mamba")
    model.backbone.layers[1].mixer.side_adapter = nn.Linear(64, 64)  # a new child next to the mixer's projections
    with pytest.raises(UnsupportedAdapterError, match=r"layers.1.mixer: .*MambaMixer.*'side_adapter.weight'"):
        HybridEngine(model, inference_config=CFG)
    model = build_tiny("llama", seed=0)
    model.model.layers[0].mlp.adapter = nn.Linear(96, 96)  # an adapter child of a module with no own parameters
    with pytest.raises(UnsupportedAdapterError, match=r"layers.0.mlp: .*LlamaMLP.*'adapter.weight'"):
        HybridEngine(model, inference_config=CFG)
