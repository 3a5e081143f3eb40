"""``generate_batch`` (transformers' continuous-batching entry point) served by the Hybrid Engine.

TRL's ``use_transformers_continuous_batching=True`` calls ``model.generate_batch(prompt_ids, generation_config=...,
continuous_batching_config=..., progress_bar=...)`` on lists of token ids and reads ``generated_tokens`` from the
returned ``{request_id: GenerationOutput}``. The engine's inference copy runs it with continuous batching over a
paged KV cache (:mod:`hf_dsinfer.serving`): requests join and leave between steps, and the ``num_generations``
completions of one prompt share its KV blocks, so the prompt is prefilled once. The inference weights are the
engine's persistent buffers, refreshed in place by ``eval()`` as for ``generate``; KV blocks kept from an earlier
call are forgotten at each call (they were computed with older weights).

With tensor parallelism (``inference_tp_size > 1``), or an architecture the paged engine cannot serve exactly, the
prompts are left-padded into batches of at most ``max_batch_size`` rows and run through the engine's ``generate``
(:mod:`hf_dsinfer.serving.padded`); the outputs have the same form and order either way.
"""

from __future__ import annotations

from typing import Any

from ..serving.hf_api import ENGINE_ATTR, run_generate_batch
from ..serving.padded import padded_generate_batch
from ..serving.runner import unsupported_reason


def generate_batch(
    engine: Any,
    inputs: list[list[int]],
    generation_config: Any = None,
    continuous_batching_config: Any = None,
    max_new_tokens: int | None = None,
    record_timestamps: bool = False,
    tokenizer: Any = None,
    **ignored: Any,
) -> dict[str, Any]:
    """Generate for each prompt of ``inputs`` (lists of token ids) with ``engine``; transformers' output format."""
    if not engine.in_inference:
        with engine.inference():  # refresh the inference weights from the training ones, as generate does
            return generate_batch(
                engine, inputs, generation_config, continuous_batching_config, max_new_tokens, record_timestamps,
                tokenizer,
            )
    tp = getattr(engine, "tp", None)  # inference_tp_size > 1: every rank of the group makes the same calls
    if not inputs and tp is None:
        return {}
    module = engine.module
    hf = engine.weights.hf_model
    config = generation_config if generation_config is not None else hf.generation_config
    if module is not None and tp is None and unsupported_reason(module) is None:
        module.generation_config = hf.generation_config  # the user's generation defaults, shared
        out = run_generate_batch(module, inputs, config, continuous_batching_config, record_timestamps, max_new_tokens,
                                 tokenizer)  # fmt: skip
        it = engine.stats.last
        if it is not None:
            it.generate_calls += 1
            it.samples += len(out)
            it.new_tokens += sum(len(o.generated_tokens) for o in out.values())
        if engine.release_inference_cache:
            getattr(module, ENGINE_ATTR).runner.cache.release()  # allocated again on the next call
        return out
    copies = int(getattr(config, "num_return_sequences", None) or 1)

    def chunk_starts(starts: list[int]) -> list[int]:
        if tp is None:
            return starts
        # a rank with fewer chunks joins the group's remaining calls with an empty one
        return starts + [len(inputs)] * (tp.max_count(len(starts), engine.device) - len(starts))

    return padded_generate_batch(
        engine.generate, inputs, config, rows=max(1, engine.config.max_batch_size // copies), device=engine.device,
        max_new_tokens=max_new_tokens, chunk_starts=chunk_starts,
    )  # fmt: skip
