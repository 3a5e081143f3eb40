"""Frozen base, no second copy (hybrid/shared_base.py): with peft LoRA on every linear layer, the inference copy and
the training model share the base weights' storage and LoRA runs as a side path. On the real SmolLM2-135M (fp32,
LoRA r=16 on all linear layers): the copy adds <= 0.15x the base weight bytes (``memory()``), both models' storages
together hold the base once, greedy tokens equal peft's ``generate`` after optimizer steps, the shared base is never
written, and the RSS grows <= 0.35x the base over building the engine and two train/generate cycles (measured from
resident weights: see the test). Tiny models: full fine-tuning shares too (tests/test_hybrid_shared_full.py);
``share_base=False`` copies everything."""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch
from tiny_models import PAD, build_tiny, left_pad, prompts, randomize_lora

from hf_dsinfer.hybrid import HybridEngine
from hf_dsinfer.real_model import smollm2_available, smollm2_path

peft = pytest.importorskip("peft")


def _rss() -> int:
    """Resident bytes of this process after returning malloc's free pages to the OS (Linux)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _cycle(he, model, opt, gen) -> torch.Tensor:
    """One RL-style iteration: generate with the engine, then one optimizer step on the LM loss of the rollouts."""
    with he.inference():
        out = he.generate(**gen)
    model.train()
    model(input_ids=out, labels=out).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out


@pytest.mark.skipif(not smollm2_available(), reason="SmolLM2 not installed (see real_model.SMOLLM2_INSTALL)")
def test_smollm2_lora_shares_the_base():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    randomize_lora(model, scale=0.02)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    enc = tok(["The capital of France is", "def fibonacci(n):"], return_tensors="pt", padding=True, padding_side="left")
    gen = dict(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id or PAD)
    with torch.no_grad():  # a training forward reads every weight: loaded from safetensors, they are file-mapped pages
        for p in model.parameters():  # that are not resident until read (untouched, the baseline would miss the base)
            p.sum()
    gc.collect()
    rss0 = _rss()
    he = HybridEngine(model, inference_config={"max_out_tokens": 64, "max_batch_size": 2, "cpu_compile": False})
    weights = he.memory()["weights"]
    assert weights <= 0.15 * base_bytes, (weights, base_bytes)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad and "layers.3." in n}
    outs = []
    for _ in range(2):
        outs.append(_cycle(he, model, opt, gen))
        model.eval()
        with torch.no_grad():  # peft's own generate on the trained weights (unmerged LoRA layers) is the oracle
            want = type(model).generate(model, **gen)
        with he.inference():
            got = he.generate(**gen)
        assert torch.equal(got, want)
    growth = _rss() - rss0
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *he.module.parameters(), *he.module.buffers())}  # fmt: skip
    live = sum(storages.values())
    print(f"SmolLM2 LoRA r=16: memory()={weights / 2**20:.1f} MiB ({weights / base_bytes:.3f}x of "
          f"{base_bytes / 2**20:.1f} MiB base); training + inference storages {live / 2**20:.1f} MiB "
          f"({live / base_bytes:.3f}x); RSS growth over two cycles {growth / 2**20:.1f} MiB "
          f"({growth / base_bytes:.3f}x)")
    # Both models together hold the base once (plus LoRA, its side paths and rotary tables); the RSS growth is the side
    # paths, the KV cache and AdamW's state for the LoRA factors (batch 2: no packed CPU copies).
    assert live <= 1.15 * base_bytes, (live, base_bytes)
    assert growth <= 0.35 * base_bytes, (growth, base_bytes)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"{n}: the shared base was written"


def test_full_finetune_shares_and_share_base_false_copies():
    model = build_tiny("llama", seed=0).train()
    plain = sum(p.numel() * p.element_size() for p in model.parameters())
    he = HybridEngine(model, inference_config={"max_out_tokens": 32, "cpu_compile": False})
    assert he._shared is not None and he._shared.trainable, "full fine-tuning shares the trainable weights too"
    assert he.memory()["weights"] < 0.05 * plain
    lora = peft.get_peft_model(build_tiny("llama", seed=0), peft.LoraConfig(r=4, target_modules="all-linear"))
    randomize_lora(lora)
    copy = HybridEngine(lora, inference_config={"max_out_tokens": 32, "cpu_compile": False}, share_base=False)
    assert copy._shared is None and copy.memory()["weights"] >= plain
    shared = HybridEngine(lora, inference_config={"max_out_tokens": 32, "cpu_compile": False})
    assert shared._shared is not None and shared.memory()["weights"] < 0.2 * plain
    ids, mask = left_pad(prompts((5, 9)))
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    assert torch.equal(copy.generate(**gen), shared.generate(**gen))
    with pytest.raises(ValueError, match="share_base"):
        HybridEngine(lora, share_base="yes")


def test_side_paths_follow_adapter_state_and_replan_only_when_it_changes(monkeypatch):
    """The side paths' copy plan (SharedBase.refresh_lora) is built once and rebuilt only when the routing changes:
    another active adapter, a new scaling, adapters disabled, ``sleep()``. After every change the shared engine's
    logits equal those of an engine that fuses W + BA into its own copy (``share_base=False``), and a value-only change
    (an optimizer step on B) is copied without replanning. Scalings 2 (a product) and 1 (copied straight) both run."""
    from hf_dsinfer.hybrid.shared_base import SharedBase

    model = peft.get_peft_model(build_tiny("llama", seed=0), peft.LoraConfig(r=4, lora_alpha=8,
                                                                             target_modules="all-linear"))  # fmt: skip
    model.add_adapter("second", peft.LoraConfig(r=4, lora_alpha=4, target_modules="all-linear"))
    randomize_lora(model)
    cfg = {"max_out_tokens": 32, "cpu_compile": False}
    builds = []
    build = SharedBase._build_lora_plan
    monkeypatch.setattr(SharedBase, "_build_lora_plan", lambda self, w: builds.append(1) or build(self, w))
    shared = HybridEngine(model, inference_config=cfg)
    fused = HybridEngine(model, inference_config=cfg, share_base=False)
    assert shared._shared is not None and shared._shared.lora and fused._shared is None
    assert len(builds) == 1, "planned once, by the build's refresh"
    ids, mask = left_pad(prompts((5, 9)))
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD,
               output_logits=True, return_dict_in_generate=True)  # fmt: skip

    def check(step: str, replans: int) -> None:
        before = len(builds)
        outs = []
        for he in (shared, fused):
            with he.inference():
                outs.append(he.generate(**gen))
        assert len(builds) - before == replans, f"{step}: {len(builds) - before} replans, expected {replans}"
        assert torch.equal(outs[0].sequences, outs[1].sequences), step
        for a, b in zip(outs[0].logits, outs[1].logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=step)

    check("next refresh", 0)
    lora_b = [m.lora_B["default"].weight for m in model.modules() if hasattr(m, "lora_B") and "default" in m.lora_B]
    with torch.no_grad():
        for p in lora_b:
            p.mul_(-1.5)  # what an optimizer step does: the values change, the tensors stay
    check("B changed in place", 0)
    model.base_model.set_adapter("second")  # scaling 4 / 4 = 1: B copied straight
    check("other adapter", 1)
    layers = [m for m in model.modules() if "second" in (m.scaling if isinstance(getattr(m, "scaling", None), dict)
                                                          else ())]  # fmt: skip
    for m in layers:
        m.scaling["second"] = 0.75
    check("new scaling", 1)
    with model.disable_adapter():
        check("adapters disabled", 1)
    check("enabled again", 1)
    shared.sleep()
    check("after sleep", 1)
