"""Frozen weights without LoRA in another dtype are cast into the inference copy once (hybrid/shared_base.py).

An fp32 peft model with a bf16 copy cannot share the base's storage. Its frozen weights that carry no adapter (here:
LoRA on q and v only, so o, gate/up, down, the embedding and the norms) are cast at build and never rewritten by a
refresh; the adapted ones keep ``W + BA`` fused at each refresh. The oracle is peft's merged model: the copy's logits
stay within bf16 rounding of it before and after optimizer steps; a base that changes (in place, or rebound) or a
copy freed by ``sleep()`` is cast again.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import build_tiny, left_pad, prompts, randomize_lora

from hf_dsinfer.hybrid import HybridEngine

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")
CFG = {"dtype": "bf16", "max_out_tokens": 48, "cpu_compile": False}


def _lora_model() -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(build_tiny("llama", seed=0), config)
    randomize_lora(model)
    return model


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    return left_pad(prompts((5, 9, 3)))


def _merged_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    merged = copy.deepcopy(model).merge_and_unload().eval()
    with torch.no_grad():
        return merged(input_ids=ids, attention_mask=mask).logits.float()  # [B, T, V]


def _engine_logits(he: HybridEngine, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with he.inference(), torch.no_grad():
        return he.module(input_ids=ids, attention_mask=mask).logits.float()  # [B, T, V]


def _err(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> float:
    keep = mask.bool()  # left padding's logits are not compared
    return float((got - want)[keep].abs().max())


def _layer(model: torch.nn.Module, i: int) -> torch.nn.Module:
    return model.base_model.model.model.layers[i]


def _gate_up(model: torch.nn.Module, i: int) -> torch.Tensor:
    mlp = _layer(model, i).mlp
    return torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # [2 * I, C]


def _cast_ids(he: HybridEngine) -> set[int]:
    return {id(entry[0]) for entry in he._shared.cast}


def test_bf16_copy_casts_frozen_weights_without_lora_once_and_fuses_the_adapted_ones():
    model = _lora_model()
    he = HybridEngine(model, inference_config=CFG)
    shared = he._shared
    assert shared is not None and shared.cast and not shared.lora and not shared.trainable
    assert shared.bytes_shared == 0  # nothing is shared: the copy holds the cast values
    layer = he.module.model.layers[1]
    assert id(layer.mlp.up.weight) in _cast_ids(he) and id(layer.attn.qkv.weight) not in _cast_ids(he)
    assert torch.equal(layer.mlp.up.weight, _gate_up(model, 1).to(torch.bfloat16))
    merged = copy.deepcopy(model).merge_and_unload()
    attn = merged.model.layers[1].self_attn
    fused = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).to(torch.bfloat16)
    assert torch.equal(layer.attn.qkv.weight, fused)  # q and v adapted: W + BA fused
    ids, mask = _ids()
    assert _err(_engine_logits(he, ids, mask), _merged_logits(model, ids, mask), mask) < 0.05


def test_refresh_skips_the_cast_weights_and_follows_optimizer_steps():
    model = _lora_model()
    he = HybridEngine(model, inference_config=CFG)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    ids, mask = _ids()
    before = _engine_logits(he, ids, mask)
    gate_up = he.module.model.layers[0].mlp.up.weight
    bits = gate_up.detach().clone()
    for _ in range(2):
        model.train()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    writes = []
    original = he._shared.recast_changed
    he._shared.recast_changed = lambda w: writes.append(original(w)) or writes[-1]
    after = _engine_logits(he, ids, mask)
    assert writes == [set()]  # no frozen weight changed: nothing cast again
    assert torch.equal(gate_up, bits)
    want = _merged_logits(model, ids, mask)
    assert _err(after, want, mask) < 0.05
    assert _err(after, before, mask) > 10 * _err(after, want, mask)  # the adapters moved: the copy followed


def test_a_changed_or_rebound_weight_is_cast_again_and_sleep_wake_restores_it():
    model = _lora_model()
    he = HybridEngine(model, inference_config=CFG)
    ids, mask = _ids()
    gate = _layer(model, 0).mlp.gate_proj.weight
    with torch.no_grad():
        gate.mul_(1.5)  # in place: bumps the version counter (as load_state_dict's copy_ does)
    got = _engine_logits(he, ids, mask)
    gate_up = he.module.model.layers[0].mlp.up.weight
    assert torch.equal(gate_up, _gate_up(model, 0).to(torch.bfloat16))
    assert _err(got, _merged_logits(model, ids, mask), mask) < 0.05
    gate.data = gate.data * 0.5  # rebound: another address
    _engine_logits(he, ids, mask)
    assert torch.equal(gate_up, _gate_up(model, 0).to(torch.bfloat16))
    he.sleep()
    assert he.memory()["weights"] < 0.1 * sum(p.numel() * 2 for p in model.parameters())
    got = _engine_logits(he, ids, mask)  # eval() wakes: storage back, the cast weights cast again
    assert torch.equal(gate_up, _gate_up(model, 0).to(torch.bfloat16))
    assert _err(got, _merged_logits(model, ids, mask), mask) < 0.05


def test_trainable_weights_in_another_dtype_are_still_copied_each_refresh():
    model = build_tiny("llama", seed=0).train()  # full fine-tuning, fp32, bf16 copy: nothing frozen to cast
    he = HybridEngine(model, inference_config=CFG)
    assert he._shared is None or not he._shared.cast
    ids, mask = _ids()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    got = _engine_logits(he, ids, mask)
    with torch.no_grad():
        want = model.eval()(input_ids=ids, attention_mask=mask).logits.float()
    assert _err(got, want, mask) < 0.05
