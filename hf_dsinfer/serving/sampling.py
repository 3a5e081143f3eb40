"""The per-request logits pipeline of the serving engine: each request its own settings inside one batched step.

:func:`select_tokens` takes the fp32 logits ``[R, V]`` of the requests that sample this step and applies, to each
row, only what its request asked for, in this order (vLLM's and transformers' where they overlap):

1. repetition penalty (transformers' definition: prompt and generated tokens; a logit > 0 divided, < 0 multiplied);
2. presence / frequency penalties (OpenAI's: generated tokens only, ``logit -= presence * (count > 0) +
   frequency * count``);
3. ``logit_bias`` (added);
4. ``min_tokens``: EOS and ``stop_token_ids`` masked while fewer tokens were generated;
5. the structured-output constraint: tokens its matcher does not allow are masked;
6. transformers' logits processors of the request (``hf_processors``);
7. temperature, top-k, top-p, min-p (:func:`hf_dsinfer.kernels.filter_logits`: transformers' warpers, HF's order);
8. the draw: argmax when greedy; otherwise the inverse of the cumulative distribution at one uniform number, drawn
   from the request's own ``torch.Generator`` when it has a seed (so its tokens do not depend on the other requests
   of the step, nor on preemptions), else from torch's global generator.

Rows of plain greedy requests skip all of it: they take one batched argmax over the whole step, and the per-row work
of the other rows touches only a copy of their own rows. Stages run batched over the rows that use them.

Log-probs (:func:`token_logprobs`) come from ``log_softmax`` of the raw logits (before any of the above), as OpenAI
and vLLM report them.
"""

from __future__ import annotations

from collections import Counter

import torch

from hf_dsinfer.kernels import filter_logits

from .requests import SamplingParams, Sequence, TokenLogprobs

_NEG_INF = float("-inf")


class RequestSampler:
    """The sampling state of one request, made at its first step and kept across steps and preemptions: its seeded
    generator, grammar matcher, transformers processors and criteria, and what the last step decided."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.error: str | None = None  # set when this request's own settings failed; it then ends with "error"
        self.stopped = False  # the constraint terminated or a criterion fired: the request ends with "stop"
        self.pending_logprobs: TokenLogprobs | None = None  # of the token sampled this step
        self.prompt_entries: list[TokenLogprobs] = []  # prompt log-probs of positions 1.. computed so far
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        bias = dict(params.logit_bias)  # the last value of a repeated id wins
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device) if bias else None
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device) if bias else None
        stops = sorted(params.eos_token_ids | params.stop_token_ids)
        self.min_ids = torch.tensor(stops, dtype=torch.long, device=device) if stops and params.min_tokens else None
        self.matcher = self.processors = self.criteria = None
        try:
            if params.constraint is not None:
                self.matcher = params.constraint.matcher()
            if params.hf_processors is not None:
                self.processors = params.hf_processors(device)
            if params.hf_criteria is not None:
                self.criteria = params.hf_criteria(device)
        except Exception as e:  # noqa: BLE001 - this request fails, not the step
            self.error = f"building the request's sampling state failed: {e!r}"

    def plain(self, generated: int) -> bool:
        """Whether the next token is the plain argmax of the raw logits."""
        return self.params.greedy and (self.min_ids is None or generated >= self.params.min_tokens)


def ensure_sampler(seq: Sequence, device: torch.device) -> RequestSampler:
    if seq.sampler is None:
        seq.sampler = RequestSampler(seq.params, device)
    return seq.sampler


def select_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The next token of each row of ``logits [R, V]`` (fp32, raw) for ``seqs``; records per request what it decided
    (log-probs, stop, error) on its :class:`RequestSampler`. ``logits`` is not modified."""
    device = logits.device
    samplers = [ensure_sampler(s, device) for s in seqs]
    slow = [r for r, (s, sm) in enumerate(zip(seqs, samplers)) if not sm.plain(s.generated) and sm.error is None]
    # [R]: plain greedy rows are done here, in one batched argmax
    picked = logits.argmax(-1) if len(slow) < len(seqs) else torch.zeros(len(seqs), dtype=torch.long, device=device)
    dead: list[bool] = []
    scores = None
    if slow:
        index = torch.tensor(slow, device=device)
        rows = [seqs[r] for r in slow]
        scores = _process(logits.index_select(0, index), rows)  # [S, V], a copy
        choice = _draw(scores, rows)  # [S]
        # a row whose every token was masked picks a token of score -inf (or NaN): nothing could be generated
        alive = torch.isfinite(scores.gather(1, choice[:, None]))[:, 0]
        flat = torch.cat([picked.index_copy(0, index, choice), alive.long()]).tolist()
        tokens, dead = flat[: len(seqs)], [not a for a in flat[len(seqs) :]]
    else:
        tokens = picked.tolist()
    for j, r in enumerate(slow):
        _after(seqs[r], tokens[r], scores[j : j + 1], dead[j])
    wants = [r for r, s in enumerate(seqs) if s.params.logprobs is not None]
    if wants:
        index = torch.tensor(wants, device=device)
        entries = token_logprobs(logits.index_select(0, index), [tokens[r] for r in wants],
                                 [seqs[r].params.logprobs for r in wants])  # fmt: skip
        for r, entry in zip(wants, entries):
            samplers[r].pending_logprobs = entry
    return tokens


def _process(scores: torch.Tensor, rows: list[Sequence]) -> torch.Tensor:
    """Stages 1-7 of the module docstring on ``scores [S, V]`` (each stage on the rows that use it)."""
    S, V = scores.shape
    dev = scores.device

    def pick(cond) -> tuple[list[int], torch.Tensor | None]:
        js = [j for j, s in enumerate(rows) if cond(s)]
        return js, (torch.tensor(js, device=dev) if js else None)

    # 1. repetition penalty on the ids each row has seen (transformers' ops on the gathered logits)
    pen = [(j, s) for j, s in enumerate(rows) if s.params.repetition_penalty != 1.0]
    if pen:
        ids = [sorted({t for t in s.tokens if t < V}) for _, s in pen]
        at = (torch.tensor([j for (j, _), i in zip(pen, ids) for _ in i], device=dev),
              torch.tensor([t for i in ids for t in i], dtype=torch.long, device=dev))  # fmt: skip
        factor = torch.tensor([s.params.repetition_penalty for (_, s), i in zip(pen, ids) for _ in i], device=dev)
        seen = scores[at]
        scores[at] = torch.where(seen < 0, seen * factor, seen / factor)
    # 2. OpenAI's presence / frequency penalties on the generated tokens (their counts)
    items = []
    for j, s in enumerate(rows):
        p = s.params
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            counts = Counter(t for t in s.tokens[len(s.prompt) :] if t < V)
            if counts:
                items.append((j, torch.tensor(list(counts), dtype=torch.long, device=dev),
                              -torch.tensor([p.frequency_penalty * c + p.presence_penalty for c in counts.values()],
                                            device=dev)))  # fmt: skip
    _put(scores, items, accumulate=True)
    # 3. logit_bias, 4. min_tokens
    _put(scores, [(j, s.sampler.bias_ids, s.sampler.bias_values) for j, s in enumerate(rows)
                  if s.sampler.bias_ids is not None], accumulate=True)  # fmt: skip
    _put(scores, [(j, s.sampler.min_ids, None) for j, s in enumerate(rows)
                  if s.sampler.min_ids is not None and s.generated < s.params.min_tokens])  # fmt: skip
    # 5. the constraint's mask, 6. transformers' processors (per row: their state is the request's)
    for j, s in enumerate(rows):
        sm = s.sampler
        try:
            if sm.matcher is not None:
                allowed = sm.matcher.allowed(V).to(dev)  # [V] bool
                scores[j] = scores[j].masked_fill(~allowed, _NEG_INF)
            if sm.processors is not None:
                scores[j : j + 1] = sm.processors(s.input_ids(dev), scores[j : j + 1])
        except Exception as e:  # noqa: BLE001 - this request fails, not the step
            sm.error = f"the request's logits processing failed: {e!r}"
    # 7. the warpers of sampling rows
    js, idx = pick(lambda s: s.params.do_sample)
    if js:
        knobs = [(s.params.temperature, s.params.top_k or 0, s.params.top_p or 1.0, s.params.min_p or 0.0)
                 for s in (rows[j] for j in js)]  # fmt: skip
        scores = warp(scores, knobs) if len(js) == S else scores.index_copy(0, idx, warp(scores[idx], knobs))
    return scores


#: Candidates the top-p shortcut looks at: torch.topk of this many is ~20x cheaper than sorting 49k logits on CPU.
TOP_P_CANDIDATES = 256


def warp(scores: torch.Tensor, knobs: list[tuple[float, int, float, float]]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p of each row of ``scores [n, V]`` (``knobs[i] = (t, k, p, m)``; ``k=0``,
    ``p=1``, ``m=0`` disable), as transformers' warpers in HF's order (:func:`~hf_dsinfer.kernels.filter_logits`).

    Rows with only temperature and top-p take a shortcut when their kept set lies among their
    :data:`TOP_P_CANDIDATES` most likely tokens (usual for trained models): the same rule (a token stays while the
    probability of the tokens above it is < p) on ``torch.topk`` instead of a sort of the vocabulary. The others,
    and the rows whose top-p mass is spread wider, go through ``filter_logits``.
    """
    n, V = scores.shape
    dev = scores.device
    out = scores
    rest = list(range(n))
    short = [i for i, (_, k, p, m) in enumerate(knobs) if k == 0 and m == 0.0 and p < 1.0]
    if short and V > TOP_P_CANDIDATES:
        t = torch.tensor([knobs[i][0] for i in short], device=dev)[:, None]
        # [s, V]: the division TemperatureLogitsWarper makes
        sub = (scores if len(short) == n else scores[torch.tensor(short, device=dev)]) / t
        vals, ids = sub.topk(TOP_P_CANDIDATES, dim=-1)  # [s, K] descending
        probs = torch.exp((vals - torch.logsumexp(sub, dim=-1, keepdim=True)).double())  # [s, K]
        above = probs.cumsum(-1) - probs  # probability of the tokens more likely than each one
        p = torch.tensor([knobs[i][2] for i in short], dtype=torch.float64, device=dev)[:, None]
        kept = sub.fill_(_NEG_INF).scatter_(1, ids, vals.masked_fill(above >= p, _NEG_INF))  # reuses sub
        inside = (probs.sum(-1) >= p[:, 0] + 1e-6).tolist()  # the cut falls among the candidates
        done = [i for i, ok in zip(short, inside) if ok]
        if len(done) == n:
            return kept
        if done:
            pos = torch.tensor([j for j, ok in enumerate(inside) if ok], device=dev)
            out = scores.index_copy(0, torch.tensor(done, device=dev), kept[pos])
            rest = [i for i in rest if i not in set(done)]
    rest = [i for i in rest if knobs[i] != (1.0, 0, 1.0, 0.0)]
    if rest:
        sub_knobs = [knobs[i] for i in rest]
        if len(set(sub_knobs)) == 1:
            t, k, p, m = sub_knobs[0]
        else:
            t, k, p, m = (torch.tensor(col, device=scores.device) for col in zip(*sub_knobs))
        idx = torch.tensor(rest, device=scores.device)
        out = out.clone() if out is scores else out
        out[idx] = filter_logits(scores[idx], t, k, p, m)
    return out


def _put(scores: torch.Tensor, items: list[tuple[int, torch.Tensor, torch.Tensor | None]], accumulate=False) -> None:
    """Per item ``(row, ids, values)``: ``scores[row, ids] += values`` (``accumulate``) or ``= -inf`` (values None),
    all rows in one ``index_put_``."""
    if not items:
        return
    rows = torch.cat([torch.full_like(ids, j) for j, ids, _ in items])
    ids = torch.cat([ids for _, ids, _ in items])
    if accumulate:
        values = torch.cat([v for _, _, v in items])
    else:
        values = torch.full(ids.shape, _NEG_INF, device=scores.device)
    scores.index_put_((rows, ids), values, accumulate=accumulate)


def _draw(scores: torch.Tensor, rows: list[Sequence]) -> torch.Tensor:
    """``[S]``: argmax of greedy rows; for sampling rows, a draw from ``softmax(scores)`` by inverting the cumulative
    distribution at one uniform number per row (float64 sums), from the request's own generator when seeded."""
    js = [j for j, s in enumerate(rows) if s.params.do_sample]
    if not js:
        return scores.argmax(-1)
    dev = scores.device
    choice = scores.argmax(-1) if len(js) < len(rows) else torch.zeros(len(rows), dtype=torch.long, device=dev)
    where = torch.tensor(js, device=dev)
    cdf = torch.softmax(scores if len(js) == len(rows) else scores[where], dim=-1).cumsum(-1, dtype=torch.float64)
    uniform = torch.empty(len(js), dtype=torch.float64, device=dev)
    unseeded = [i for i, j in enumerate(js) if rows[j].sampler.generator is None]
    if unseeded:
        uniform[torch.tensor(unseeded, device=dev)] = torch.rand(len(unseeded), dtype=torch.float64, device=dev)
    for i, j in enumerate(js):
        gen = rows[j].sampler.generator
        if gen is not None:  # one number of this request's own stream per token, whatever else runs
            uniform[i] = torch.rand(1, dtype=torch.float64, device=dev, generator=gen)[0]
    # u in (0, total]: the first index whose cumulative mass reaches u has a probability > 0
    target = (1.0 - uniform) * cdf[:, -1]
    picked = torch.searchsorted(cdf, target[:, None]).clamp_(max=scores.shape[1] - 1)[:, 0]
    return choice.index_copy(0, where, picked)


def _after(seq: Sequence, token: int, scores: torch.Tensor, dead: bool) -> None:
    """After sampling ``token`` for ``seq`` (a non-plain row): advance its matcher, check its criteria."""
    sm = seq.sampler
    if sm.error is not None:
        return
    if dead:
        sm.error = "every token was masked (by the constraint or the logits processors): nothing can be generated"
        return
    try:
        if sm.matcher is not None:
            if sm.matcher.accept(token) is False:
                sm.error = f"the constraint's matcher rejected token {token} it had allowed"
                return
            if sm.matcher.is_terminated():
                sm.stopped = True
        if sm.criteria is not None:
            ids = torch.tensor([[*seq.tokens, token]], dtype=torch.long, device=scores.device)  # [1, L + 1]
            if bool(sm.criteria(ids, scores).any()):
                sm.stopped = True
    except Exception as e:  # noqa: BLE001 - this request fails, not the step
        sm.error = f"the request's constraint or stopping criteria failed: {e!r}"


def token_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Log-probs of ``targets[i]`` under row ``i`` of the raw ``logits [N, V]``, with the ``ks[i]`` most likely."""
    lsm = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    target = torch.tensor(targets, dtype=torch.long, device=logits.device)[:, None]  # [N, 1]
    chosen = lsm.gather(1, target)  # [N, 1]
    rank = (lsm > chosen).sum(-1) + 1  # [N]
    k = max(ks)
    top_v, top_i = lsm.topk(k, dim=-1) if k else (lsm[:, :0], lsm[:, :0].long())  # [N, k]
    chosen_l, rank_l, top_vl, top_il = chosen[:, 0].tolist(), rank.tolist(), top_v.tolist(), top_i.tolist()
    return [
        TokenLogprobs(t, chosen_l[i], rank_l[i], tuple(zip(top_il[i][: ks[i]], top_vl[i][: ks[i]])))
        for i, t in enumerate(targets)
    ]


def prompt_logprob_rows(plan_chunks: list[tuple[Sequence, int]], device: torch.device) -> tuple[list[int], list]:
    """Where a step computes prompt log-probs: ``(positions in the packed step, [(seq, count)])`` for the requests
    asking for them, covering their prompt positions ``p < P - 1`` not computed yet (position ``p`` gives the
    log-prob of prompt token ``p + 1``)."""
    where: list[int] = []
    owners: list[tuple[Sequence, int]] = []
    offset = 0
    for seq, n in plan_chunks:
        if seq.params.prompt_logprobs is not None:
            sm = ensure_sampler(seq, device)
            first = max(seq.num_computed, len(sm.prompt_entries))
            last = min(seq.num_computed + n, len(seq.prompt) - 1)
            if first < last and first == len(sm.prompt_entries):
                where += range(offset + first - seq.num_computed, offset + last - seq.num_computed)
                owners.append((seq, last - first))
        offset += n
    return where, owners


def record_prompt_logprobs(logits: torch.Tensor, owners: list[tuple[Sequence, int]]) -> None:
    """Append the prompt log-probs of ``logits [N, V]`` (rows in ``owners`` order) to each request's sampler."""
    targets, ks = [], []
    for seq, count in owners:
        start = len(seq.sampler.prompt_entries) + 1
        targets += seq.prompt[start : start + count]
        ks += [seq.params.prompt_logprobs] * count
    entries = token_logprobs(logits, targets, ks)
    at = 0
    for seq, count in owners:
        seq.sampler.prompt_entries += entries[at : at + count]
        at += count
