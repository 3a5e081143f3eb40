"""Per-token log-probs from the fused fast loop: ``output_scores`` / ``output_logits`` with
``return_dict_in_generate`` return what HF returns, so ``compute_transition_scores(..., normalize_logits=True)`` gives
the sampled tokens' log-probs equal to the training model's ``log_softmax(logits / T)`` (fp32, padded batch, greedy
and seeded sampling); and the Hybrid Engine's ``logp_diff`` probe (off by default) that shows stale weights."""

from __future__ import annotations

import pytest
import torch
from tiny_models import PAD, build_tiny, left_pad, prompts

from hf_dsinfer.generation.stats import last_generate_stats
from hf_dsinfer.hybrid import HybridEngine

NEW = 7


@pytest.fixture(scope="module")
def model():
    return build_tiny("llama", seed=0)


@pytest.fixture(scope="module")
def engine(model):
    return HybridEngine(model, inference_config={"max_out_tokens": 64, "cpu_compile": False})


def _training_logps(model, seqs: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[B, N]`` log_softmax(logits / T) of the generated tokens under the training model (teacher forcing)."""
    width = mask.shape[1]
    full = torch.cat([mask, torch.ones_like(seqs[:, width:])], dim=1)
    positions = (full.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=seqs, attention_mask=full, position_ids=positions).logits
    logps = torch.log_softmax(logits[:, width - 1 : -1].float() / temperature, dim=-1)
    return logps.gather(-1, seqs[:, width:, None]).squeeze(-1), logits[:, width - 1 : -1]


@pytest.mark.parametrize("do_sample", [False, True])
def test_transition_scores_equal_training_log_probs(model, engine, do_sample):
    ids, mask = left_pad(prompts((5, 9, 3, 7)))
    temperature = 0.7 if do_sample else 1.0
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=do_sample, pad_token_id=PAD,
               eos_token_id=None, output_scores=True, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    if do_sample:
        gen.update(temperature=temperature, top_k=0, top_p=1.0)  # TRL's defaults: the scores are logits / T
    torch.manual_seed(3)
    with engine.inference():
        out = engine.generate(**gen)
    assert last_generate_stats(engine.module).path == "fast", "the request ran on the fused fast loop"
    assert len(out.scores) == len(out.logits) == NEW and out.scores[0].shape == (4, model.config.vocab_size)
    got = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)  # [B, N]
    want, logits = _training_logps(model, out.sequences, mask, temperature)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    torch.testing.assert_close(torch.stack(out.logits, 1), logits, rtol=0, atol=2e-5)  # raw logits, as HF's
    if not do_sample:  # greedy: HF's own generate returns the same tokens, scores and logits
        ref = model.generate(**gen)
        assert torch.equal(ref.sequences, out.sequences)
        for a, b in zip(ref.scores, out.scores, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def test_num_return_sequences_scores(model, engine):
    ids, mask = left_pad(prompts((4, 6)))
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=0, pad_token_id=PAD,
               eos_token_id=None, num_return_sequences=3, output_scores=True, return_dict_in_generate=True)  # fmt: skip
    torch.manual_seed(5)
    out = engine.generate(**gen)
    got = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    want, _ = _training_logps(model, out.sequences, mask.repeat_interleave(3, 0), 1.0)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_logp_diff_probe_shows_stale_weights():
    model = build_tiny("llama", seed=1)
    ids, mask = left_pad(prompts((5, 9, 3)))
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=PAD)
    off = HybridEngine(model, inference_config={"max_out_tokens": 64, "cpu_compile": False})
    off.generate(**gen)
    assert off.stats.last.logp_diff is None, "off by default"
    he = HybridEngine(model, inference_config={"max_out_tokens": 64, "cpu_compile": False}, logp_probe_rows=2)
    he.eval()
    he.generate(**gen)
    fresh = he.stats.last.logp_diff
    assert fresh is not None and fresh < 1e-4, fresh
    he.train()
    with torch.no_grad():  # a training step the engine does not see (refresh="always" would copy it at eval())
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    he.refresh_policy = "auto"
    he._fingerprint = he._current_fingerprint()  # pretend nothing changed: the copy stays stale
    he.eval()
    assert not he.stats.last.refreshed
    he.generate(**gen)
    stale = he.stats.last.logp_diff
    assert stale is not None and stale > 100 * max(fresh, 1e-6), (fresh, stale)
    assert "hybrid/logp_diff" in he.stats.log_dict()
    he.train()
