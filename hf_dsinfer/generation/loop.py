"""The fast decoding loop: runs inside transformers' ``generate`` as its ``custom_generate`` callable.

transformers does all the preparation (generation config, special tokens, attention mask, position ids,
``num_return_sequences`` expansion, processors, criteria, the streamer's prompt) and hands over to
:func:`decoding_loop`, which prefills through the injected model's forward and then runs
:class:`~hf_dsinfer.generation.decode.DecodeStep` (eagerly, or replayed as CUDA graphs) with the processors of a
:class:`~hf_dsinfer.generation.processors.DecodePlan`. Requests the plan cannot express are declined
(:class:`FastLoopDeclined`, before anything is emitted) and rerun through transformers' public ``generate`` on the
same model (one warning per reason); the loop never calls ``GenerationMixin``'s private methods.

Stop checks need the host; with no streamer or host-side criteria they run every few steps on CUDA, and steps taken
past the true end are undone (tokens trimmed, cache lengths rolled back), so the output equals transformers'.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation import GenerateDecoderOnlyOutput

from .. import hf_compat
from ..log import warn_once
from ..modules.quant_linear import activation_dtype
from .processors import DecodePlan, StepProcessor, plan_decoding
from .speculative import lookup_applies, prompt_lookup_loop
from .stats import StepTimer

# model kwargs transformers prepares for a decoder-only model that the fast loop understands
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "past_key_values", "cache", "use_cache", "logits_to_keep",
                       "cache_position", "return_dict"}  # fmt: skip
_SYNC_EVERY_CUDA = 8  # decode steps between stop checks when nothing else needs the host
SHARE_PREFILL = True  # prefill each distinct prompt row once and copy its KV into its repeats (tests turn it off)


@dataclass
class CallContext:
    """One ``generate`` call's state shared by the override and the loop (transformers does not pass it on)."""

    state: Any  # GenerationState (api.py)
    timer: StepTimer
    streamer: Any = None
    path: str = "fast"
    new_tokens: int = 0
    batch: int = 0
    draft: Any = None  # a fused assistant_model whose proposals the loop verifies (generation/speculative.py)
    prompt_tokens: int = 0  # real (unpadded) prompt tokens of all rows, as ServingStats counts them
    prefill_tokens: int = 0  # the ones the prefill computed (distinct rows only when repeats share a prefill)
    notes: list[str] = field(default_factory=list)


class FastLoopDeclined(Exception):
    """Raised by :func:`decoding_loop` before it emits anything when a request needs transformers' loop."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


CURRENT_CALL: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar("hf_dsinfer_call", default=None)


def warn_fallback(reason: str) -> None:
    """One warning per reason: this kind of request runs on transformers' loop."""
    warn_once(f"hf_dsinfer generate: {reason} is not covered by the fast loop; using transformers' loop.")


def check_capacity(prompt_len: int, max_new: int, max_out_tokens: int) -> None:
    """Raise ``ValueError`` naming both numbers and the config key when the request cannot fit the KV cache."""
    if prompt_len + max_new > max_out_tokens:
        raise ValueError(
            f"This request needs {prompt_len + max_new} KV-cache slots (prompt length {prompt_len} + max_new_tokens "
            f"{max_new}) but max_out_tokens={max_out_tokens}. Raise max_out_tokens in the inference config "
            "(InferenceConfig.max_out_tokens, which counts prompt plus generated tokens) or shorten the request."
        )


def _unsupported(generation_config, model_kwargs: dict[str, Any]) -> str | None:
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag, False):
            return flag
    extra = sorted(k for k, v in model_kwargs.items() if k not in _KNOWN_MODEL_KWARGS and v is not None)
    if extra:
        return f"model inputs {extra}"
    past = hf_compat.pop_cache(dict(model_kwargs), "generate")
    if past is not None and hasattr(past, "get_seq_length") and past.get_seq_length() > 0:
        return "a filled cache"
    return None


def decoding_loop(
    self,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    **model_kwargs: Any,
):
    """``generate``'s decoding for greedy search and sampling on an injected model (``custom_generate``)."""
    call = CURRENT_CALL.get()
    if call is None:
        raise RuntimeError("decoding_loop runs only inside hf_dsinfer's generate")
    streamer = streamer if streamer is not None else call.streamer
    reason = _unsupported(generation_config, model_kwargs)
    plan: DecodePlan | str = reason or plan_decoding(logits_processor, stopping_criteria, generation_config.do_sample)
    if isinstance(plan, str):
        raise FastLoopDeclined(plan)
    if streamer is not None:
        streamer.put(input_ids.cpu())  # what transformers' generate does before its loop (the call holds the streamer)
    if call.draft is not None and not lookup_applies(plan, input_ids.shape[0], generation_config, call.draft):
        raise FastLoopDeclined("assisted decoding that the fast loop cannot verify exactly")
    if lookup_applies(plan, input_ids.shape[0], generation_config, call.draft):
        return _lookup(self, call, plan, input_ids, generation_config, streamer, model_kwargs)
    return _fast(self, call, plan, input_ids, generation_config, streamer, model_kwargs)


def _lookup(self, call: CallContext, plan: DecodePlan, input_ids, generation_config, streamer, model_kwargs):
    """Greedy with prompt-lookup proposals verified on the fused layers (:mod:`.speculative`): plain greedy's tokens."""
    prompt_len = input_ids.shape[1]
    n_new = max(plan.max_length - prompt_len, 1)
    check_capacity(prompt_len, n_new, call.state.runtime.cache.max_tokens)
    call.path = "fast+draft" if call.draft is not None else "fast+lookup"
    sequences, handle, generated = prompt_lookup_loop(
        self, call, plan, input_ids, generation_config, streamer, model_kwargs, n_new, draft=call.draft
    )
    call.batch, call.new_tokens = 1, generated
    if not generation_config.return_dict_in_generate:
        return sequences
    return hf_compat.make_output(GenerateDecoderOnlyOutput, sequences=sequences, scores=None, logits=None,
                                 attentions=None, hidden_states=None, cache=handle)  # fmt: skip


def _distinct_rows(input_ids: torch.Tensor, mask: Any, positions: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first [U], inverse [B])`` when some rows repeat another (GRPO's ``repeat_interleave``d prompts,
    ``num_return_sequences``): ``first[u]`` is the first row of distinct prompt ``u``, ``inverse[b]`` the distinct
    prompt of row ``b``. None when every row is distinct. One host sync."""
    batch = input_ids.shape[0]
    if batch < 2:
        return None
    key = [input_ids] + [t.to(input_ids.dtype) for t in (mask, positions) if isinstance(t, torch.Tensor)]
    _, inverse = torch.unique(torch.cat(key, dim=1), dim=0, return_inverse=True)  # [B]
    count = int(inverse.max()) + 1
    if count == batch:
        return None
    rows = torch.arange(batch, device=inverse.device)
    first = torch.full((count,), batch, dtype=torch.long, device=inverse.device)
    first.scatter_reduce_(0, inverse, rows, "amin")  # [U]: the first row of each distinct prompt
    _, order = torch.sort(first)  # distinct prompts in the order they first appear
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(count, device=order.device))
    return first[order], rank[inverse]


def _spread_rows(cache: Any, inverse: torch.Tensor) -> None:
    """Row ``b`` of the static cache becomes row ``inverse[b]`` (rows ``[0, U)`` hold the distinct prompts), in the
    prompt's ``padded_len`` slots only: later slots are written by the decode steps before they are attended, so
    copying whole rows (``StaticKVCache.reorder``, ``max_out_tokens`` slots each) moved dead bytes (GRPO shape on
    SmolLM2: 60 copies of ``[32, 3, 89, 64]`` per call, where the prompts fill 41 slots)."""
    n, width = inverse.shape[0], cache.padded_len
    index = inverse.to(cache.lengths.device)
    for buf in (*cache.keys, *cache.values):  # each [Bmax, Hk, S, D]
        buf[:n, :, :width] = buf[:, :, :width].index_select(0, index)  # a gathered copy first: rows overlap
    cache.lengths[:n] = cache.lengths.index_select(0, index)


def _prefill(self, call: CallContext, input_ids: torch.Tensor, mask: Any, positions: Any) -> tuple[torch.Tensor, Any]:
    """The prefill: fp32 logits of each row's last position ``[B, V]`` and the cache handle.

    Rows that repeat another are not computed: each distinct prompt is prefilled once and its KV rows are copied
    into its repeats in the static cache (rows are stored compactly from slot 0, so a copy of the row and its
    length is the whole state). Counts ``call.prompt_tokens`` / ``call.prefill_tokens`` as ServingStats does."""
    cache = call.state.runtime.cache
    batch, width = input_ids.shape
    real = mask.sum(dim=1) if isinstance(mask, torch.Tensor) and mask.shape == input_ids.shape else None  # [B]
    call.prompt_tokens = int(real.sum()) if real is not None else input_ids.numel()
    shared = _distinct_rows(input_ids, mask, positions) if SHARE_PREFILL else None
    if shared is not None:
        dtype = activation_dtype(self.get_input_embeddings())  # a quantized tied embedding stores integers
        cache.start(batch, input_ids.device, dtype)  # room for every row before the distinct ones are prefilled
        first, inverse = shared
        pick = (lambda t: t.index_select(0, first) if isinstance(t, torch.Tensor) else t)  # noqa: E731
        out = self(input_ids=pick(input_ids), attention_mask=pick(mask), position_ids=pick(positions),
                   use_cache=True, logits_to_keep=1, return_dict=True)  # fmt: skip
        if cache.allocated_rows >= batch:  # else the forward re-allocated the cache smaller: prefill every row
            logits = out.logits[:, -1].float().index_select(0, inverse)  # [B, V]
            _spread_rows(cache, inverse)  # rows [0, U) hold the distinct prompts: copy each into its repeats
            cache.batch = batch
            call.prefill_tokens = int(real.index_select(0, first).sum()) if real is not None else first.numel() * width
            return logits, hf_compat.output_cache(out)
    out = self(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
               return_dict=True)  # fmt: skip  (no cache: the injected forward starts a fresh sequence)
    call.prefill_tokens = call.prompt_tokens
    return out.logits[:, -1].float(), hf_compat.output_cache(out)


def _fast(self, call: CallContext, plan: DecodePlan, input_ids, generation_config, streamer, model_kwargs):
    state = call.state
    cache = state.runtime.cache
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    n_new = max(plan.max_length - prompt_len, 1)  # transformers always generates at least one token
    check_capacity(prompt_len, n_new, cache.max_tokens)
    return_dict = generation_config.return_dict_in_generate
    keep_scores = return_dict and generation_config.output_scores
    keep_logits = return_dict and generation_config.output_logits
    mask = model_kwargs.get("attention_mask")
    positions = model_kwargs.get("position_ids")

    generator = None
    if plan.do_sample:
        # Seeded from torch's global RNG, so torch.manual_seed(...) before generate reproduces the draws.
        seed = int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator(device=device).manual_seed(seed)

    decode = state.step
    if state.graphs is not None and device.type == "cuda":
        dtype = activation_dtype(self.get_input_embeddings())
        decode = state.graphs.prepare(batch, device, dtype)
        call.path = "fast+graphs"

    # -- prefill (the injected forward starts a fresh sequence in the static cache) --
    logits, handle = _prefill(self, call, input_ids, mask, positions)  # [B, V]
    proc = StepProcessor(plan, input_ids, logits.shape[-1], generator)

    seq = torch.empty(batch, prompt_len + n_new, dtype=torch.long, device=device)  # [B, P + N]
    seq[:, :prompt_len] = input_ids
    if positions is not None:
        next_pos = (positions[:, -1:].to(device=device, dtype=torch.long) + 1).expand(batch, 1).contiguous()
    else:
        next_pos = torch.full((batch, 1), prompt_len, dtype=torch.long, device=device)  # [B, 1]
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    alive = torch.ones(n_new, dtype=torch.bool, device=device)  # alive[i]: a row is unfinished after token i
    eos = plan.eos.to(device) if plan.eos is not None else None
    pad_id = hf_compat.pad_token_id(generation_config)
    pad = torch.tensor(pad_id, device=device) if pad_id is not None else None
    if eos is not None and pad is None:
        raise ValueError("generation needs pad_token_id when eos_token_id is set (finished rows are padded)")
    scores_out: list[torch.Tensor] = []
    logits_out: list[torch.Tensor] = []
    needs_host = streamer is not None or bool(plan.host_criteria)
    sync_every = 1 if needs_host or device.type != "cuda" else _SYNC_EVERY_CUDA

    # One decoding loop: the compiled CPU step guards its first step per bucket, not every step (direct_call.py).
    scope = decode.loop() if decode is state.step and decode is not None else contextlib.nullcontext()
    steps = 0
    with scope:
        for i in range(n_new):
            if i > 0:
                logits = decode(input_ids=tok[:, None], positions=next_pos)  # noqa: F821 - tok is set in step 0
                cache.padded_len += 1  # the host-side width; the step advanced the device lengths itself
                next_pos += 1
            if keep_logits:
                logits_out.append(logits.clone())
            # [B, V] what transformers' processors return; in place: this step's logits are not read again (kept ones
            # were cloned above)
            scores = proc.warp(proc.process(logits, i, owned=True))
            tok = proc.select(scores)  # [B]
            if keep_scores:
                scores_out.append(scores.clone())
            if eos is not None:
                tok = torch.where(unfinished, tok, pad)  # finished rows get padding, as in transformers
            seq[:, prompt_len + i] = tok
            proc.observe(tok)
            if eos is not None:
                unfinished &= ~torch.isin(tok, eos)
            for crit in plan.host_criteria:
                unfinished &= ~crit(seq[:, : prompt_len + i + 1], tuple(scores_out) if keep_scores else None).to(device)
            if streamer is not None:
                streamer.put(tok.cpu())
            alive[i] = unfinished.any()
            steps = i + 1
            call.timer.mark()
            if steps < n_new and steps % sync_every == 0 and not bool(alive[i]):
                break

    # Length as transformers would stop: after the first token at which every row was finished.
    dead = (~alive[:steps]).nonzero()
    length = int(dead[0, 0]) + 1 if dead.numel() else steps
    if length < steps:  # undo the steps taken past the end (deferred stop checks)
        extra = steps - length
        cache.lengths[:batch] -= extra
        cache.padded_len -= extra
    if streamer is not None:
        streamer.end()
    call.batch, call.new_tokens = batch, length
    sequences = seq[:, : prompt_len + length]
    if not return_dict:
        return sequences
    return hf_compat.make_output(
        GenerateDecoderOnlyOutput,
        sequences=sequences,
        scores=tuple(scores_out[:length]) if keep_scores else None,
        logits=tuple(logits_out[:length]) if keep_logits else None,
        attentions=None,
        hidden_states=None,
        cache=handle,
    )
