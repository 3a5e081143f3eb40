"""The padded fallback of ``generate_batch``: left-padded static batches through ``generate``, transformers' outputs.

Used where the paged engine cannot serve a fused model exactly (ALiBi on the Triton kernels; see
:func:`~hf_dsinfer.serving.runner.unsupported_reason`) and by the Hybrid Engine's tensor-parallel copy: the prompts
are left-padded into batches of at most ``rows`` prompts and run through ``generate`` (hf_dsinfer's fast loop on the
static cache). Every row decodes until the longest one finishes, which wastes work on mixed lengths; the outputs are
transformers' all the same: ``req_<i>`` per prompt, ``num_return_sequences - 1`` children ``req_<i>__child#<j>``
before each parent, tokens up to and including the first EOS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def padded_generate_batch(
    generate: Callable[..., Any],
    inputs: list[list[int]],
    config: Any,
    *,
    rows: int,
    device: torch.device | str,
    max_new_tokens: int | None = None,
    chunk_starts: Callable[[list[int]], list[int]] | None = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Generate for each prompt of ``inputs`` with ``generate(input_ids=, attention_mask=, generation_config=)``.

    ``rows``: prompts per call (the caller divides its batch capacity by ``num_return_sequences``).
    ``chunk_starts``: maps the list of chunk starts to the list to run (tensor parallelism: every rank makes the same
    number of calls, a rank with fewer chunks adds empty ones). ``tokenizer``: passed to ``generate`` (stop strings).
    """
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

    copies = int(getattr(config, "num_return_sequences", None) or 1)
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
    pad = config.pad_token_id if config.pad_token_id is not None else (min(eos_ids) if eos_ids else 0)
    extra: dict[str, Any] = {"max_new_tokens": max_new_tokens} if max_new_tokens is not None else {}
    stop = None
    if tokenizer is not None:
        extra["tokenizer"] = tokenizer
        if getattr(config, "stop_strings", None):  # where a stop string ended a row (generate pads after it)
            from transformers.generation.stopping_criteria import StopStringCriteria

            stop = StopStringCriteria(tokenizer=tokenizer, stop_strings=config.stop_strings)
    starts = list(range(0, len(inputs), max(1, rows)))
    if chunk_starts is not None:
        starts = chunk_starts(starts)
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
        out = generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config, **extra)
        seqs = (out if isinstance(out, torch.Tensor) else out.sequences)[:, width:].tolist()  # [B * copies, N]
        for i, prompt in enumerate(chunk):
            request = f"req_{start + i}"
            names = [f"{request}__child#{j}" for j in range(copies - 1)] + [request]
            for j, name in enumerate(names):
                tokens = seqs[i * copies + j]
                end = next((k + 1 for k, t in enumerate(tokens) if t in eos_ids), len(tokens))
                if stop is not None:
                    hits = (k + 1 for k in range(end) if bool(stop(torch.tensor([prompt + tokens[: k + 1]]), None)))
                    end = next(hits, end)
                results[name] = GenerationOutput(
                    request_id=name, prompt_ids=list(prompt), generated_tokens=tokens[:end],
                    status=RequestStatus.FINISHED,
                )  # fmt: skip
    return results
