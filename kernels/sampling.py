"""Token sampling with temperature, top-k, top-p and min-p, in torch ops (no host syncs, CUDA-graph safe).

The filters run in transformers' ``generate`` order (``_get_logits_processor``): temperature, top-k, top-p,
min-p, each with ``min_tokens_to_keep=1`` and the same tie rules as HF's warpers:

* top-k keeps every token whose score is ``>=`` the k-th largest (ties at the boundary all survive);
* top-p sorts ascending, removes tokens whose ascending cumulative probability is ``<= 1 - top_p`` and always keeps
  the most likely token;
* min-p removes tokens whose probability is ``< min_p * max_prob``.

Sampling uses the exponential race: ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` draws ``i`` with probability
``p_i``. It is computed in the log domain (``logit_i - log E_i``), needs no normalization, no ``multinomial`` and no
sync, and is reproducible with a ``torch.Generator``.

Knobs are Python scalars (one value for the batch; filters whose value disables them are skipped entirely) or
per-row tensors ``[B]`` (then every filter runs and the disabling values ``top_k=0``, ``top_p>=1``, ``min_p=0``
make it a no-op on that row). No tensor value is ever read on the host, so the function can be captured in a graph.
There is no Triton version: torch's sort/softmax/cumsum are the fast path here (see docs/kernels.md).
"""

from __future__ import annotations

import torch

from ._checks import check_tensor

__all__ = ["filter_logits", "sample", "sample_torch"]

Knob = float | int | torch.Tensor

_NEG_INF = float("-inf")


def _row_knob(value: Knob, name: str, batch: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A per-row knob as a ``[B, 1]`` tensor on ``device`` (no host sync: only shapes are inspected)."""
    t = value.to(device=device, dtype=dtype)
    if t.dim() == 0:
        t = t.expand(batch)
    t = t.reshape(-1)
    if t.shape[0] != batch:
        raise ValueError(f"{name} must be a scalar or one value per row [{batch}], got {list(value.shape)}")
    return t.unsqueeze(1)


def _check_scalar(name: str, value: Knob, lo: float, hi: float) -> None:
    if not isinstance(value, torch.Tensor) and not (lo <= value <= hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def filter_logits(
    logits: torch.Tensor,
    temperature: Knob = 1.0,
    top_k: Knob = 0,
    top_p: Knob = 1.0,
    min_p: Knob = 0.0,
) -> torch.Tensor:
    """Return fp32 ``[B, V]`` scores after temperature, top-k, top-p and min-p, removed tokens set to ``-inf``.

    Matches chaining HF's TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper (each
    only when enabled). Rows with ``temperature <= 0`` (greedy in :func:`sample`) are scaled by 1.
    """
    check_tensor("logits", logits, ndim=2)
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating tensor, got {logits.dtype}")
    _check_scalar("top_p", top_p, 0.0, 1.0)
    _check_scalar("min_p", min_p, 0.0, 1.0)
    if not isinstance(top_k, torch.Tensor) and (int(top_k) != top_k or top_k < 0):
        raise ValueError(f"top_k must be a non-negative int (0 disables), got {top_k}")
    B, V = logits.shape
    dev = logits.device
    # generate() upcasts the last-token logits to fp32 before any processor runs.
    scores = logits.float()

    # Temperature. A Python scalar divides exactly like TemperatureLogitsWarper (same op, same rounding).
    if isinstance(temperature, torch.Tensor):
        t = _row_knob(temperature, "temperature", B, dev, torch.float32)
        scores = scores / torch.where(t > 0, t, torch.ones_like(t))
    elif temperature > 0 and temperature != 1.0:
        scores = scores / float(temperature)

    k_tensor = isinstance(top_k, torch.Tensor)
    p_tensor = isinstance(top_p, torch.Tensor)
    need_k = k_tensor or 0 < top_k < V
    need_p = p_tensor or top_p < 1.0

    if need_k and not need_p and not k_tensor:
        # One k for the batch: torch.topk's k-th value is exactly HF's threshold.
        kth = torch.topk(scores, int(top_k), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, _NEG_INF)
    elif need_k or need_p:
        # One ascending sort serves both filters: top-k masks a prefix, so the sorted order survives it.
        sorted_vals, sorted_idx = torch.sort(scores, dim=-1, descending=False)
        if need_k:
            if k_tensor:
                k = _row_knob(top_k, "top_k", B, dev, torch.int64)
                k = torch.where(k > 0, k, torch.full_like(k, V)).clamp(1, V)
            else:
                k = torch.full((B, 1), min(int(top_k), V), device=dev, dtype=torch.int64)
            kth = sorted_vals.gather(-1, V - k)
            sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, _NEG_INF)
        if need_p:
            cum = sorted_vals.softmax(dim=-1).cumsum(dim=-1)
            if p_tensor:
                p = _row_knob(top_p, "top_p", B, dev, torch.float64)
                # 1 - p in float64 then rounded, like HF's Python-float threshold; p >= 1 rows must keep everything
                # (even tokens whose probability underflows to 0), as HF would not run the warper at all.
                remove = (cum <= (1.0 - p).float()) & (p < 1.0)
            else:
                remove = cum <= (1.0 - float(top_p))
            remove[:, -1] = False  # min_tokens_to_keep=1: the most likely token always stays
            sorted_vals = sorted_vals.masked_fill(remove, _NEG_INF)
        scores = torch.empty_like(sorted_vals).scatter_(-1, sorted_idx, sorted_vals)

    if isinstance(min_p, torch.Tensor) or min_p > 0.0:
        probs = scores.softmax(dim=-1)
        mp = _row_knob(min_p, "min_p", B, dev, torch.float32) if isinstance(min_p, torch.Tensor) else float(min_p)
        # The top token always passes (its prob >= min_p * itself), which is HF's min_tokens_to_keep=1.
        scores = scores.masked_fill(probs < mp * probs.amax(dim=-1, keepdim=True), _NEG_INF)
    return scores


def sample_torch(
    logits: torch.Tensor,
    temperature: Knob,
    top_k: Knob,
    top_p: Knob,
    min_p: Knob,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Reference (and production) sampler; see :func:`sample`."""
    if not isinstance(temperature, torch.Tensor) and temperature <= 0:
        # Greedy for the whole batch (greedy search applies no warpers).
        check_tensor("logits", logits, ndim=2)
        return logits.argmax(dim=-1)
    scores = filter_logits(logits, temperature, top_k, top_p, min_p)
    noise = torch.empty_like(scores).exponential_(generator=generator)
    # Clamp so log(0) cannot turn a removed token's -inf into NaN; p_i / E_i as logit_i - log E_i.
    race = scores - noise.clamp_min_(torch.finfo(torch.float32).tiny).log_()
    picked = race.argmax(dim=-1)
    if isinstance(temperature, torch.Tensor):
        t = _row_knob(temperature, "temperature", logits.shape[0], logits.device, torch.float32).squeeze(1)
        picked = torch.where(t > 0, picked, logits.argmax(dim=-1))
    return picked


def sample(
    logits: torch.Tensor,
    temperature: Knob,
    top_k: Knob,
    top_p: Knob,
    min_p: Knob,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one token per row of ``logits [B, V]``; returns ``[B]`` int64.

    Knobs are Python scalars or per-row tensors ``[B]``: ``temperature <= 0`` is greedy (argmax of the raw logits)
    for that row; ``top_k=0``, ``top_p=1.0`` and ``min_p=0.0`` disable their filter. Filters apply in HF
    ``generate`` order (temperature, top-k, top-p, min-p; see :func:`filter_logits`). No host syncs, so it is
    CUDA-graph capturable; pass ``generator`` for reproducible draws. Always runs on torch ops (every backend).
    """
    return sample_torch(logits, temperature, top_k, top_p, min_p, generator)
