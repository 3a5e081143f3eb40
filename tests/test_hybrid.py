"""HybridEngine on CPU: fused inference copy vs HF generate on ``merge_and_unload()`` of a copy (fp32, greedy tokens
identical), training weights never written, inference buffers never moved, refresh after optimizer steps, stats."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import PAD, build_tiny, left_pad, prompts, randomize_lora

import hf_dsinfer
from hf_dsinfer.hybrid import HybridEngine, UnsupportedAdapterError
from hf_dsinfer.policies import find_policy, get_injection

CFG = {"max_out_tokens": 64}
NEW = 8


pytestmark = pytest.mark.usefixtures("one_thread")


def lora_model(arch: str = "llama", config: dict | None = None, **lora: object) -> torch.nn.Module:
    lora = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": "all-linear", **lora}
    model = get_peft_model(build_tiny(arch, seed=0, **(config or {})), LoraConfig(**lora))
    randomize_lora(model)
    return model


def _gen_inputs(lengths=(5, 9, 3)) -> dict:
    ids, mask = left_pad(prompts(lengths))
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)


def _reference(model: torch.nn.Module, gen: dict) -> torch.Tensor:
    merged = copy.deepcopy(model)
    if hasattr(merged, "merge_and_unload"):
        merged = merged.merge_and_unload()
    return merged.eval().generate(**gen)


def _two_adapters() -> torch.nn.Module:
    model = lora_model(use_rslora=True)
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]))
    model.base_model.set_adapter(["default", "second"])  # both active: deltas add up, as in peft's forward
    randomize_lora(model, seed=2)
    return model


CASES = {
    "plain_hf": lambda: build_tiny("llama", seed=0),
    "lora_all_linear": lambda: lora_model(),
    "rslora_two_active_adapters": _two_adapters,
    "lora_embedding_and_modules_to_save": lambda: lora_model(
        target_modules=["embed_tokens", "v_proj", "up_proj"], modules_to_save=["lm_head"]
    ),
    "tied_embeddings": lambda: lora_model(config={"tie_word_embeddings": True}),
    "qwen2_lora_bias": lambda: lora_model("qwen2", target_modules=["q_proj", "k_proj", "v_proj"], lora_bias=True),
    "gpt2_conv1d_fan_in_fan_out": lambda: lora_model("gpt2", target_modules=["c_attn", "c_fc"], fan_in_fan_out=True),
    # Families whose policies may be added later: with no policy the copy keeps HF modules (and must still match).
    "opt_lora": lambda: lora_model("opt"),
    "gpt_neox_lora": lambda: lora_model("gpt_neox"),
    "falcon_lora": lambda: lora_model("falcon"),
    "gemma2_lora": lambda: lora_model("gemma2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generation_equals_merged_reference(case):
    model = CASES[case]()
    gen = _gen_inputs()
    expected = _reference(model, gen)
    he = HybridEngine(model, inference_config=CFG)
    arch = he.weights.hf_model
    if find_policy(arch) is not None and find_policy(arch).serves(arch):
        assert get_injection(he.module) is not None, "the inference copy should run fused layers"
    if getattr(arch.config, "tie_word_embeddings", False):
        assert he.module.get_output_embeddings().weight is he.module.get_input_embeddings().weight
    he.eval()
    out = he.generate(**gen)
    he.train()
    assert torch.equal(out, expected), f"{out.tolist()} != {expected.tolist()}"
    assert model.training  # train() puts the training model back in training mode


@pytest.mark.parametrize("case", [c for c in CASES if c != "plain_hf"])
def test_fused_lora_values_equal_peft_merge_bitwise(case):
    """What a copy that cannot share the base (another dtype, TP) is filled from: every effective weight equals
    peft's ``merge_and_unload()`` bit for bit in fp32 (deltas scaled then added, several adapters in peft's order)."""
    from hf_dsinfer.hybrid.weights import TrainingWeights

    model = CASES[case]()
    weights = TrainingWeights(model)
    merged = copy.deepcopy(model)
    merged = merged.merge_and_unload() if hasattr(merged, "merge_and_unload") else merged
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    differing = [n for n, p in merged.named_parameters() if not torch.equal(weights.get(n), p.detach())]
    assert not differing, f"fused values differ from peft's merge: {differing}"
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters()), "reading fused a training weight"


def test_switches_never_touch_training_state_and_buffers_stay_put():
    model = lora_model()
    model.train()
    gen = _gen_inputs()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=5e-2)
    ids = gen["input_ids"]

    def step() -> None:
        opt.zero_grad()
        model(input_ids=ids, attention_mask=gen["attention_mask"], labels=ids).loss.backward()
        opt.step()

    step()  # optimizer state exists from here on
    he = HybridEngine(model, inference_config=CFG)
    pointers = he.buffer_pointers()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: v.clone() for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)}
    first = None
    for i in range(100):
        he.eval()
        if i % 25 == 0:
            out = he.generate(**gen)
            first = out if first is None else first
            assert torch.equal(out, first)
        he.train()
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters()), "training weights changed"
    after = {k: v for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)}
    assert all(torch.equal(state[k], v) for k, v in after.items()), "optimizer state changed"
    assert he.buffer_pointers() == pointers

    qkv = he.module.model.layers[0].attn.qkv
    # the frozen base is shared with the training model (hybrid/shared_base.py): LoRA lives in the side path
    qkv = qkv.lora_b if hasattr(qkv, "lora_b") else qkv.weight
    old_qkv = qkv.detach().clone()
    step()  # new weights: the next eval() must show them
    he.eval()
    out = he.generate(**gen)
    he.train()
    assert not torch.equal(qkv, old_qkv), "the inference buffers were not refreshed after the optimizer step"
    assert torch.equal(out, _reference(model, gen))
    assert he.buffer_pointers() == pointers, "a refresh moved an inference buffer (captured graphs would break)"


def test_generate_outside_eval_switches_for_the_call():
    model = lora_model()
    model.train()
    he = HybridEngine(model, inference_config=CFG)
    gen = _gen_inputs((4, 6))
    out = he.generate(**gen)
    assert not he.in_inference and model.training
    assert torch.equal(out, _reference(model, gen))


def test_refresh_auto_skips_unchanged_weights_and_sees_optimizer_steps():
    model = lora_model()
    he = HybridEngine(model, inference_config=CFG, refresh="auto")
    he.eval().train()
    assert not he.stats.last.refreshed  # nothing changed since the build
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    gen = _gen_inputs((4, 6))
    model(input_ids=gen["input_ids"], labels=gen["input_ids"]).loss.backward()
    opt.step()
    he.eval()
    assert he.stats.last.refreshed
    assert torch.equal(he.generate(**gen), _reference(model, gen))
    he.train()
    he.mark_dirty()
    assert he.eval().stats.last.refreshed
    he.train()


def test_release_inference_cache_frees_kv_between_generations():
    model = lora_model()
    he = HybridEngine(model, inference_config=CFG, release_inference_cache=True)
    cache = get_injection(he.module).runtime.cache
    gen = _gen_inputs()
    with he.inference():
        first = he.generate(**gen)
        assert cache.keys, "the KV cache should be allocated while generating"
    assert not cache.keys, "release_inference_cache=True must free the KV cache when leaving inference"
    with he.inference():
        assert torch.equal(he.generate(**gen), first)


@pytest.mark.parametrize("share_base", ["auto", False])
def test_bf16_inference_copy_holds_fused_lora_weights(share_base):
    """An adapted frozen weight in another dtype: ``W + BA`` fused into the bf16 copy (frozen weights without LoRA
    are cast once instead: tests/test_hybrid_cast_base.py)."""
    model = lora_model()
    he = HybridEngine(model, inference_config={**CFG, "dtype": "bf16"}, share_base=share_base)
    merged = copy.deepcopy(model).merge_and_unload()
    attn = merged.model.layers[1].self_attn
    want = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).to(torch.bfloat16)
    got = he.module.model.layers[1].attn.qkv.weight
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert he.generate(**_gen_inputs()).shape == (3, 9 + NEW)


def test_stats_record_each_phase():
    model = lora_model()
    he = HybridEngine(model, inference_config=CFG)
    gen = _gen_inputs()
    for _ in range(2):
        he.eval()
        he.generate(**gen)
        he.train()
        sum(p.sum() for p in model.parameters()).item()  # some "training" time
    he.eval()
    first = he.stats.iterations[0]
    assert first.complete and first.refreshed
    assert first.generate_calls == 1 and first.samples == 3 and first.new_tokens == 3 * NEW
    assert first.generate_ms > 0 and first.refresh_ms > 0 and first.train_ms > 0 and first.tokens_per_s > 0
    assert first.e2e_ms >= first.generate_ms + first.refresh_ms + first.train_ms
    logged = he.stats.log_dict()
    assert {
        "hybrid/generate_ms",
        "hybrid/refresh_ms",
        "hybrid/tokens_per_s",
        "hybrid/train_ms",
        "hybrid/e2e_ms",
    } <= set(logged)
    assert he.stats.summary()["iterations"] == 2
    he.train()


def test_unsupported_adapters_are_refused():
    with pytest.raises(UnsupportedAdapterError, match="DoRA|Dora"):
        HybridEngine(lora_model(use_dora=True), inference_config=CFG)
    from peft import IA3Config

    ia3 = get_peft_model(
        build_tiny("llama"), IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    )
    with pytest.raises(UnsupportedAdapterError, match="IA3"):
        HybridEngine(ia3, inference_config=CFG)


def test_exports():
    assert hf_dsinfer.HybridEngine is HybridEngine
    assert "HybridEngineCallback" in hf_dsinfer.__all__


def test_hybrid_bench_rows_on_cpu():
    from hf_dsinfer.bench.hybrid import run_hybrid_bench

    rows = run_hybrid_bench("tiny", batch=2, prompt_len=8, new_tokens=4, device="cpu", dtype="fp32", iterations=1)
    assert [(r["mode"], r["peer"]) for r in rows] == [("full", "hf"), ("full", "hybrid"), ("lora", "peft"),
                                                      ("lora", "hybrid")]  # fmt: skip
    assert all(not r["failed"] and r["generate_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["generate_cpu_ms"] > 0 for r in rows)
    for peer, hybrid in (rows[:2], rows[2:]):
        assert peer["note"].startswith("runs: ") and "cpu_speedup" in hybrid["note"]
        for row in (peer, hybrid):  # every measured iteration is kept, the medians are taken over them
            assert len(row["runs"]) == 1 and row["runs"][0]["generate_ms"] == pytest.approx(row["generate_ms"])
        assert hybrid["decode_step"] in ("compiled", "eager") and hybrid["runs"][0]["refresh_ms"] > 0
        assert hybrid["refresh_ms"] > 0 and hybrid["injected"]
        want = peer["generate_ms"] / (hybrid["generate_ms"] + hybrid["refresh_ms"])
        assert hybrid["speedup"] == pytest.approx(want, rel=1e-2)
        assert hybrid["cpu_speedup"] == pytest.approx(peer["generate_cpu_ms"] / hybrid["generate_cpu_ms"], rel=1e-2)
        assert hybrid["switch_pct"] == pytest.approx(100 * hybrid["refresh_ms"] / hybrid["generate_ms"], rel=1e-2)
        mem = hybrid["memory_mib"]
        assert mem["weights"] == hybrid["inference_copy_mib"] and mem["kv_cache"] > 0
    # LoRA shares the frozen base, full fine-tuning the trainable weights (hybrid/shared_base.py): neither copies them
    assert rows[3]["memory_mib"]["shared_with_training"] > 0 and rows[1]["memory_mib"]["shared_with_training"] > 0
