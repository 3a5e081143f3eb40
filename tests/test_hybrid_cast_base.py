"""Frozen weights in another dtype are cast into the inference copy once (hybrid/shared_base.py, "cast once").

An fp32 peft LoRA model with a bf16 copy cannot share the base's storage; its base is cast at build, LoRA runs as a
side path, and a refresh copies only the adapters' factors. The oracle is peft's merged model: the copy's logits stay
within bf16 rounding of it (as close as a copy that fuses ``W + BA`` at every refresh, ``share_base=False``), before
and after optimizer steps; a base that changes (in place, or rebound) or a copy freed by ``sleep()`` is cast again.
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
    model = peft.get_peft_model(build_tiny("llama", seed=0), peft.LoraConfig(r=4, lora_alpha=8,
                                                                              target_modules="all-linear"))  # fmt: skip
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


def _qkv_base(model: torch.nn.Module, layer: int) -> torch.Tensor:
    attn = model.base_model.model.model.layers[layer].self_attn
    return torch.cat([m.base_layer.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj)])  # [q + k + v, C]


def test_bf16_copy_casts_the_frozen_base_once_with_lora_as_a_side_path():
    model = _lora_model()
    he = HybridEngine(model, inference_config=CFG)
    shared = he._shared
    assert shared is not None and shared.cast and shared.lora and not shared.trainable
    assert shared.bytes_shared == 0  # nothing is shared: the copy holds the cast values
    qkv = he.module.model.layers[1].attn.qkv
    assert qkv.weight.dtype == torch.bfloat16 and torch.equal(qkv.weight, _qkv_base(model, 1).to(torch.bfloat16))
    assert qkv.lora_a.dtype == torch.bfloat16
    assert he.memory()["weights"] >= 0.45 * sum(p.numel() * 4 for p in model.parameters())  # the bf16 copy
    fused = HybridEngine(model, inference_config=CFG, share_base=False)  # W + BA fused, in bf16
    ids, mask = _ids()
    want = _merged_logits(model, ids, mask)
    err_cast, err_fused = _err(_engine_logits(he, ids, mask), want, mask), _err(_engine_logits(fused, ids, mask), want,
                                                                                 mask)  # fmt: skip
    assert err_cast < 0.05 and err_cast <= 3 * err_fused + 1e-3, (err_cast, err_fused)


def test_refresh_copies_only_the_adapters_and_follows_optimizer_steps():
    model = _lora_model()
    he = HybridEngine(model, inference_config=CFG)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    ids, mask = _ids()
    before = _engine_logits(he, ids, mask)
    qkv = he.module.model.layers[0].attn.qkv.weight
    base_bits = qkv.detach().clone()
    for _ in range(2):
        model.train()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    writes = []
    original = he._shared.recast_changed
    he._shared.recast_changed = lambda w: writes.append(original(w)) or writes[-1]
    after = _engine_logits(he, ids, mask)
    assert writes == [set()]  # the frozen base did not change: nothing cast again
    assert torch.equal(qkv, base_bits)
    want = _merged_logits(model, ids, mask)
    assert _err(after, want, mask) < 0.05
    assert _err(after, before, mask) > 10 * _err(after, want, mask)  # the adapters moved: the copy followed


def test_a_changed_or_rebound_base_is_cast_again_and_sleep_wake_restores_it():
    model = _lora_model()
    he = HybridEngine(model, inference_config=CFG)
    ids, mask = _ids()
    q_base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    with torch.no_grad():
        q_base.mul_(1.5)  # in place: bumps the version counter (as load_state_dict's copy_ does)
    got = _engine_logits(he, ids, mask)
    qkv = he.module.model.layers[0].attn.qkv.weight
    assert torch.equal(qkv, _qkv_base(model, 0).to(torch.bfloat16))
    assert _err(got, _merged_logits(model, ids, mask), mask) < 0.05
    q_base.data = q_base.data * 0.5  # rebound: another address
    _engine_logits(he, ids, mask)
    assert torch.equal(qkv, _qkv_base(model, 0).to(torch.bfloat16))
    he.sleep()
    assert he.memory()["weights"] < 0.1 * sum(p.numel() * 2 for p in model.parameters())
    got = _engine_logits(he, ids, mask)  # eval() wakes: storage back, the cast base cast again
    assert torch.equal(qkv, _qkv_base(model, 0).to(torch.bfloat16))
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
