"""The Hybrid Engine's rollout defaults, resolved on CPU: CUDA graphs on for a CUDA copy unless set to False, cache
rows and graph buckets sized for the Trainer's rollout batch (at most 256), and TRL's ``disable_compile=True`` leaving
the engine's own decode step on."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from tiny_models import PAD, build_tiny, left_pad, prompts

from hf_dsinfer.generation.api import GEN_ATTR
from hf_dsinfer.generation.graph_runner import batch_buckets
from hf_dsinfer.hybrid import HybridEngine, HybridEngineCallback
from hf_dsinfer.hybrid.config import MAX_ROLLOUT_ROWS, resolve_inference_config, rollout_batch_rows


@pytest.mark.parametrize(
    ("given", "device_type", "expected"),
    [
        (None, "cuda", True),  # unset: on for CUDA
        (None, "cpu", False),  # unset: off elsewhere (no CUDA graphs on CPU)
        ({"enable_cuda_graph": "auto"}, "cuda", True),
        ({"enable_cuda_graph": "AUTO"}, "cpu", False),
        ({"enable_cuda_graph": False}, "cuda", False),  # an explicit False wins
        ({"enable_cuda_graph": True}, "cpu", True),  # an explicit True is kept (the loop only graphs on CUDA)
    ],
)
def test_enable_cuda_graph_auto(given, device_type, expected):
    config = resolve_inference_config(given, {}, torch.float32, device_type)
    assert config.enable_cuda_graph is expected
    kwargs_config = resolve_inference_config(None, dict(given or {}), torch.float32, device_type)  # as **fields
    assert kwargs_config.enable_cuda_graph is expected


def test_max_batch_size_follows_the_rollout_batch():
    config = resolve_inference_config(None, {}, torch.float32, "cuda", rollout_rows=64)
    assert config.max_batch_size == 64 and batch_buckets(config.cuda_graph_batch_sizes, 64)[-1] == 64
    assert resolve_inference_config(None, {}, torch.float32, "cuda", rollout_rows=4).max_batch_size == 8  # default
    explicit = resolve_inference_config({"max_batch_size": 16}, {}, torch.float32, "cuda", rollout_rows=64)
    assert explicit.max_batch_size == 16, "an explicit max_batch_size wins"
    assert resolve_inference_config(None, {"max_batch_size": 12}, torch.float32, "cuda", 64).max_batch_size == 12


def test_rollout_batch_rows_from_trainer_args():
    assert rollout_batch_rows(SimpleNamespace(generation_batch_size=96, per_device_train_batch_size=8)) == 96
    assert rollout_batch_rows(SimpleNamespace(generation_batch_size=4096)) == MAX_ROLLOUT_ROWS == 256
    assert rollout_batch_rows(SimpleNamespace(per_device_train_batch_size=8, per_device_eval_batch_size=24)) == 24
    assert rollout_batch_rows(SimpleNamespace()) is None
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(output_dir="unused", per_device_train_batch_size=8, num_generations=8,
                          steps_per_generation=4, report_to=[], use_cpu=True)  # fmt: skip
    assert rollout_batch_rows(args) == args.generation_batch_size == 32


def test_callback_sizes_the_engine_from_the_trainer():
    model = build_tiny("llama", seed=0)
    cb = HybridEngineCallback(inference_config={"max_out_tokens": 64, "cpu_compile": False})
    control = SimpleNamespace(should_evaluate=False)
    cb.on_train_begin(SimpleNamespace(generation_batch_size=48), None, control, model=model)
    try:
        assert cb.engine.config.max_batch_size == 48
        assert cb.engine.config.enable_cuda_graph is False  # a CPU copy
    finally:
        cb.on_train_end(None, None, control)
    cb2 = HybridEngineCallback(inference_config={"max_out_tokens": 64, "cpu_compile": False, "max_batch_size": 8})
    cb2.on_train_begin(SimpleNamespace(generation_batch_size=48), None, control, model=model)
    assert cb2.engine.config.max_batch_size == 8, "the user's max_batch_size wins"
    cb2.on_train_end(None, None, control)


class _SpyStep:
    """Stands in for the compiled CPU decode step: counts the steps it serves (runs them eagerly)."""

    def __init__(self, step):
        self.step, self.calls, self.failed = step, 0, False

    def applies(self, input_ids: torch.Tensor) -> bool:
        return True

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.step.eager(input_ids, positions)

    def loop(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the decoding loop's scope (CompiledCPUDecode.loop): nothing to skip here


def test_disable_compile_keeps_the_engines_decode_step():
    model = build_tiny("llama", seed=0)
    he = HybridEngine(model, inference_config={"max_out_tokens": 64, "cpu_compile": False})
    step = getattr(he.module, GEN_ATTR).step
    step.compiled = spy = _SpyStep(step)
    ids, mask = left_pad(prompts((5, 9)))
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    out = he.generate(**gen, disable_compile=True)  # what TRL's GenerationConfig sets
    assert spy.calls == 5, "every decode step after the prefill ran on the engine's own step"
    assert step.compiled is spy
    assert torch.equal(out, model.generate(**gen))
