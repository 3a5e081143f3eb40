"""Speculative decoding inside the serving engine: n-gram (prompt lookup) or draft-model proposals verified in the
ragged step, for greedy and sampled requests, with the target's distribution kept exactly.

vLLM's ``speculative_config`` keys: ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": m,
"prompt_lookup_min": n}``, or a draft model ``{"model": PATH, "num_speculative_tokens": k}`` (method
``"draft_model"``, inferred from ``model`` as vLLM does; :mod:`.draft`). Before each step, a decoding request that
may speculate gets up to ``k`` proposed tokens: what followed the latest earlier occurrence of its last n-gram (``n``
from ``m`` down to ``n``; :func:`hf_dsinfer.generation.speculative.propose`), or the draft model's greedy
continuation. The step runs ``[last token, p1..pk]`` for it (positions ``L-1 .. L-1+k`` of the paged cache) and the
LM head on all those positions: row ``j`` holds the target's logits for the token after ``p1..pj``.

Verification (:func:`verify`), position by position: the target's token at position ``j`` is chosen exactly as a
plain step would choose it after ``p1..pj`` (the request's own pipeline of :mod:`.sampling`: penalties over the
tokens so far, ``p1..pj`` included, logit_bias, temperature / top-k / top-p / min-p, then the draw from one uniform
number of the request's own generator); ``p(j+1)`` is accepted while it equals that token, and the first token that
differs (or the one after ``pk``) is the step's own next token. For plain greedy requests this is the argmax prefix
match. For sampled ones it is rejection sampling with a point-mass draft (Leviathan et al. 2023, Chen et al. 2023):
the proposal ``x`` is accepted with probability ``p_j(x)`` (the chance that the inverse-CDF draw lands on ``x``), and
on rejection the drawn token is distributed as ``p_j`` without ``x``, renormalized (the draw conditioned on not
landing on ``x``): the residual ``max(0, p - q)`` of a point mass ``q``. The target's distribution is kept exactly, and
since a request draws one uniform per emitted token, as plain decoding does, a seeded request gives the same text
with or without speculation, alone or among others, however many proposals each step had. A draft model proposes
greedily, so its ``q`` is a point mass too (accepting with ``min(1, p/q)`` under the draft's softmax would be wrong for
greedy proposals: that rule holds only for proposals drawn from ``q``).

The cache keeps the accepted positions only (``num_computed`` advances by ``1 + accepted``); the KV written for
rejected proposals lies beyond it, in the request's private blocks, and is overwritten by later steps.

Who speculates: decoding requests once ``min_tokens`` are generated, without log-probs, without a LoRA adapter,
whose prompt blocks are all computed (so a block registered for prefix sharing never holds proposal KV), and without a
structured-output constraint, transformers logits processors or stopping criteria: those keep state that advances
with each token (a grammar matcher, a processor's or criterion's view of the sequence) and would have to be rolled
back after a rejection. Penalties (repetition, presence, frequency) are computed per position over the accepted
prefix. The others run as without speculation in the same step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..generation.speculative import propose
from .requests import Sequence
from .sampling import _draw, _process, ensure_sampler

#: vLLM's speculative_config keys this engine knows.
KNOWN_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")
METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """A speculation setting: ``k`` proposed tokens per step at most, from n-grams of ``min_ngram..max_ngram``
    (``method="ngram"``) or from the draft model at ``model`` (``method="draft_model"``)."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"
    #: the draft model (method "draft_model"): its folder or hub name, or an already loaded ``*ForCausalLM``
    #: (``generate_batch(assistant_model=...)``)
    model: Any = None

    @classmethod
    def parse(cls, config: Any) -> SpeculativeConfig | None:
        """From vLLM's dict (or its JSON text, or a :class:`SpeculativeConfig`); None stays None (no speculation).

        ``method`` defaults to ``"draft_model"`` when ``model`` is given, else ``"ngram"`` (vLLM's inference).
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
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; this engine knows {list(KNOWN_KEYS)}")
        model = config.get("model")
        method = config.get("method", "draft_model" if model is not None else "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config method={method!r}: only {list(METHODS)} are served "
                             "(prompt lookup, a draft model; EAGLE/Medusa/MTP heads are not)")  # fmt: skip
        loaded = isinstance(model, torch.nn.Module) and model.get_output_embeddings() is not None
        if method == "draft_model" and not loaded and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config method='draft_model' needs \"model\": the draft model's folder or "
                             f"hub name (got model={model!r})")  # fmt: skip
        if method == "ngram" and model is not None:
            raise ValueError(f"speculative_config model={model!r} with method='ngram': n-gram proposals take no model; "
                             "drop \"model\" or use method 'draft_model'")  # fmt: skip
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
        return cls(num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo, method=method, model=model)


def may_speculate(seq: Sequence) -> bool:
    """Whether ``seq`` is decoding and its next tokens are verifiable position by position (module docstring)."""
    p = seq.params
    return (
        seq.remaining == 1
        and seq.registered == len(seq.block_keys)  # its keyed (shareable) blocks are all computed and registered
        and seq.num_computed >= seq.cacheable_len
        and p.constraint is None
        and p.hf_processors is None
        and p.hf_criteria is None
        and seq.generated >= p.min_tokens
        and p.logprobs is None
        and p.prompt_logprobs is None
        and seq.lora is None
        and (seq.sampler is None or seq.sampler.error is None)
    )


def room_for(seq: Sequence, k: int, budget: int, max_positions: int | None) -> int:
    """How many tokens may be proposed for ``seq`` this step: at most ``k``, within the step's token ``budget`` (the
    last token takes one), the tokens the request may still generate (the target's own next token always comes too)
    and the model's position table."""
    room = min(k, budget - 1, seq.params.max_new_tokens - seq.generated - 1)
    if max_positions is not None:
        room = min(room, max_positions - len(seq.tokens))
    return room


class NgramSpeculator:
    """N-gram proposals per request for the scheduler."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def proposal(self, seq: Sequence, budget: int, max_positions: int | None) -> list[int]:
        """Up to ``k`` tokens to verify after ``seq``'s last token this step (``[]``: it decodes one token)."""
        if not may_speculate(seq):
            return []
        room = room_for(seq, self.config.num_speculative_tokens, budget, max_positions)
        if room <= 0:
            return []
        return propose(seq.tokens, room, self.config.prompt_lookup_max, min_ngram=self.config.prompt_lookup_min)

    def begin_step(self, running: list[Sequence]) -> None:
        """Called before each step's plan with the running requests (n-gram proposals keep no state)."""


def make_speculator(config: SpeculativeConfig | None, runner: Any) -> Any:
    """The scheduler's proposer for ``config`` on the target behind ``runner`` (a ``PagedRunner``); None: none."""
    if config is None:
        return None
    if config.method == "draft_model":
        from .draft import DraftSpeculator

        return DraftSpeculator(config, runner)
    return NgramSpeculator(config)


def verify(logits: torch.Tensor, entries: list[tuple[Sequence, list[int]]], accepted: dict[int, int]
           ) -> dict[int, int]:  # fmt: skip
    """Verification of the speculating requests of a step (module docstring).

    ``logits [N, V]`` (fp32, raw): the rows of ``entries`` in order, ``1 + len(proposal)`` rows each (the last
    token's, then one per proposed token). Records ``accepted[id(seq)]`` (the proposals kept) and returns
    ``{id(seq): the target's next token after them}``."""
    plain = [(seq, draft) for seq, draft in entries if ensure_sampler(seq, logits.device).plain(seq.generated)]
    picks = logits.argmax(-1).tolist() if plain else []  # [N]: one batched argmax serves every plain greedy request
    out: dict[int, int] = {}
    at = 0
    for seq, draft in entries:
        rows = slice(at, at + 1 + len(draft))
        at += 1 + len(draft)
        if seq.sampler.plain(seq.generated):
            targets = picks[rows]
            a = 0
            while a < len(draft) and targets[a] == draft[a]:
                a += 1
            token = targets[a]
        else:
            a, token = _verify_processed(logits[rows], seq, draft)
        accepted[id(seq)] = a
        out[id(seq)] = token
    return out


def _verify_processed(logits: torch.Tensor, seq: Sequence, draft: list[int]) -> tuple[int, int]:
    """``(proposals accepted, next token)`` for a request with its own pipeline; ``logits [1 + k, V]`` raw."""
    for j in range(len(draft) + 1):
        # the request as a plain step would see it after accepting draft[:j] (penalties count those tokens)
        view = seq if j == 0 else replace(seq, tokens=seq.tokens + draft[:j], generated=seq.generated + j)
        scores = _process(logits[j : j + 1].clone(), [view])  # [1, V]
        choice = _draw(scores, [view])  # [1]: one uniform of the request's stream, as a plain step draws
        token = int(choice[0])
        if not bool(torch.isfinite(scores[0, token])):  # the scheduler ends the request with this error
            seq.sampler.error = "every token was masked: nothing can be generated"
            return j, token
        if j == len(draft) or token != draft[j]:
            return j, token
    raise AssertionError("unreachable: the loop returns at j == len(draft)")


def count_speculation(stats: Any, plan: Any) -> None:
    """Add a step's proposals and acceptances to ``stats`` (a ``ServingStats``; ``plan`` None: an empty step)."""
    drafts = plan.drafts if plan is not None else {}
    accepted = plan.accepted if plan is not None else {}
    stats.spec_decode_num_drafts = (stats.spec_decode_num_drafts or 0) + len(drafts)
    stats.spec_decode_num_draft_tokens = (stats.spec_decode_num_draft_tokens or 0) + sum(map(len, drafts.values()))
    stats.spec_decode_num_accepted_tokens = (stats.spec_decode_num_accepted_tokens or 0) + sum(accepted.values())
