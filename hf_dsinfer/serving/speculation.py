"""Speculative decoding inside the serving engine: n-gram (prompt lookup) proposals verified in the ragged step.

vLLM's ``speculative_config`` keys: ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": m,
"prompt_lookup_min": n}``. Before each step, a decoding request that may speculate gets up to ``k`` proposed tokens:
what followed the latest earlier occurrence of its last n-gram (``n`` from ``m`` down to ``n``; the proposal logic
of ``generate``'s prompt lookup, :func:`hf_dsinfer.generation.speculative.propose`). The step runs
``[last token, p1..pk]`` for it (positions ``L-1 .. L-1+k`` of the paged cache) and the LM head on all those
positions; the target's argmax at position ``j`` is the plain greedy token after ``p1..pj``, so the longest prefix
where it equals the proposal is accepted, plus the target's own next token. The cache keeps the accepted positions
only (``num_computed`` advances by ``1 + accepted``); the KV written for rejected proposals lies beyond it, in the
request's private blocks, and is overwritten by later steps. Greedy output is plain decoding's, token for token.

Who speculates in this version: plain greedy requests (no penalties, logit_bias, constraint, processors or
criteria), once ``min_tokens`` are generated, without log-probs and without a LoRA adapter, whose prompt blocks are
all computed (so a block registered for prefix sharing never holds proposal KV: the first written block is made
private by copy-on-write). The others run as without speculation in the same step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from ..generation.speculative import propose
from .requests import Sequence

#: vLLM's speculative_config keys this engine knows (the draft-model keys are refused with a clear error).
KNOWN_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """An n-gram speculation setting: ``k`` proposed tokens per step at most, n-grams of ``min_ngram..max_ngram``."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"

    @classmethod
    def parse(cls, config: Any) -> SpeculativeConfig | None:
        """From vLLM's dict (or its JSON text, or a :class:`SpeculativeConfig`); None stays None (no speculation).

        ``prompt_lookup_max`` / ``prompt_lookup_min`` default to each other, both 5 when neither is given (vLLM's
        defaults). Unknown keys, methods and bad values raise ``ValueError`` naming them.
        """
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): pass e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'') from e
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config={config!r}: pass a dict (JSON object) with the keys {KNOWN_KEYS}")
        unknown = sorted(set(config) - set(KNOWN_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; this engine knows {list(KNOWN_KEYS)} "
                             "(method 'ngram' only: a draft model is not served yet)")  # fmt: skip
        method = config.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config method={method!r}: only {list(METHODS)} is served "
                             "(prompt lookup; a draft model or EAGLE/MTP heads are not)")  # fmt: skip
        k = config.get("num_speculative_tokens")
        hi, lo = config.get("prompt_lookup_max"), config.get("prompt_lookup_min")
        if hi is None and lo is None:
            hi = lo = 5
        hi = lo if hi is None else hi
        lo = hi if lo is None else lo
        for name, value in (("num_speculative_tokens", k), ("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name}={value!r}: pass a positive integer")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min={lo} > prompt_lookup_max={hi}: min must be <= max")
        return cls(num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo, method=method)


def may_speculate(seq: Sequence) -> bool:
    """Whether ``seq`` is decoding and its next tokens are verifiable by plain argmax (see the module docstring)."""
    p = seq.params
    return (
        seq.remaining == 1
        and seq.registered == len(seq.block_keys)  # its keyed (shareable) blocks are all computed and registered
        and seq.num_computed >= seq.cacheable_len
        and p.greedy
        and seq.generated >= p.min_tokens
        and p.logprobs is None
        and p.prompt_logprobs is None
        and seq.lora is None
    )


class NgramSpeculator:
    """Proposals per request for the scheduler, and the greedy verification for the runner."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def proposal(self, seq: Sequence, budget: int, max_positions: int | None) -> list[int]:
        """Up to ``k`` tokens to verify after ``seq``'s last token this step (``[]``: it decodes one token).

        Bounded by the step's token ``budget`` (the last token takes one), the tokens the request may still generate
        (the target's own next token always comes too) and the model's position table."""
        if not may_speculate(seq):
            return []
        room = min(self.config.num_speculative_tokens, budget - 1, seq.params.max_new_tokens - seq.generated - 1)
        if max_positions is not None:
            room = min(room, max_positions - len(seq.tokens))
        if room <= 0:
            return []
        return propose(seq.tokens, room, self.config.prompt_lookup_max, min_ngram=self.config.prompt_lookup_min)


def verify_greedy(logits: torch.Tensor, entries: list[tuple[Sequence, list[int]]], accepted: dict[int, int]
                  ) -> dict[int, int]:  # fmt: skip
    """Greedy verification of the speculating requests of a step.

    ``logits [N, V]``: the rows of ``entries`` in order, ``1 + len(proposal)`` rows each (the last token's, then one
    per proposed token). Records ``accepted[id(seq)]`` (the proposals kept: the longest prefix equal to the target's
    argmax) and returns ``{id(seq): the target's next token after them}``."""
    picks = logits.argmax(-1).tolist()  # [N]
    out: dict[int, int] = {}
    at = 0
    for seq, draft in entries:
        rows = picks[at : at + 1 + len(draft)]
        at += 1 + len(draft)
        a = 0
        while a < len(draft) and rows[a] == draft[a]:
            a += 1
        accepted[id(seq)] = a
        out[id(seq)] = rows[a]
    return out


def count_speculation(stats: Any, plan: Any) -> None:
    """Add a step's proposals and acceptances to ``stats`` (a ``ServingStats``; ``plan`` None: an empty step)."""
    drafts = plan.drafts if plan is not None else {}
    accepted = plan.accepted if plan is not None else {}
    stats.spec_decode_num_drafts = (stats.spec_decode_num_drafts or 0) + len(drafts)
    stats.spec_decode_num_draft_tokens = (stats.spec_decode_num_draft_tokens or 0) + sum(map(len, drafts.values()))
    stats.spec_decode_num_accepted_tokens = (stats.spec_decode_num_accepted_tokens or 0) + sum(accepted.values())
