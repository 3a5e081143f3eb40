"""Per-request state of the serving engine: sampling settings read from a ``GenerationConfig``, and the sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .engine import RequestHandle

# GenerationConfig settings that select something this engine does not do; each must keep its default.
_UNSUPPORTED = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "penalty_alpha": None,
    "prompt_lookup_num_tokens": None,
    "no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0,
    "bad_words_ids": None,
    "force_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "guidance_scale": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_length": 0,
    "min_new_tokens": None,
    "stop_strings": None,
    "watermarking_config": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
}


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (read from a transformers ``GenerationConfig``)."""

    max_new_tokens: int
    eos_token_ids: frozenset[int]
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    # -- per-request settings of OpenAI / vLLM requests (vLLM's SamplingParams names; neutral defaults) -----------
    #: OpenAI's penalties on the generated tokens so far: logit -= presence * (count > 0) + frequency * count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: token id -> bias added to its logit before sampling (OpenAI's logit_bias, values in [-100, 100]).
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: seeds this request's own torch.Generator (the same text alone and among other requests); None: torch's global.
    seed: int | None = None
    #: extra ids that finish the request (finish_reason "stop", the id included in the tokens, as vLLM).
    stop_token_ids: frozenset[int] = frozenset()
    #: EOS does not finish the request (it runs to max_new_tokens); EOS can still be sampled.
    ignore_eos: bool = False
    #: EOS and stop_token_ids are masked until this many tokens are generated (vLLM's min_tokens).
    min_tokens: int = 0
    #: log-probs to return per generated token: None none; 0 the sampled token's; k also the k most likely.
    logprobs: int | None = None
    #: log-probs of the prompt tokens (vLLM's prompt_logprobs): None none; k as logprobs.
    prompt_logprobs: int | None = None
    #: a structured-output constraint (``serving.structured``): has ``matcher()`` giving a per-request state with
    #: ``allowed(vocab) -> BoolTensor [V]``, ``accept(token)``, ``is_terminated()``. None: unconstrained.
    constraint: Any = None
    #: transformers logits processors generate_batch builds from a GenerationConfig field the fields above do not
    #: cover (no_repeat_ngram_size, bad_words_ids, ...): a callable giving a fresh LogitsProcessorList per request.
    hf_processors: Any = None
    #: transformers stopping criteria (stop_strings): a callable giving a fresh StoppingCriteriaList per request.
    hf_criteria: Any = None

    @classmethod
    def from_generation_config(cls, config: Any, prompt_len: int, max_new_tokens: int | None = None) -> SamplingParams:
        """The settings of ``config`` for a prompt of ``prompt_len`` tokens; ``max_new_tokens`` overrides the config's.

        Raises ``ValueError`` naming a setting the engine cannot honour (beam search, stop strings, ...).
        """
        for name, default in _UNSUPPORTED.items():
            value = getattr(config, name, default)
            if value is not None and value != default and not (default is None and value in (0, 1.0, [], ())):
                raise ValueError(
                    f"generation_config.{name}={value!r} is not supported by continuous batching on fused layers; "
                    f"leave it at {default!r} or use model.generate for this request."
                )
        if max_new_tokens is None:
            max_new_tokens = config.max_new_tokens
        if max_new_tokens is None:  # transformers' rule: max_length counts the prompt (default 20)
            max_length = config.max_length if config.max_length is not None else 20
            max_new_tokens = max_length - prompt_len
        if max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} for a prompt of {prompt_len} tokens: set "
                "generation_config.max_new_tokens >= 1 (max_length counts the prompt)."
            )
        eos = config.eos_token_id
        eos_ids = frozenset(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
        eos_ids = frozenset(e for e in eos_ids if e >= 0)  # transformers' continuous batching uses -1 for "none"
        do_sample = bool(config.do_sample)
        temperature = float(config.temperature) if config.temperature is not None else 1.0
        if do_sample and temperature <= 0:
            raise ValueError(f"generation_config.temperature={temperature} must be > 0 when do_sample=True")
        return cls(
            max_new_tokens=int(max_new_tokens),
            eos_token_ids=eos_ids,
            do_sample=do_sample,
            temperature=temperature,
            top_k=int(config.top_k) if do_sample and config.top_k else None,
            top_p=float(config.top_p) if do_sample and config.top_p is not None and config.top_p < 1.0 else None,
            min_p=float(config.min_p) if do_sample and getattr(config, "min_p", None) else None,
            repetition_penalty=float(getattr(config, "repetition_penalty", None) or 1.0),
        )

    @property
    def greedy(self) -> bool:
        return not self.do_sample and self.repetition_penalty == 1.0

    def processors(self) -> Any:
        """transformers' public logits processors for these settings, in ``generate``'s order."""
        from transformers import (
            LogitsProcessorList,
            MinPLogitsWarper,
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        out = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.do_sample:
            if self.temperature != 1.0:
                out.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k is not None:
                out.append(TopKLogitsWarper(self.top_k))
            if self.top_p is not None:
                out.append(TopPLogitsWarper(self.top_p))
            if self.min_p is not None:
                out.append(MinPLogitsWarper(self.min_p))
        return out


@dataclass(eq=False)
class Sequence:
    """One request inside the engine.

    ``tokens``: prompt then generated tokens. ``num_computed``: leading tokens whose KV is in the paged cache (the
    last sampled token is not: it is the next step's input). ``block_table``: the request's blocks in order.
    ``block_keys``: content keys of the blocks covering the tokens known at admission (prefix sharing).
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    handle: RequestHandle
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    cacheable_len: int = 0  # tokens covered by block_keys (the tokens at admission)
    registered: int = 0  # leading blocks whose content is registered for sharing
    generated: int = 0
    admissions: int = 0  # > 1 after a preemption
    processors: Any = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.tokens) - self.num_computed

    def input_ids(self, device: torch.device) -> torch.Tensor:
        """``[1, L]`` all tokens so far (for the repetition penalty)."""
        return torch.tensor([self.tokens], dtype=torch.long, device=device)
