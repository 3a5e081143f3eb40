"""Full fine-tuning without a second copy (hybrid/shared_base.py): the trainable weights of a plain model become views
of the inference buffers, so the optimizer updates both models at once and a refresh copies nothing, only re-packing
the CPU packed GEMM copies of what the optimizer changed. Greedy tokens equal HF ``generate`` on the training model
after every optimizer step, with packing on (4 rows). Tensors rebound after sharing, and trainable tensors that are
views into someone else's buffer, are copied instead (never stale)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from tiny_models import PAD, build_tiny, left_pad, prompts

from hf_dsinfer.hybrid import HybridEngine
from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.modules import cpu_packed

# linears above cpu_packed.MIN_ELEMENTS, so batch-4 decoding packs them
SIZE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, vocab_size=4000)
CFG = {"max_out_tokens": 32, "max_batch_size": 4, "cpu_compile": False}


def _gen() -> dict:
    ids, mask = left_pad(prompts((5, 9, 3, 7)))
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _inference_storages(he: HybridEngine) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in he.module.parameters()}


def _hf_greedy(model: torch.nn.Module, gen: dict) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model.generate(**gen)


def test_full_finetune_shares_storage_and_follows_optimizer_steps(monkeypatch):
    monkeypatch.setenv(cpu_packed.ENV_VAR, "1")
    model = build_tiny("llama", seed=0, **SIZE).train()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # made before the engine: it keeps the same Parameters
    he = HybridEngine(model, inference_config=CFG)
    assert he.memory()["weights"] < 0.01 * weight_bytes, "no second copy of the weights (rotary tables only)"
    assert he.memory()["shared_with_training"] >= weight_bytes
    inference = _inference_storages(he)
    assert all(p.untyped_storage().data_ptr() in inference for p in model.parameters()), "every weight is shared"

    reads = []
    get = he.weights.get
    monkeypatch.setattr(he.weights, "get", lambda name: reads.append(name) or get(name))
    gen = _gen()
    first = None
    for i in range(3):
        packs = cpu_packed._stats["packs"]
        with he.inference():
            if i > 0:
                assert not reads, f"the refresh copied {reads[:3]}: shared weights need no copy"
                if cpu_packed.available():
                    assert cpu_packed._stats["packs"] > packs, "the changed weights were re-packed at the switch"
            got = he.generate(**gen)
        assert torch.equal(got, _hf_greedy(model, gen)), f"cycle {i}: engine != HF generate on the trained weights"
        first = got if first is None else first
        _step(model, opt, got)
    assert not torch.equal(first, got), "the updates change the completions (so the test can see a stale copy)"


@pytest.mark.parametrize("how", ["rebound", "replaced", "module", "parent"])
def test_rebound_weight_is_copied_with_a_warning(caplog, how):
    model = build_tiny("llama", seed=0).train()
    he = HybridEngine(model, inference_config={"max_out_tokens": 32, "cpu_compile": False})
    attn = model.model.layers[0].self_attn
    if how == "rebound":  # what model.to(...) or load_state_dict(assign=True) does: no longer the shared storage
        attn.q_proj.weight.data = attn.q_proj.weight.data.clone()
    elif how == "replaced":  # another Parameter under the same name (fully_shard): the old one is shared, unused
        attn.q_proj.weight = torch.nn.Parameter(attn.q_proj.weight.detach().clone())
    elif how == "module":  # another module under the name: the refresh's cached resolution must notice
        new = torch.nn.Linear(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)
        new.weight = torch.nn.Parameter(attn.q_proj.weight.detach().clone())
        attn.q_proj = new
    else:  # a module above it replaced (a copy of the attention block)
        model.model.layers[0].self_attn = copy.deepcopy(attn)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = _gen()
    _step(model, opt, gen["input_ids"])
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        with he.inference():
            got = he.generate(**gen)
    assert sum("q_proj.weight no longer shares" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(got, _hf_greedy(model, gen))
    _step(model, opt, gen["input_ids"])  # copied at every refresh from now on, warned once
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        with he.inference():
            got = he.generate(**gen)
    assert sum("q_proj.weight no longer shares" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(got, _hf_greedy(model, gen))


def test_trainable_view_into_another_buffer_is_copied():
    model = build_tiny("llama", seed=0).train()
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # a flat-buffer optimizer's layout (ZeRO-1/2 style)
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    he = HybridEngine(model, inference_config={"max_out_tokens": 32, "cpu_compile": False})
    assert he._shared is None or not he._shared.trainable, "views into the flat buffer are not taken over"
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in params)
    gen = _gen()
    _step(model, opt, gen["input_ids"])
    with he.inference():
        got = he.generate(**gen)
    assert torch.equal(got, _hf_greedy(model, gen))


@pytest.mark.parametrize("share_base", ["auto", False])
def test_bf16_copy_of_fp32_training_is_not_shared(share_base):
    model = build_tiny("llama", seed=0).train()
    he = HybridEngine(model, inference_config={"dtype": "bf16", "max_out_tokens": 32, "cpu_compile": False},
                      share_base=share_base)  # fmt: skip
    assert he._shared is None, "another dtype: copied"
