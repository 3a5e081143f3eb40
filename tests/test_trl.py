"""TRL as a client of the Hybrid Engine: GRPOTrainer / RLOOTrainer with ``HybridEngineCallback`` (tiny random llama,
offline tokenizer, CPU, greedy) give the same completions, losses and saved weights as without it, the rollouts run on
the engine, ``generate_batch`` (TRL's continuous-batching path) is routed, and TRL's generation settings are
honoured."""

from __future__ import annotations

import pytest
import torch
from tiny_models import PAD, build_tiny, left_pad, make_tokenizer, prompts
from transformers import GenerationConfig

from hf_dsinfer import HybridEngineCallback
from hf_dsinfer.generation.stats import last_generate_stats
from hf_dsinfer.hybrid import HybridEngine

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

PROMPTS = ["The quick brown fox", "Hello world", "DeepSpeed inference", "tiny tokenizer"]
STEPS = 3


pytestmark = pytest.mark.usefixtures("one_thread")


def reward_by_index(completions, **_):
    """A trivial reward that differs inside each group (greedy completions of one prompt are identical), so the
    advantages, and with them the updates, are not zero."""
    return [float(i % 2) for i in range(len(completions))]


def _train(trainer_name: str, tmp_path, callback=None, lr: float = 0.05, peft_config=None, **extra):
    """Run a few steps; returns (completions per step, logged losses, saved weights: the adapter with
    ``peft_config``)."""
    config_cls = {"grpo": trl.GRPOConfig, "rloo": trl.RLOOConfig}[trainer_name]
    trainer_cls = {"grpo": trl.GRPOTrainer, "rloo": trl.RLOOTrainer}[trainer_name]
    out = tmp_path / f"{trainer_name}-{'engine' if callback else 'plain'}-{lr}-{'lora' if peft_config else 'full'}"
    args = config_cls(
        output_dir=str(out), per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
        max_steps=STEPS, learning_rate=lr, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        generation_kwargs={"do_sample": False}, use_cpu=True, bf16=False, disable_tqdm=True,
        beta=0.0,  # no KL term: no reference model to load from the hub
        **extra,
    )  # fmt: skip
    torch.manual_seed(0)  # peft's lora_A initialization draws from torch's global RNG
    trainer = trainer_cls(
        model=build_tiny("llama", seed=0), reward_funcs=reward_by_index, args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}), processing_class=make_tokenizer(),
        callbacks=[callback] if callback else None, peft_config=peft_config,
    )  # fmt: skip
    completions = []
    generate_rollouts = trainer._generate_single_turn

    def record(*a, **k):
        result = generate_rollouts(*a, **k)
        completions.append(result[0])
        return result

    trainer._generate_single_turn = record
    trainer.train()
    trainer.save_model(str(out / "final"))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    from safetensors.torch import load_file

    saved = "adapter_model.safetensors" if peft_config is not None else "model.safetensors"
    return completions, losses, load_file(str(out / "final" / saved))


def _same(a, b) -> bool:
    same_weights = a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])
    return a[0] == b[0] and a[1] == b[1] and same_weights


@pytest.mark.parametrize("trainer_name", ["grpo", "rloo"])
def test_trl_with_callback_equals_plain_trl(trainer_name, tmp_path):
    plain = _train(trainer_name, tmp_path)
    callback = HybridEngineCallback(inference_config={"max_out_tokens": 64})
    with_engine = _train(trainer_name, tmp_path, callback=callback)
    assert len(plain[0]) == STEPS
    assert _same(plain, with_engine), "completions, losses and saved weights must equal plain TRL's"
    stats = callback.engine.stats
    assert stats.summary()["iterations"] >= STEPS - 1 and sum(it.generate_calls for it in stats.iterations) == STEPS
    assert last_generate_stats(callback.engine.module).path == "fast", "rollouts should run hf_dsinfer's fast loop"
    frozen = _train(trainer_name, tmp_path, lr=0.0)  # control: the rollouts depend on the updates
    assert frozen[0] != plain[0]


def test_trl_grpo_lora_with_shared_base_equals_plain_trl(tmp_path):
    """GRPO with peft LoRA on every linear layer (TRL's ``peft_config``): the engine shares the frozen base with the
    training model (LoRA as a side path) and the completions, losses and saved adapter equal plain TRL's."""
    peft = pytest.importorskip("peft")

    def lora():
        return peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)

    plain = _train("grpo", tmp_path, peft_config=lora(), lr=0.2)
    callback = HybridEngineCallback(inference_config={"max_out_tokens": 64})
    with_engine = _train("grpo", tmp_path, callback=callback, peft_config=lora(), lr=0.2)
    engine = callback.engine
    assert engine._shared is not None and engine.memory()["shared_with_training"] > 0, "the frozen base is shared"
    assert len(plain[0]) == STEPS and any("lora_B" in k for k in plain[2])
    assert _same(plain, with_engine), "completions, losses and saved adapter must equal plain TRL's"
    assert last_generate_stats(engine.module).path == "fast", "rollouts should run hf_dsinfer's fast loop"
    frozen = _train("grpo", tmp_path, peft_config=lora(), lr=0.0)  # control: the rollouts depend on the updates
    assert frozen[0] != plain[0]
    callback = HybridEngineCallback(inference_config={"max_out_tokens": 64})  # the paged engine over the side paths
    routed = _train("grpo", tmp_path, callback=callback, peft_config=lora(), lr=0.2,
                    use_transformers_continuous_batching=True)  # fmt: skip
    assert callback.engine._shared is not None and routed[:2] == plain[:2]


def test_trl_continuous_batching_is_routed_to_the_engine(tmp_path):
    callback = HybridEngineCallback(inference_config={"max_out_tokens": 64})
    routed = _train("grpo", tmp_path, callback=callback, use_transformers_continuous_batching=True)
    plain = _train("grpo", tmp_path)  # TRL's regular path, generate on the training model
    assert sum(it.generate_calls for it in callback.engine.stats.iterations) == STEPS
    assert routed[0] == plain[0] and routed[1] == plain[1]


def test_generate_batch_matches_generate_per_prompt():
    model = build_tiny("llama", seed=0)
    he = HybridEngine(model, inference_config={"max_out_tokens": 64, "max_batch_size": 2})
    batch = prompts((5, 9, 3))
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=[2, 7])
    results = he.generate_batch(batch, generation_config=config)  # 3 prompts, max_batch_size 2: two calls
    assert list(results) == ["req_0", "req_1", "req_2"]
    for i, prompt in enumerate(batch):
        ids = torch.tensor([prompt])
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        tokens = want[0, len(prompt) :].tolist()
        end = next((k + 1 for k, t in enumerate(tokens) if t in (2, 7)), len(tokens))
        assert results[f"req_{i}"].generated_tokens == tokens[:end]
        assert results[f"req_{i}"].prompt_ids == prompt
    sampled = GenerationConfig(max_new_tokens=6, do_sample=True, pad_token_id=PAD, num_return_sequences=2)
    results = he.generate_batch(batch, generation_config=sampled)
    assert list(results) == ["req_0__child#0", "req_0", "req_1__child#0", "req_1", "req_2__child#0", "req_2"]
    assert all(len(r.generated_tokens) == 6 for r in results.values())


def test_generate_batch_stop_strings_with_tokenizer():
    """``tokenizer=`` reaches the paged engine through the Hybrid Engine, so ``stop_strings`` is honoured as HF's
    ``generate(tokenizer=...)`` honours it (it needs the tokenizer to read tokens as text)."""
    model = build_tiny("llama", seed=0)
    tok = make_tokenizer()
    he = HybridEngine(model, inference_config={"max_out_tokens": 64, "max_batch_size": 2})
    prompt = prompts((6,))[0]
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    plain = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=2)
    free = model.generate(input_ids=ids, attention_mask=mask, generation_config=plain)[0, len(prompt) :].tolist()
    # the text of the first new token after the first that the tokenizer reads as text (the model's vocabulary is
    # larger than the tokenizer's): generation must end there
    k = next((k for k in range(1, len(free)) if tok.decode(free[k : k + 1]).strip()), None)
    assert k is not None, f"no new token of {free} decodes to text: pick another prompt"
    stop = tok.decode(free[k : k + 1])
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=2, stop_strings=stop)
    want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, tokenizer=tok)
    want = want[0, len(prompt) :].tolist()
    assert len(want) < len(free)
    got = he.generate_batch([prompt], generation_config=config, tokenizer=tok)["req_0"]
    assert got.error is None and got.generated_tokens == want


def test_trl_generation_config_is_honoured():
    """GRPO's GenerationConfig (all of TRL's knobs) runs the fast loop without a fallback; with sampling="hf" the
    draws equal HF generate's; greedy with a repetition penalty equals HF generate."""
    model = build_tiny("llama", seed=0).eval()
    ids, mask = left_pad(prompts((5, 9, 3)))
    trl_config = dict(max_new_tokens=8, do_sample=True, pad_token_id=PAD, bos_token_id=1, eos_token_id=[2],
                      temperature=0.8, top_p=0.9, top_k=30, min_p=0.01, repetition_penalty=1.3,
                      cache_implementation=None, disable_compile=True)  # fmt: skip
    config = GenerationConfig(**trl_config)
    he = HybridEngine(model, inference_config={"max_out_tokens": 64})
    he.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert last_generate_stats(he.module).path == "fast"

    torch.manual_seed(11)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    he_hf = HybridEngine(model, inference_config={"max_out_tokens": 64}, sampling="hf")
    torch.manual_seed(11)
    assert torch.equal(he_hf.generate(input_ids=ids, attention_mask=mask, generation_config=config), expected)

    greedy = GenerationConfig(**{**trl_config, "do_sample": False})
    want = model.generate(input_ids=ids, attention_mask=mask, generation_config=greedy)
    assert torch.equal(he.generate(input_ids=ids, attention_mask=mask, generation_config=greedy), want)
