"""Speculative decoding on the fused layers, greedy: prompt lookup (``generate(prompt_lookup_num_tokens=k)``) and a
fused draft model (``generate(assistant_model=draft)``).

Each step proposes up to ``k`` tokens, by matching the last n-gram of the sequence earlier in it (the prompt and the
tokens generated so far) or by the draft model's greedy continuation (:class:`DraftProposer`, on the draft's own
static cache), then verifies them in one forward of ``1 + k`` tokens over the static cache: the greedy
token at every position is computed exactly as plain greedy would, the proposal's matching prefix is kept, and the
cache is rolled back over the rest (``InjectedCache.crop``). The output is plain greedy's, token for token; only the
number of forwards changes. Copy-heavy requests (edit, repeat or summarize a passage, code) accept several tokens per
forward.

Served here: greedy, one row, without a repetition penalty (its seen-token state would have to roll back too) and
without per-step scores or logits in the output. Other requests with ``prompt_lookup_num_tokens`` run the plain fast
loop when greedy (the same tokens), or transformers' assisted loop when sampling (decided in ``api._route``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .. import hf_compat
from .processors import DecodePlan, StepProcessor


def lookup_applies(plan: DecodePlan, batch: int, generation_config: Any, draft: Any = None) -> bool:
    """Whether :func:`prompt_lookup_loop` can serve this request exactly (with ``draft``'s proposals when given)."""
    k = getattr(generation_config, "prompt_lookup_num_tokens", None)
    return (
        (bool(k) or draft is not None)
        and batch == 1
        and not plan.do_sample
        and plan.repetition_penalty is None
        and not (generation_config.return_dict_in_generate and
                 (generation_config.output_scores or generation_config.output_logits))
    )  # fmt: skip


def propose(seq: list[int], k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last n-gram (the longest n
    first, ``max_ngram`` down to ``min_ngram``); ``[]`` when none occurs."""
    n_tokens = len(seq)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        tail = seq[-n:]
        for start in range(n_tokens - n - 1, -1, -1):  # latest match first: the most recent context repeats best
            if seq[start : start + n] == tail:
                follow = seq[start + n : start + n + k]
                if follow:
                    return follow
    return []


class DraftProposer:
    """Proposals from a fused draft model: its greedy continuation of the sequence, computed on its own static cache,
    which is kept as a prefix of the sequence between steps (rolled back with ``crop`` after each verification)."""

    def __init__(self, draft: Any, k: int):
        self.draft, self.k = draft, k
        self.handle: Any = None
        self.start = 0  # sequence length when the last proposals were made
        self.cached = 0  # tokens of the sequence the draft's cache holds

    def _next(self, ids: list[int], device: torch.device) -> int:
        kw = {} if self.handle is None else {hf_compat.cache_kwarg(): self.handle}  # none: a fresh sequence
        out = self.draft(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1,
                         return_dict=True, **kw)  # fmt: skip
        self.handle = hf_compat.output_cache(out)
        self.cached += len(ids)
        return int(out.logits[0, -1].argmax())

    def __call__(self, seq: list[int], k: int, device: torch.device) -> list[int]:
        self.start = len(seq)
        if k <= 0:
            return []
        cands = [self._next(seq[self.cached :], device)]  # catch up with the tokens the draft has not seen
        while len(cands) < min(k, self.k):
            cands.append(self._next(cands[-1:], device))
        return cands

    def accepted(self, n_cands: int, n_accepted: int) -> None:
        """Keep the sequence before the proposals and the accepted proposals the draft has cached."""
        if self.handle is None:
            return
        keep = self.start + min(n_accepted, max(n_cands - 1, 0))
        if self.cached > keep:
            self.handle.crop(-(self.cached - keep))
            self.cached = keep


def prompt_lookup_loop(
    model: Any,
    call: Any,
    plan: DecodePlan,
    input_ids: torch.Tensor,  # [1, P]
    generation_config: Any,
    streamer: Any,
    model_kwargs: dict[str, Any],
    n_new: int,
    draft: Any = None,
) -> tuple[torch.Tensor, Any, int]:
    """Greedy decoding with prompt-lookup (or ``draft``) proposals; ``(sequences [1, P + N], cache handle, tokens
    generated)``."""
    if draft is not None:
        k_max = int(getattr(generation_config, "num_assistant_tokens", None) or 5)
        proposer: Any = DraftProposer(draft, k_max)
    else:
        k_max = int(generation_config.prompt_lookup_num_tokens)
        proposer = None
    max_ngram = int(getattr(generation_config, "max_matching_ngram_size", None) or 2)
    device = input_ids.device
    step = call.state.step if call.state.step is not None and call.state.step.compiled is not None else None
    prompt_len = input_ids.shape[1]
    positions = model_kwargs.get("position_ids")
    start = int(positions[0, -1]) + 1 if positions is not None else prompt_len  # position of the first new token
    out = model(input_ids=input_ids, attention_mask=model_kwargs.get("attention_mask"), position_ids=positions,
                use_cache=True, logits_to_keep=1, return_dict=True)  # fmt: skip
    handle = hf_compat.output_cache(out)
    proc = StepProcessor(plan, input_ids, out.logits.shape[-1], None)
    eos = set(plan.eos.tolist()) if plan.eos is not None else set()
    seq = input_ids[0].tolist()
    tok = int(proc.select(proc.process(out.logits[:, -1].float(), 0))[0])
    del out
    # One decoding loop: the compiled steps guard their first call per shape, not every call (direct_call.py).
    with step.loop() if step is not None else contextlib.nullcontext():
        generated = 0
        while True:
            seq.append(tok)
            generated += 1
            call.timer.mark()
            if streamer is not None:
                streamer.put(torch.tensor([tok]))
            if _stops(plan, seq, tok, eos, generated, n_new, device):
                break
            # propose, then verify [tok, c_1..c_k] in one forward: logits j give the greedy token after c_j
            room = min(k_max, n_new - generated - 1)
            cands = proposer(seq, room, device) if proposer is not None else propose(seq, room, max_ngram)
            logits, fed = _verify(model, step, handle, [tok, *cands], k_max, start + generated - 1, device)  # [fed, V]
            picks = [int(proc.select(proc.process(logits[j : j + 1], generated + j))[0]) for j in range(len(cands) + 1)]
            accepted = 0
            while accepted < len(cands) and picks[accepted] == cands[accepted]:
                accepted += 1
            handle.crop(-(fed - 1 - accepted))  # drop the cache entries of the rejected proposals (and of any filler)
            if proposer is not None:
                proposer.accepted(len(cands), accepted)
            for j in range(accepted):  # the accepted proposals are greedy's tokens; emit them one by one (stop checks)
                seq.append(cands[j])
                generated += 1
                call.timer.mark()
                if streamer is not None:
                    streamer.put(torch.tensor([cands[j]]))
                if _stops(plan, seq, cands[j], eos, generated, n_new, device):
                    # the cache holds tok, c_1..c_accepted; plain greedy's would end before the last token emitted
                    # (c_j+1)
                    handle.crop(-(accepted - j))
                    return _done(seq, handle, generated, streamer, device)
            tok = picks[accepted]
    return _done(seq, handle, generated, streamer, device)


def _verify(
    model: Any, step: Any, handle: Any, tokens: list[int], k_max: int, first_pos: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """Run ``tokens`` (the last token and its proposals) at positions ``first_pos...`` over the static cache; returns
    (fp32 logits ``[fed, V]``, tokens fed). The cache advances by ``fed``; the caller crops what it rejects.

    On CPU with the compiled step (``cpu_compile``), one graph per shape: proposals are padded to ``1 + k_max``
    tokens (the fillers only follow the real ones, so causal attention keeps them out of the real tokens' logits) and
    a lone token runs the compiled decode step. Otherwise, and where the padded step would not fit the cache, the
    model's own forward.
    """
    cache = step.cache if step is not None else None
    fed = 1 if len(tokens) == 1 else 1 + k_max
    ids = torch.tensor([tokens + tokens[-1:] * (fed - len(tokens))], device=device)  # [1, fed]
    compiled = None
    if cache is not None and cache.padded_len + fed <= cache.max_tokens:
        compiled = step.compiled if fed == 1 else step.verifier(fed, ids)
    if compiled is not None and compiled.applies(ids):
        pos = torch.arange(fed, device=device)[None] + first_pos  # [1, fed]
        logits = compiled(input_ids=ids, positions=pos)  # [1, V] (decode) or [1, fed, V]
        cache.padded_len += fed  # the step advanced the device lengths itself
        return logits.reshape(fed, -1), fed
    ids = ids[:, : len(tokens)]  # the forward takes any length: no fillers
    pos = torch.arange(ids.shape[1], device=device)[None] + first_pos
    logits = model(input_ids=ids, position_ids=pos, use_cache=True, return_dict=True,
                   **{hf_compat.cache_kwarg(): handle}).logits[0].float()  # fmt: skip  [1 + k, V]
    return logits, ids.shape[1]


def _stops(plan: DecodePlan, seq: list[int], tok: int, eos: set[int], generated: int, n_new: int, device) -> bool:
    if tok in eos or generated >= n_new:
        return True
    if plan.host_criteria:
        ids = torch.tensor([seq], device=device)
        return any(bool(crit(ids, None).any()) for crit in plan.host_criteria)
    return False


def _done(seq: list[int], handle: Any, generated: int, streamer: Any, device) -> tuple[torch.Tensor, Any, int]:
    if streamer is not None:
        streamer.end()
    return torch.tensor([seq], device=device), handle, generated
