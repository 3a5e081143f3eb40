"""Reading transformers' logits processors and stopping criteria into a plan the fast loop runs on the device.

``generate`` builds a ``LogitsProcessorList`` and a ``StoppingCriteriaList`` from the generation config. The fast
loop accepts only the ones it reproduces exactly (same order, same ops as transformers):

* processors: repetition penalty, min length / min new tokens (EOS masked), then the sampling warpers
  temperature, top-k, top-p, min-p (``hf_dsinfer.kernels.filter_logits`` applies them in HF's order);
* criteria: max length, EOS (one id or several), stop strings and max time (called as transformers' own objects).

Anything else (a user's processor, no-repeat-ngram, bad words, typical-p, ...) makes :func:`plan_decoding` return
the reason, and the request runs through transformers' loop instead: nothing is ignored silently.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig
from transformers.generation import logits_process as lp
from transformers.generation import stopping_criteria as sc

from hf_dsinfer.kernels import filter_logits, sample

_NEG_INF = float("-inf")


@dataclass
class DecodePlan:
    """What the fast loop does to each step's logits and when it stops."""

    do_sample: bool
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    penalty_ignore: int | torch.Tensor | None = None  # prompt tokens the penalty skips (int: a prefix; [B]: per row)
    # (length, ids): these ids are masked while the sequence (prompt included) is shorter than length; from
    # MinLengthLogitsProcessor and MinNewTokensLengthLogitsProcessor (prompt length + min_new_tokens)
    eos_floors: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    max_length: int | None = None
    eos: torch.Tensor | None = None  # ids that finish a row (EosTokenCriteria)
    host_criteria: list = field(default_factory=list)  # criteria called as is each step (stop strings, max time)

    @property
    def warps(self) -> bool:
        return self.do_sample and (self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0)


def resolve_generation_config(model: Any, kwargs: dict[str, Any]) -> GenerationConfig | None:
    """The generation config a ``generate(**kwargs)`` call will run with, from public API only: the given
    ``generation_config`` (or the model's) updated with the call's keyword arguments. None when it is invalid
    (transformers' ``generate`` then raises its own error)."""
    base = kwargs.get("generation_config") or getattr(model, "generation_config", None) or GenerationConfig()
    try:
        config = copy.deepcopy(base)
        config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
        config.validate()
    except Exception:  # noqa: BLE001 - transformers raises the same error, with its own message, in generate
        return None
    return config


# GenerationConfig fields that select a decoding mode or a logits processor the fast loop does not reproduce, with
# their neutral values (transformers' defaults differ between releases: 5.17's GenerationConfig() leaves most None).
# Checked before generation; any other value sends the request to transformers' loop.
_NEUTRAL_ONE = ("num_beams", "num_beam_groups", "guidance_scale", "encoder_repetition_penalty", "typical_p", "top_h")
_NEUTRAL_ZERO = ("diversity_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "epsilon_cutoff",
                 "eta_cutoff")  # fmt: skip
_NEUTRAL_UNSET = (
    "penalty_alpha", "prompt_lookup_num_tokens", "assistant_early_exit", "dola_layers", "low_memory", "constraints",
    "force_words_ids", "sequence_bias", "bad_words_ids", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "forced_decoder_ids", "watermarking_config", "renormalize_logits", "token_healing", "output_attentions",
    "output_hidden_states",
)  # fmt: skip


def fast_loop_blocker(config: GenerationConfig) -> str | None:
    """Why the fast loop cannot run a request with ``config`` (None: it can), from its public fields."""
    for names, neutral in ((_NEUTRAL_ONE, (None, 1, 1.0)), (_NEUTRAL_ZERO, (None, 0, 0.0)),
                           (_NEUTRAL_UNSET, (None, False, 0, (), []))):  # fmt: skip
        for name in names:
            value = getattr(config, name, None)
            if any(value is n or (type(value) is type(n) and value == n) for n in neutral):
                continue
            if name == "num_beams":
                return "beam search"
            if name == "prompt_lookup_num_tokens":
                if not config.do_sample:
                    continue  # greedy: the fast loop verifies proposals itself (generation/speculative.py)
                return "prompt lookup with sampling"
            if name == "penalty_alpha":
                return "contrastive search"
            return f"generation_config.{name}={value!r}"
    return None


def stop_string_criteria(tokenizer: Any, stop_strings: Any) -> sc.StoppingCriteriaList:
    """transformers' stop-string criterion for ``stop_strings`` (str or list), as a criteria list."""
    return sc.StoppingCriteriaList([sc.StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)])


def _eos_tensor(value) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.tensor(value if isinstance(value, list) else [value])
    return t.reshape(-1).long()


def plan_decoding(processors, criteria, do_sample: bool) -> DecodePlan | str:
    """A :class:`DecodePlan` for ``generate``'s prepared processors and criteria, or why the fast loop cannot run."""
    plan = DecodePlan(do_sample=bool(do_sample))
    warper_rank = 0  # temperature, top-k, top-p, min-p must come in this order (HF's), after the other processors
    for p in processors:
        kind = type(p)
        if kind is lp.RepetitionPenaltyLogitsProcessor and warper_rank == 0 and plan.repetition_penalty is None:
            if getattr(p, "logits_indices", None) is not None:
                return "repetition penalty in packed (continuous batching) form"
            plan.repetition_penalty = float(p.penalty)
            plan.penalty_ignore = getattr(p, "prompt_ignore_length", None)
        elif kind is lp.MinLengthLogitsProcessor and warper_rank == 0:
            plan.eos_floors.append((int(p.min_length), _eos_tensor(p.eos_token_id).cpu()))
        elif kind is lp.MinNewTokensLengthLogitsProcessor and warper_rank == 0:
            floor = int(p.prompt_length_to_skip) + int(p.min_new_tokens)
            plan.eos_floors.append((floor, _eos_tensor(p.eos_token_id).cpu()))
        elif kind in _WARPERS and plan.do_sample:
            rank = _WARPERS[kind]
            if rank <= warper_rank:
                return f"{kind.__name__} out of transformers' order"
            if getattr(p, "min_tokens_to_keep", 1) != 1 or getattr(p, "filter_value", _NEG_INF) != _NEG_INF:
                return f"{kind.__name__} with min_tokens_to_keep or filter_value changed"
            warper_rank = rank
            if kind is lp.TemperatureLogitsWarper:
                plan.temperature = float(p.temperature)
            elif kind is lp.TopKLogitsWarper:
                plan.top_k = int(p.top_k)
            elif kind is lp.TopPLogitsWarper:
                plan.top_p = float(p.top_p)
            else:
                plan.min_p = float(p.min_p)
        else:
            return f"logits processor {kind.__name__}"
    for c in criteria:
        kind = type(c)
        if kind is sc.MaxLengthCriteria:
            plan.max_length = int(c.max_length) if plan.max_length is None else min(plan.max_length, int(c.max_length))
        elif kind is sc.EosTokenCriteria:
            eos = _eos_tensor(c.eos_token_id).cpu()
            plan.eos = eos if plan.eos is None else torch.unique(torch.cat([plan.eos, eos]))
        elif kind in (sc.StopStringCriteria, sc.MaxTimeCriteria):
            plan.host_criteria.append(c)
        else:
            return f"stopping criterion {kind.__name__}"
    if plan.max_length is None:
        return "no max_length (the fast loop needs a bound on new tokens)"
    return plan


_WARPERS = {
    lp.TemperatureLogitsWarper: 1,
    lp.TopKLogitsWarper: 2,
    lp.TopPLogitsWarper: 3,
    lp.MinPLogitsWarper: 4,
}


#: Tokens per block of the CPU draw's two-level search (:func:`_inverse_cdf_draw`).
_DRAW_BLOCK = 256


def _inverse_cdf_draw(scores: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``scores [B, V]`` (warped, ``-inf`` = removed), drawn from ``softmax(scores)``; ``[B]``.

    The CPU draw: one uniform per row against the row's cumulative probabilities, where the exponential race
    (``hf_dsinfer.kernels.sample``, and torch's own CPU ``multinomial``) draws one Exp(1) variate per vocabulary entry:
    that took ~64-96 ms of a ~280-750 ms batch-32 step on SmolLM2 (vocab 49152, 1 thread, loaded machine). The search
    has two levels: the uniform picks a block of :data:`_DRAW_BLOCK` tokens by the blocks' summed probabilities, then a
    token inside it by that block's cumulative sum, so only ``V / 256`` block sums and one block are accumulated in
    float64 instead of the whole ``[B, V]`` row (a full float64 ``cumsum`` was ~5x slower at batch 32). The block sums
    are taken in fp32 (torch's vectorized cascade sum: relative error ~1e-7, the rounding the fp32 probabilities
    themselves carry) and accumulated across blocks in float64: summing in float64 converted the whole ``[B, V]``
    row first (0.5-0.65 ms against 0.09 ms at ``[32, 49152]``, 1 thread). The same categorical distribution; on CPU
    there is no graph to capture, so nothing is lost.
    """
    probs = scores.softmax(dim=-1)  # [B, V]
    rows, vocab = probs.shape
    blk = _DRAW_BLOCK
    pad = (-vocab) % blk
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(rows, -1, blk)  # [B, nb, blk]; padding has probability 0
    mass = blocks.sum(dim=-1).double()  # [B, nb]: fp32 block sums, accumulated in float64 below
    cdf = mass.cumsum(dim=-1)  # [B, nb]
    total = cdf[:, -1:]  # [B, 1]: ~1
    if not bool(torch.isfinite(total).all()):
        # what torch.multinomial (HF's draw) refuses too: every token removed or non-finite logits
        raise RuntimeError("sampling: a row's probabilities contain inf or nan (every token removed or inf logits)")
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64) * total  # [B, 1] in [0, total)
    # The first block whose cdf exceeds u (so its mass is > 0); u rounded up to total (~2^-53 per draw): the last block
    # with probability.
    last_block = mass.shape[1] - 1 - (mass > 0).flip(-1).int().argmax(dim=-1, keepdim=True)  # [B, 1]
    b_idx = torch.minimum(torch.searchsorted(cdf, u, right=True), last_block)  # [B, 1]
    before = torch.where(b_idx > 0, cdf.gather(1, (b_idx - 1).clamp(min=0)), 0.0)  # [B, 1] mass of earlier blocks <= u
    inside = blocks.gather(1, b_idx[:, :, None].expand(rows, 1, blk)).squeeze(1)  # [B, blk]
    inner = inside.cumsum(dim=-1, dtype=torch.float64)  # [B, blk]
    # First index whose cdf exceeds u - before >= 0: a token with probability > 0; past the block's end (its float64
    # sum rounded below the fp32 block mass, ~1e-7 of it): the block's last token with probability.
    last_inside = blk - 1 - (inside > 0).flip(-1).int().argmax(dim=-1, keepdim=True)  # [B, 1]
    picked = torch.minimum(torch.searchsorted(inner, u - before, right=True), last_inside)  # [B, 1]
    return (b_idx * blk + picked).squeeze(1)


class StepProcessor:
    """Applies a :class:`DecodePlan` to each step's logits ``[B, V]`` with device ops only (no host syncs).

    Keeps a ``[B, V + 1]`` mask of the tokens each row has seen for the repetition penalty (ids past the logits'
    vocab fall in the extra column and are dropped, as transformers does).
    """

    def __init__(self, plan: DecodePlan, input_ids: torch.Tensor, vocab: int, generator: torch.Generator | None):
        self.plan = plan
        self.vocab = vocab
        self.generator = generator
        self.prompt_len = input_ids.shape[1]
        dev = input_ids.device
        self.seen: torch.Tensor | None = None
        if plan.repetition_penalty is not None:
            ids = input_ids.clamp(max=vocab)  # [B, P]
            ignore = plan.penalty_ignore
            if isinstance(ignore, int):
                ids = ids[:, ignore:]
            elif isinstance(ignore, torch.Tensor):
                cols = torch.arange(ids.shape[1], device=dev)
                ids = ids.masked_fill(cols[None, :] < ignore.to(dev)[:, None], vocab)
            self.seen = torch.zeros(input_ids.shape[0], vocab + 1, dtype=torch.bool, device=dev)
            self.seen.scatter_(1, ids, True)
        # (length, the distinct in-vocabulary ids [n] masked while the sequence is shorter than length): a column
        # fill of n ids, not a [B, V] masked_fill (1.75 ms at [32, 49152], 1 thread, for what is 2 columns)
        self.floors = [(n, torch.unique(ids[(ids >= 0) & (ids < vocab)]).to(dev)) for n, ids in plan.eos_floors]

    def process(self, logits: torch.Tensor, step: int, owned: bool = False) -> torch.Tensor:
        """The non-warping processors, in transformers' order; ``step`` = tokens generated so far. fp32 ``[B, V]``.

        ``owned``: the caller does not read ``logits`` afterwards (the fast loop's step output), so they may be
        processed in place; otherwise ``logits`` are left unchanged (transformers' processors return new tensors).
        """
        scores = logits.float()
        owned = owned or scores is not logits  # a cast made a new tensor
        if self.seen is not None:
            p = self.plan.repetition_penalty
            penalized = torch.where(scores < 0, scores * p, scores / p)
            scores = torch.where(self.seen[:, : self.vocab], penalized, scores)
            owned = True
        length = self.prompt_len + step  # the sequence length transformers' processors see (host int: no sync)
        for floor, ids in self.floors:
            if length < floor and ids.numel():
                scores = scores.index_fill_(1, ids, _NEG_INF) if owned else scores.index_fill(1, ids, _NEG_INF)
                owned = True
        return scores

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        """The sampling warpers (what transformers' ``scores`` hold when sampling)."""
        p = self.plan
        if not p.warps:
            return scores
        return filter_logits(scores, p.temperature, p.top_k, p.top_p, p.min_p)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Next token per row ``[B]``: argmax of ``scores``, or a draw from them (already warped) when sampling."""
        if not self.plan.do_sample:
            return scores.argmax(dim=-1)
        if scores.device.type == "cpu":
            return _inverse_cdf_draw(scores, self.generator)
        # The warpers already ran: draw with neutral knobs (the kernel's draw needs no host sync).
        return sample(scores, 1.0, 0, 1.0, 0.0, self.generator)

    def observe(self, tokens: torch.Tensor) -> None:
        """Record the tokens just appended (``[B]``) for the repetition penalty."""
        if self.seen is not None:
            self.seen.scatter_(1, tokens.clamp(max=self.vocab)[:, None], True)
