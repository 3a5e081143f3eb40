"""The CPU weight arena (modules/weight_arena.py): one allocation for the injected layers and the head, in place.

What must hold: every fused-layer weight and the head become views of one storage (aligned, the same tensor
objects, ties kept); outputs do not change (greedy tokens and logits equal to the model without the arena, int8
included); in-place writes still reach the step; save writes the same checkpoint as HF's model; a tensor whose
storage is shared with anything else is left where it is; ``HF_DSINFER_CPU_ARENA=0`` switches it off.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import left_pad, prompts, save_tiny
from torch import nn

import hf_dsinfer  # noqa: F401
from hf_dsinfer.modules import weight_arena
from hf_dsinfer.policies import get_injection

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 64, "max_batch_size": 4}


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return save_tiny("llama", tmp_path_factory.mktemp("arena"), tie_word_embeddings=True)


def _load(path: str, monkeypatch, arena: bool, **extra):
    monkeypatch.setenv(weight_arena.ENV_VAR, "1" if arena else "0")
    return transformers.AutoModelForCausalLM.from_pretrained(path, inference_config={**INJECT, **extra}).eval()


def _layer_tensors(model) -> list[torch.Tensor]:
    layers = get_injection(model).runtime.layers
    return [t for layer in layers for t in [*layer.parameters(), *layer.buffers()]]


def test_layers_and_head_share_one_aligned_storage(llama_path, monkeypatch):
    model = _load(llama_path, monkeypatch, arena=True)
    tensors = [*_layer_tensors(model), model.get_output_embeddings().weight]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1, "every layer weight and the head live in one allocation"
    assert all(t.data_ptr() % weight_arena.ALIGN == 0 for t in tensors)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "the tie holds"
    ptrs = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(ptrs, ptrs[1:])), "no two weights overlap"


def test_switched_off_keeps_separate_allocations(llama_path, monkeypatch):
    model = _load(llama_path, monkeypatch, arena=False)
    tensors = _layer_tensors(model)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)


@pytest.mark.parametrize(
    "quant", [None, {"enabled": True, "weight": {"num_bits": 8, "lm_head": True}}], ids=["fp32", "int8"]
)
def test_outputs_equal_the_model_without_the_arena(llama_path, monkeypatch, quant):
    extra = {} if quant is None else {"quant": quant}
    plain = _load(llama_path, monkeypatch, arena=False, **extra)
    packed = _load(llama_path, monkeypatch, arena=True, **extra)
    # int8: the integer weights move; scales that other tensors still view stay where they are
    weights = [layer.mlp.down.weight for layer in get_injection(packed).runtime.layers]
    assert len({t.untyped_storage().data_ptr() for t in weights}) == 1
    ids, mask = left_pad(prompts((5, 9, 3)))
    with torch.no_grad():
        torch.testing.assert_close(packed(input_ids=ids, attention_mask=mask).logits,
                                   plain(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)  # fmt: skip
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(packed.generate(ids, **kw), plain.generate(ids, **kw))


def test_in_place_writes_reach_the_arena(llama_path, monkeypatch):
    model = _load(llama_path, monkeypatch, arena=True)
    layer = get_injection(model).runtime.layers[0]
    weight = layer.attn.qkv.weight
    ids = torch.tensor([prompts((6,))[0]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        weight.mul_(0.5)  # e.g. load_state_dict's copy_: the parameter the step reads is the arena's view
        after = model(input_ids=ids).logits
    assert not torch.allclose(before, after)
    assert weight.untyped_storage().data_ptr() == model.get_output_embeddings().weight.untyped_storage().data_ptr()


def test_saved_checkpoint_equals_hf_s_own(llama_path, monkeypatch, tmp_path):
    from safetensors import safe_open

    model = _load(llama_path, monkeypatch, arena=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "arena")
    ref.save_pretrained(tmp_path / "plain")
    with safe_open(tmp_path / "arena" / "model.safetensors", "pt") as f, \
            safe_open(tmp_path / "plain" / "model.safetensors", "pt") as p:  # fmt: skip
        assert set(f.keys()) == set(p.keys())
        for key in p.keys():
            assert torch.equal(f.get_tensor(key), p.get_tensor(key)), key


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(100, 7), requires_grad=False)
        self.register_buffer("b", torch.arange(33, dtype=torch.int8))
        self.register_buffer("viewed", torch.randn(50))
        self.register_buffer("sliced", torch.randn(40)[5:])
        self.trained = nn.Parameter(torch.randn(20))  # requires grad (from_pretrained leaves HF's so): moved too


def test_only_tensors_that_own_their_storage_alone_move():
    m = _Holder()
    outside_view = m.viewed[10:]  # a view held elsewhere would stop seeing the arena's values
    values = {k: v.clone() for k, v in m.state_dict().items()}
    ids = {k: id(v) for k, v in m.state_dict(keep_vars=True).items()}
    moved = weight_arena.pack_into_arena([m])
    assert moved >= 100 * 7 * 4 + 33
    assert m.a.untyped_storage().data_ptr() == m.b.untyped_storage().data_ptr()
    assert m.trained.untyped_storage().data_ptr() == m.a.untyped_storage().data_ptr()
    assert m.trained.requires_grad and isinstance(m.trained, nn.Parameter)
    for name in ("viewed", "sliced"):
        assert getattr(m, name).untyped_storage().data_ptr() != m.a.untyped_storage().data_ptr(), name
    assert outside_view.untyped_storage().data_ptr() == m.viewed.untyped_storage().data_ptr()
    for k, v in m.state_dict(keep_vars=True).items():
        assert id(v) == ids[k], "the same tensor objects, moved in place"
        assert torch.equal(v, values[k]), k
    assert isinstance(m.a, nn.Parameter)


def test_nothing_to_move_returns_zero(monkeypatch):
    assert weight_arena.pack_into_arena([nn.Linear(4, 4, bias=False)]) == 0  # one tensor: nothing to gather
    m = _Holder()
    monkeypatch.setenv(weight_arena.ENV_VAR, "0")
    assert weight_arena.pack_into_arena([m]) == 0
