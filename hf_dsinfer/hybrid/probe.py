"""The ``logp_diff`` probe: do the engine's rollouts come from the weights being trained?

At each ``eval()`` (whether it refreshed or not), the first ``generate`` call's first ``rows`` rows are scored twice,
teacher-forced: by the inference copy and by the training model (eval mode, no gradients). The probe is the mean
absolute difference of the two log-probabilities of the generated tokens, ``log_softmax(logits / T)`` at each
sampled token. Equal weights give fp32 noise (or the inference dtype's rounding); a stale or wrongly fused copy shows
at once as a large value.
"""

from __future__ import annotations

from typing import Any

import torch


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows (``mask [B, T]`` -> ``[B, T]``), as ``generate`` computes them."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _token_logps(model: Any, seqs: torch.Tensor, mask: torch.Tensor, width: int, temperature: float) -> torch.Tensor:
    """``[B, N]`` fp32 log-probs of the generated tokens ``seqs[:, width:]`` under ``model`` (teacher forcing)."""
    param = next(model.parameters(), None)
    if param is not None and param.device != seqs.device:
        seqs, mask = seqs.to(param.device), mask.to(param.device)
    out = model(input_ids=seqs, attention_mask=mask, position_ids=_positions(mask), use_cache=False)
    logits = out.logits[:, width - 1 : -1].float() / temperature  # [B, N, V]: position t predicts token t + 1
    return torch.log_softmax(logits, dim=-1).gather(-1, seqs[:, width:, None]).squeeze(-1)


@torch.no_grad()
def logp_diff(
    inference_model: Any,
    training_model: Any,
    sequences: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: int,
    temperature: float = 1.0,
) -> float | None:
    """Mean |engine - training| log-prob of the generated tokens of the first ``rows`` rows of ``sequences``.

    ``sequences [B, P + N]``: ``generate``'s output (prompt then new tokens); ``prompt_mask [B0, P]``: the prompts'
    attention mask (``B0`` divides ``B`` under ``num_return_sequences``). None when there is nothing to compare (no
    new token, or the shapes do not line up).
    """
    if rows < 1 or sequences.dim() != 2:
        return None
    width = prompt_mask.shape[1]
    if width >= sequences.shape[1] or sequences.shape[0] % prompt_mask.shape[0]:
        return None
    mask = prompt_mask.repeat_interleave(sequences.shape[0] // prompt_mask.shape[0], 0)[:rows]
    seqs = sequences[:rows]
    mask = torch.cat([mask.to(seqs.device), torch.ones_like(seqs[:, width:])], dim=1)  # [R, P + N]
    engine = _token_logps(inference_model, seqs, mask, width, temperature)
    trained = _token_logps(training_model, seqs, mask, width, temperature)
    return float((engine.cpu() - trained.cpu()).abs().mean())
