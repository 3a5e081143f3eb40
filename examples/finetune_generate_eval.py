"""LoRA fine-tuning with generation-based evaluation on the Hybrid Engine (Seq2SeqTrainer, predict_with_generate).

Task: reverse four digits after a separator (``<s> 3 1 4 2 = -> 2 4 1 3 </s>``). A tiny random Llama is built and saved
here, loaded back, given a LoRA adapter (plus a trainable output head) and trained with ``Seq2SeqTrainer``. Every
evaluation generates answers with ``predict_with_generate=True``; ``HybridEngineCallback`` routes those ``generate``
calls to a fused inference copy refreshed once per evaluation from the current weights, and adds its timings
(``hybrid/generate_ms``, ``hybrid/refresh_ms``, ``hybrid/tokens_per_s``, ...) to the Trainer's logs.

Runs on CPU: python examples/finetune_generate_eval.py (``time`` on the project's 2-core machine, 2026-11-25: 15 s
with an empty torch compile cache at a load average of ~3.5, 21-37 s at 6-13 with other jobs running).
"""

from __future__ import annotations

import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Seq2SeqTrainer, Seq2SeqTrainingArguments

import hf_dsinfer

VOCAB, PAD, BOS, EOS, SEP = 32, 0, 1, 2, 13
DIGITS = torch.arange(3, 13)  # token ids of the ten digits
N_DIGITS = 4


def make_rows(n: int, seed: int) -> torch.Tensor:
    """``n`` random digit strings, [n, N_DIGITS]."""
    g = torch.Generator().manual_seed(seed)
    return DIGITS[torch.randint(0, 10, (n, N_DIGITS), generator=g)]


def prompt_of(digits: torch.Tensor) -> torch.Tensor:
    """``<s> d1 .. d4 =`` for each row."""
    n = digits.shape[0]
    return torch.cat([torch.full((n, 1), BOS), digits, torch.full((n, 1), SEP)], dim=1)


class ReverseTrain(torch.utils.data.Dataset):
    """Prompt + answer; the loss covers the answer only."""

    def __init__(self, n: int, seed: int):
        digits = make_rows(n, seed)
        prompt = prompt_of(digits)
        self.ids = torch.cat([prompt, digits.flip(-1), torch.full((n, 1), EOS)], dim=1)
        self.labels = self.ids.clone()
        self.labels[:, : prompt.shape[1]] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


class ReverseEval(torch.utils.data.Dataset):
    """Prompts only (the answer is generated); ``labels`` mirror the prompt so the eval loss is defined."""

    def __init__(self, n: int, seed: int):
        self.answers = make_rows(n, seed)
        self.ids = prompt_of(self.answers)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def build_model() -> torch.nn.Module:
    path = tempfile.mkdtemp()
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.update(max_new_tokens=N_DIGITS + 1, do_sample=False, pad_token_id=PAD)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", modules_to_save=["lm_head"])
    return get_peft_model(model, lora)


def main() -> None:
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    model = build_model()
    eval_set = ReverseEval(64, seed=1)
    prompt_len = eval_set.ids.shape[1]

    def compute_metrics(pred) -> dict[str, float]:
        generated = torch.as_tensor(pred.predictions)[:, prompt_len : prompt_len + N_DIGITS]
        return {"exact_match": (generated == eval_set.answers.flip(-1)).all(-1).float().mean().item()}

    args = Seq2SeqTrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=200, per_device_train_batch_size=32, learning_rate=3e-3,
        eval_strategy="steps", eval_steps=50, per_device_eval_batch_size=64, predict_with_generate=True,
        logging_steps=50, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    hybrid = hf_dsinfer.HybridEngineCallback(inference_config={"max_out_tokens": 32, "max_batch_size": 64})
    trainer = Seq2SeqTrainer(
        model=model, args=args, train_dataset=ReverseTrain(4096, seed=0), eval_dataset=eval_set,
        compute_metrics=compute_metrics,
    )  # fmt: skip
    hybrid.add_to(trainer)  # ahead of the logging integrations, so they see the hybrid/ keys too
    trainer.train()

    for entry in trainer.state.log_history:
        if "eval_exact_match" in entry:
            print(
                f"step {entry['step']}: exact match {entry['eval_exact_match']:.2f}, generate "
                f"{entry['hybrid/generate_ms']:.1f} ms, refresh {entry['hybrid/refresh_ms']:.1f} ms, "
                f"{entry['hybrid/tokens_per_s']:.0f} tokens/s"
            )
    print(hybrid.engine.stats)


if __name__ == "__main__":
    main()
