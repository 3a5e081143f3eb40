"""``generate_batch`` (transformers' continuous-batching entry point) served by the Hybrid Engine.

TRL's ``use_transformers_continuous_batching=True`` calls ``model.generate_batch(prompt_ids, generation_config=...,
continuous_batching_config=..., progress_bar=...)`` on lists of token ids and reads ``generated_tokens`` from the
returned ``{request_id: GenerationOutput}``. The engine's inference copy has a static KV cache, not transformers'
paged one, so the prompts are left-padded into batches of at most ``max_batch_size`` rows and run through the
engine's ``generate`` (the fast loop); the outputs come back in transformers' form and order: ``req_<i>`` per prompt,
``num_return_sequences - 1`` children ``req_<i>__child#<j>`` before each parent, tokens up to and including the first
EOS. The continuous-batching settings (block sizes, scheduler) have no meaning for a static cache and are ignored.
"""

from __future__ import annotations

from typing import Any

import torch


def generate_batch(
    engine: Any,
    inputs: list[list[int]],
    generation_config: Any = None,
    max_new_tokens: int | None = None,
    **ignored: Any,
) -> dict[str, Any]:
    """Generate for each prompt of ``inputs`` (lists of token ids) with ``engine``; transformers' output format."""
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

    tp = getattr(engine, "tp", None)  # inference_tp_size > 1: every rank of the group makes the same calls
    if not inputs and tp is None:
        return {}
    module = engine.module if engine.module is not None else engine.weights.hf_model
    config = generation_config if generation_config is not None else module.generation_config
    copies = int(getattr(config, "num_return_sequences", None) or 1)
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
    pad = config.pad_token_id if config.pad_token_id is not None else (min(eos_ids) if eos_ids else 0)
    device = engine.device
    rows = max(1, engine.config.max_batch_size // copies)  # prompts per call, so expanded rows fit the KV cache
    extra: dict[str, Any] = {"max_new_tokens": max_new_tokens} if max_new_tokens is not None else {}

    starts = list(range(0, len(inputs), rows))
    if tp is not None:  # a rank with fewer chunks joins the group's remaining calls with an empty one
        starts += [len(inputs)] * (tp.max_count(len(starts), device) - len(starts))
    results: dict[str, Any] = {}
    for start in starts:
        chunk = inputs[start : start + rows]
        width = max((len(p) for p in chunk), default=1)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # [B, P] left-padded
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, prompt in enumerate(chunk):
            if prompt:
                ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
                mask[i, width - len(prompt) :] = 1
        out = engine.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config, **extra
        )
        seqs = (out if isinstance(out, torch.Tensor) else out.sequences)[:, width:].tolist()  # [B * copies, N]
        for i, prompt in enumerate(chunk):
            request = f"req_{start + i}"
            names = [f"{request}__child#{j}" for j in range(copies - 1)] + [request]
            for j, name in enumerate(names):
                tokens = seqs[i * copies + j]
                end = next((k + 1 for k, t in enumerate(tokens) if t in eos_ids), len(tokens))
                results[name] = GenerationOutput(
                    request_id=name, prompt_ids=list(prompt), generated_tokens=tokens[:end],
                    status=RequestStatus.FINISHED,
                )  # fmt: skip
    return results
