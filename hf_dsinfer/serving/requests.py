"""Per-request state of the serving engine: sampling settings (``SamplingParams``, read from a ``GenerationConfig``
or built by the HTTP layer), log-probs of one token, and the sequence."""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .handle import RequestHandle

#: Most log-probs a request may ask for per token (vLLM's default ``max_logprobs``, OpenAI's ``top_logprobs`` limit).
MAX_LOGPROBS = 20

# GenerationConfig settings that select something this engine does not do; each must keep its default (None or the
# value here). Beam search and its relatives need several hypotheses per request, guidance a second forward.
_UNSUPPORTED = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "penalty_alpha": None,
    "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "force_words_ids": None,
    "constraints": None,
    "guidance_scale": None,
    "dola_layers": None,
    "token_healing": None,
    "watermarking_config": None,
}
_WHY = {"num_beams": "beam search", "penalty_alpha": "contrastive search"}

# GenerationConfig settings honoured through transformers' own logits processors, with their neutral values: a request
# that sets one gets generate's whole processor list (``SamplingParams.hf_processors``), so their order is generate's.
_HF_ONLY = {
    "sequence_bias": (None, {}, []),
    "no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None, []),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,),
    "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []),
    "renormalize_logits": (None, False),
}
_HF_ONLY_SAMPLING = {
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
}


def _is_set(value: Any, neutral: tuple) -> bool:
    return not any(value is n or (type(value) is type(n) and value == n) for n in neutral)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probs of one token (generated or prompt), from ``log_softmax`` of the model's raw fp32 logits (before
    penalties and temperature, as OpenAI and vLLM report them).

    ``token``: its id; ``logprob``: its log-prob; ``rank``: 1 + the number of tokens more likely than it;
    ``top``: the k most likely ``(id, logprob)``, most likely first (k = the request's ``logprobs`` /
    ``prompt_logprobs``; empty for 0).
    """

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (vLLM's names where the setting is the same).

    Build it with :meth:`from_generation_config` (transformers' settings, plus overrides of the fields below) or
    directly; invalid values raise ``ValueError`` naming the field at construction.
    """

    max_new_tokens: int
    eos_token_ids: frozenset[int]
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    #: transformers' repetition penalty on prompt and generated tokens (a logit > 0 is divided by it, < 0 multiplied).
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
    #: log-probs of the prompt tokens (vLLM's prompt_logprobs): None none; k as logprobs. Such a request computes its
    #: whole prompt (it takes no shared prefix blocks).
    prompt_logprobs: int | None = None
    #: a structured-output constraint (``serving.structured``): has ``matcher()`` giving a per-request state with
    #: ``allowed(vocab) -> BoolTensor [V]``, ``accept(token)``, ``is_terminated()``. None: unconstrained.
    constraint: Any = None
    #: transformers logits processors: ``fn(device) -> LogitsProcessorList``, called once per request (a fresh list),
    #: applied after the penalties, logit_bias, min_tokens and the constraint, before temperature / top-k / top-p /
    #: min-p. :meth:`from_generation_config` puts generate's whole list here (repetition penalty and warpers included,
    #: the fields above then neutral) when the config uses a processor the fields do not cover (no_repeat_ngram_size,
    #: bad_words_ids, typical_p, ...).
    hf_processors: Callable[[torch.device], Any] | None = None
    #: transformers stopping criteria: ``fn(device) -> StoppingCriteriaList``, called once per request, checked after
    #: each token (stop_strings, max_time); when one says done the request finishes with "stop".
    hf_criteria: Callable[[torch.device], Any] | None = None

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, rule: str) -> ValueError:
            return ValueError(f"sampling setting {name}={value!r}: {rule}")

        # The hashable forms the engine reads, from what callers naturally pass (a list of ids, a {id: bias} dict).
        for name in ("eos_token_ids", "stop_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, frozenset):
                if isinstance(value, int) or not hasattr(value, "__iter__"):
                    raise bad(name, value, "must be a collection of token ids")
                object.__setattr__(self, name, frozenset(value))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", self.max_new_tokens, "must be an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "must be >= 0")
        if self.do_sample and self.temperature <= 0:
            raise bad("temperature", self.temperature, "must be > 0 when sampling (0 means greedy: do_sample=False)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise bad("top_k", self.top_k, "must be an integer >= 1, or None for no top-k")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if not self.repetition_penalty > 0 or not math.isfinite(self.repetition_penalty):
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1.0: none)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, value, "must be in [-2, 2] (OpenAI's range)")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0:
                raise bad("logit_bias", token, "keys must be token ids >= 0")
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", {token: bias}, "values must be in [-100, 100]")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", self.seed, "must be an integer in [-2**63, 2**64)")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", sorted(self.stop_token_ids), "must be token ids >= 0")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be in [0, max_new_tokens={self.max_new_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, value, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.constraint is not None and not callable(getattr(self.constraint, "matcher", None)):
            raise bad("constraint", self.constraint, "must have a matcher() method (see serving.structured)")
        for name in ("hf_processors", "hf_criteria"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise bad(name, getattr(self, name), "must be a callable fn(device) giving a fresh list per request")

    @classmethod
    def from_generation_config(
        cls,
        config: Any,
        prompt_len: int,
        max_new_tokens: int | None = None,
        *,
        tokenizer: Any = None,
        **overrides: Any,
    ) -> SamplingParams:
        """The settings of ``config`` for a prompt of ``prompt_len`` tokens; ``max_new_tokens`` overrides the config's,
        ``overrides`` set fields of this class (e.g. ``seed=1, logprobs=5``). ``tokenizer``: needed for
        ``stop_strings`` (as ``generate(tokenizer=...)``).

        Raises ``ValueError`` naming a setting the engine cannot honour (beam search, ...) or an unknown override.
        """
        for name, default in _UNSUPPORTED.items():
            value = getattr(config, name, default)
            if value is not None and value != default and not (default is None and value in (0, 1.0, [], ())):
                what = _WHY.get(name, f"generation_config.{name}={value!r}")
                raise ValueError(
                    f"{what} is not supported by continuous batching on fused layers; leave "
                    f"generation_config.{name} at {default!r} or use model.generate for this request."
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
        raw_eos = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
        eos_ids = frozenset(e for e in raw_eos if e >= 0)  # transformers' continuous batching uses -1 for "none"
        do_sample = bool(config.do_sample)
        temperature = float(config.temperature) if config.temperature is not None else 1.0
        if do_sample and temperature <= 0:
            raise ValueError(f"generation_config.temperature={temperature} must be > 0 when do_sample=True")
        # min_length counts the prompt; both mask EOS until reached (MinLength / MinNewTokensLength processors)
        min_tokens = max(int(config.min_new_tokens or 0), int(config.min_length or 0) - prompt_len, 0)
        fields: dict[str, Any] = dict(
            max_new_tokens=int(max_new_tokens),
            eos_token_ids=eos_ids,
            do_sample=do_sample,
            temperature=temperature,
            top_k=int(config.top_k) if do_sample and config.top_k else None,
            top_p=float(config.top_p) if do_sample and config.top_p is not None and config.top_p < 1.0 else None,
            min_p=float(config.min_p) if do_sample and getattr(config, "min_p", None) else None,
            repetition_penalty=float(getattr(config, "repetition_penalty", None) or 1.0),
            min_tokens=min(min_tokens, int(max_new_tokens)),
        )
        uses = [n for n, neutral in _HF_ONLY.items() if _is_set(getattr(config, n, None), neutral)]
        if do_sample:
            uses += [n for n, neutral in _HF_ONLY_SAMPLING.items() if _is_set(getattr(config, n, None), neutral)]
        if uses:
            fields["hf_processors"] = _generate_processors(config, prompt_len, int(max_new_tokens), raw_eos)
            # generate's list holds these too, in its order: neutral here so they are not applied twice
            fields.update(temperature=1.0, top_k=None, top_p=None, min_p=None, repetition_penalty=1.0)
        if getattr(config, "stop_strings", None) or getattr(config, "max_time", None):
            fields["hf_criteria"] = _generate_criteria(config, tokenizer)
        _check_names(overrides)
        return cls(**{**fields, **overrides})

    def with_overrides(self, overrides: dict[str, Any]) -> SamplingParams:
        """These settings with the fields in ``overrides`` changed; an unknown name is a ``ValueError`` naming it."""
        _check_names(overrides)
        return dataclasses.replace(self, **overrides) if overrides else self

    @property
    def greedy(self) -> bool:
        """Plain greedy: the argmax of the raw logits, with no per-request work (min_tokens aside, which masks EOS
        only while fewer tokens were generated)."""
        return (
            not self.do_sample
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and not self.logit_bias
            and self.constraint is None
            and self.hf_processors is None
            and self.hf_criteria is None
        )


def _check_names(overrides: dict[str, Any]) -> None:
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(SamplingParams)})
    if unknown:
        raise ValueError(f"unknown sampling settings {unknown}: the fields are those of SamplingParams")


def _generate_processors(config: Any, prompt_len: int, max_new_tokens: int, eos: list[int]) -> Callable:
    """``fn(device)`` giving generate's logits processors for ``config`` (transformers' public classes, in the order
    of ``GenerationMixin._get_logits_processor``) for one request; min length is ``SamplingParams.min_tokens``."""
    from transformers.generation import logits_process as lp

    eos_ids = eos or None

    def build(device: torch.device) -> Any:
        c = config
        out = lp.LogitsProcessorList()
        if _is_set(c.sequence_bias, _HF_ONLY["sequence_bias"]):
            out.append(lp.SequenceBiasLogitsProcessor(sequence_bias=c.sequence_bias))
        if c.repetition_penalty is not None and c.repetition_penalty != 1.0:
            out.append(lp.RepetitionPenaltyLogitsProcessor(float(c.repetition_penalty)))
        if c.no_repeat_ngram_size:
            out.append(lp.NoRepeatNGramLogitsProcessor(c.no_repeat_ngram_size))
        if c.bad_words_ids:
            out.append(lp.NoBadWordsLogitsProcessor(c.bad_words_ids, eos_ids))
        if c.forced_bos_token_id is not None:
            out.append(lp.ForcedBOSTokenLogitsProcessor(c.forced_bos_token_id))
        if c.forced_eos_token_id is not None:
            max_length = prompt_len + max_new_tokens  # what generate sets max_length to
            out.append(lp.ForcedEOSTokenLogitsProcessor(max_length, c.forced_eos_token_id, device=device))
        if c.remove_invalid_values:
            out.append(lp.InfNanRemoveLogitsProcessor())
        if c.exponential_decay_length_penalty is not None:
            out.append(lp.ExponentialDecayLengthPenalty(c.exponential_decay_length_penalty, eos_ids, prompt_len))
        if c.suppress_tokens:
            out.append(lp.SuppressTokensLogitsProcessor(c.suppress_tokens, device=device))
        if c.begin_suppress_tokens:
            begin = prompt_len if (prompt_len > 1 or c.forced_bos_token_id is None) else prompt_len + 1
            out.append(lp.SuppressTokensAtBeginLogitsProcessor(c.begin_suppress_tokens, begin, device=device))
        if c.do_sample:
            if c.temperature is not None and c.temperature != 1.0:
                out.append(lp.TemperatureLogitsWarper(float(c.temperature)))
            if getattr(c, "top_h", None) is not None:
                out.append(lp.TopHLogitsWarper(top_h=c.top_h))
            if c.top_k:
                out.append(lp.TopKLogitsWarper(top_k=c.top_k))
            if c.top_p is not None and c.top_p < 1.0:
                out.append(lp.TopPLogitsWarper(top_p=c.top_p))
            if getattr(c, "min_p", None) is not None:
                out.append(lp.MinPLogitsWarper(min_p=c.min_p))
            if c.typical_p is not None and c.typical_p < 1.0:
                out.append(lp.TypicalLogitsWarper(mass=c.typical_p))
            if c.epsilon_cutoff is not None and 0.0 < c.epsilon_cutoff < 1.0:
                out.append(lp.EpsilonLogitsWarper(epsilon=c.epsilon_cutoff))
            if c.eta_cutoff is not None and 0.0 < c.eta_cutoff < 1.0:
                out.append(lp.EtaLogitsWarper(epsilon=c.eta_cutoff, device=device))
        if c.renormalize_logits:
            out.append(lp.LogitNormalization())
        return out

    try:
        build(torch.device("cpu"))  # a bad value fails at submit, with transformers' own message
    except Exception as e:  # noqa: BLE001 - e.g. a processor class this transformers release lacks (top_h)
        raise ValueError(f"generation_config: transformers' logits processors refuse these settings: {e}") from e
    return build


_CRITERIA_CACHE: OrderedDict[tuple, tuple[Any, Any]] = OrderedDict()  # (id(tokenizer), strings) -> (tokenizer, crit)


def _generate_criteria(config: Any, tokenizer: Any) -> Callable:
    """``fn(device)`` giving generate's stop-string and max-time criteria for ``config``; the stop-string criterion
    (stateless, costly to build: it scans the vocabulary) is built once per tokenizer and strings."""
    from transformers.generation import stopping_criteria as sc

    stop_strings = getattr(config, "stop_strings", None)
    strings_crit = None
    if stop_strings:
        if tokenizer is None:
            raise ValueError(
                "generation_config.stop_strings needs the tokenizer: pass tokenizer=... (as to generate), e.g. "
                "model.generate_batch(inputs, generation_config, tokenizer=tokenizer)."
            )
        key = (id(tokenizer), tuple([stop_strings] if isinstance(stop_strings, str) else stop_strings))
        hit = _CRITERIA_CACHE.get(key)
        if hit is None or hit[0] is not tokenizer:
            hit = (tokenizer, sc.StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
            _CRITERIA_CACHE[key] = hit
            while len(_CRITERIA_CACHE) > 8:
                _CRITERIA_CACHE.popitem(last=False)
        strings_crit = hit[1]
    max_time = getattr(config, "max_time", None)

    def build(device: torch.device) -> Any:
        out = sc.StoppingCriteriaList()
        if strings_crit is not None:
            out.append(strings_crit)
        if max_time:
            out.append(sc.MaxTimeCriteria(max_time=float(max_time)))  # counts from the request's first token
        return out

    return build


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
    sampler: Any = None  # its RequestSampler (serving.sampling), made at its first step; survives preemption
    lora: Any = None  # its LoRA adapter (serving.lora.LoRAAdapter), or None: the base model

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.tokens) - self.num_computed

    def input_ids(self, device: torch.device) -> torch.Tensor:
        """``[1, L]`` all tokens so far (what transformers' processors and criteria read)."""
        return torch.tensor([self.tokens], dtype=torch.long, device=device)
