"""HybridEngineCallback in transformers' Trainer (tiny llama + peft LoRA, CPU, deterministic).

* A run that generates inside every training step and switches >100 times ends with training weights and a loss
  curve bit-identical to the same run without the callback; the engine's timings appear in ``log_history``.
* ``Seq2SeqTrainer(predict_with_generate=True)`` evaluation during training generates through the engine (one
  switch for the whole evaluation) with tokens equal to HF generate on the merged final weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import PAD, build_tiny
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainerCallback, TrainingArguments

from hf_dsinfer import HybridEngineCallback

STEPS = 7
SWITCHES_PER_STEP = 14  # + 1 for the in-step generate: 7 * 15 = 105 switches


pytestmark = pytest.mark.usefixtures("one_thread")


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int, width: int, seed: int, labels: bool = True):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, 500, (n, width), generator=g)
        self.labels = labels

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        item = {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}
        if self.labels:
            item["labels"] = self.ids[i].clone()
        return item


def _model() -> torch.nn.Module:
    model = build_tiny("llama", seed=0)
    model.generation_config.pad_token_id = PAD
    return get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "up_proj"])
    )


class _GenerateInStep(Trainer):
    """RL-style: generate from the batch's prompts inside every training step, then the usual loss."""

    generated: list[torch.Tensor]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with torch.random.fork_rng(devices=[]):  # HF generate in train mode would draw dropout masks: keep RNG equal
            out = model.generate(
                input_ids=inputs["input_ids"][:, :4],
                attention_mask=inputs["attention_mask"][:, :4],
                max_new_tokens=3,
                do_sample=False,
            )
        self.generated.append(out)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class _Switcher(TrainerCallback):
    """Extra eval()/train() round trips of the engine after every step (no generation, only refreshes)."""

    def __init__(self, hybrid: HybridEngineCallback):
        self.hybrid = hybrid

    def on_step_end(self, args, state, control, **kwargs):
        for _ in range(SWITCHES_PER_STEP):
            self.hybrid.engine.eval()
            self.hybrid.engine.train()


def _args(tmp_path, **kw) -> dict:
    return dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    ) | {"max_steps": STEPS, **kw}


def _train(tmp_path, with_callback: bool):
    model = _model()
    callbacks = []
    hybrid = None
    if with_callback:
        hybrid = HybridEngineCallback(inference_config={"max_out_tokens": 32})
        callbacks = [hybrid, _Switcher(hybrid)]
    trainer = _GenerateInStep(
        model=model, args=TrainingArguments(**_args(tmp_path)), train_dataset=_Data(32, 12, 0), callbacks=callbacks
    )
    trainer.generated = []
    trainer.train()
    return model, trainer, hybrid


def test_training_with_callback_is_bit_identical_and_logs_stats(tmp_path):
    ref_model, ref_trainer, _ = _train(tmp_path / "ref", with_callback=False)
    model, trainer, hybrid = _train(tmp_path / "hybrid", with_callback=True)

    ref_losses = [e["loss"] for e in ref_trainer.state.log_history if "loss" in e]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == STEPS and losses == ref_losses
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ref_params[name]), f"{name} differs from the run without the callback"

    stats = hybrid.engine.stats
    assert stats.count >= 100  # eval() calls: one per in-step generate plus the extra switches
    assert sum(it.generate_calls for it in stats.iterations) == STEPS  # every in-step generate ran on the engine
    assert [g.shape for g in trainer.generated] == [g.shape for g in ref_trainer.generated]
    step_logs = [e for e in trainer.state.log_history if "loss" in e]
    for key in ("hybrid/generate_ms", "hybrid/refresh_ms", "hybrid/tokens_per_s", "hybrid/train_ms", "hybrid/e2e_ms"):
        assert all(key in e for e in step_logs[1:]), f"{key} missing from the Trainer logs"
    assert step_logs[-1]["hybrid/tokens_per_s"] > 0
    # on_train_end gave generate back to the model.
    assert "generate" not in vars(model) and "generate" not in vars(model.get_base_model())
    assert not hybrid.engine.in_inference


def test_seq2seq_predict_with_generate_runs_on_the_engine(tmp_path):
    model = _model()
    model.generation_config.max_new_tokens = 5
    model.generation_config.do_sample = False
    predictions: list = []

    def compute_metrics(pred):
        predictions.append(torch.as_tensor(pred.predictions))
        return {"n": float(len(pred.predictions))}

    hybrid = HybridEngineCallback(inference_config={"max_out_tokens": 32})
    args = Seq2SeqTrainingArguments(
        **_args(tmp_path, max_steps=3, eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4),
        predict_with_generate=True,
    )
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=_Data(16, 12, 0),
        eval_dataset=_Data(4, 6, 1),
        compute_metrics=compute_metrics,
        callbacks=[hybrid],
    )
    trainer.train()
    assert len(predictions) == 1
    eval_logs = [e for e in trainer.state.log_history if "eval_n" in e]
    assert eval_logs and "hybrid/generate_ms" in eval_logs[0]
    assert hybrid.engine.stats.count == 1  # one switch (one refresh) for the whole evaluation
    assert hybrid.engine.stats.iterations[0].generate_calls == 1

    prompts = _Data(4, 6, 1).ids
    merged = copy.deepcopy(model).merge_and_unload().eval()
    expected = merged.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts))
    got = predictions[0][:, : expected.shape[1]]
    assert torch.equal(got, expected)
