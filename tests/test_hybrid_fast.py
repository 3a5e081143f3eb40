"""The Hybrid Engine's inference copy decodes with hf_dsinfer's fast loop: greedy equals HF ``generate`` on the
training model, sampling has HF's distribution (``sampling="fast"``) or HF's exact draws (``sampling="hf"``), and
the weights a captured graph would read are refreshed in place."""

from __future__ import annotations

import pytest
import torch
from tiny_models import PAD, build_tiny, left_pad, prompts

from hf_dsinfer.generation.api import GEN_ATTR
from hf_dsinfer.generation.stats import last_generate_stats
from hf_dsinfer.hybrid import HybridEngine
from hf_dsinfer.policies import get_injection

CFG = {"max_out_tokens": 64}


pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(**kw) -> dict:
    ids, mask = left_pad(prompts((5, 9, 3)))
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD, **kw)


def test_engine_generates_with_the_fast_loop_and_equals_hf_greedy():
    model = build_tiny("llama", seed=0)
    model.train()
    he = HybridEngine(model, inference_config=CFG)
    assert getattr(he.module, GEN_ATTR).step is not None, "the fast loop should be installed on the inference copy"
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = _gen(do_sample=False)
    for _ in range(2):  # across an optimizer step: refreshed weights, same decode step objects
        with he.inference():
            out = he.generate(**gen)
            assert last_generate_stats(he.module).path == "fast"
        model.eval()
        assert torch.equal(out, model.generate(**gen))
        model.train()
        model(input_ids=gen["input_ids"], labels=gen["input_ids"]).loss.backward()
        opt.step()
        opt.zero_grad()


def test_sampling_hf_reproduces_hf_draws_and_fast_is_seeded():
    model = build_tiny("llama", seed=0).eval()
    gen = _gen(do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(3)
    expected = model.generate(**gen)
    he_hf = HybridEngine(model, inference_config=CFG, sampling="hf")
    torch.manual_seed(3)
    assert torch.equal(he_hf.generate(**gen), expected)
    he_hf.generate(**_gen(do_sample=False))
    assert last_generate_stats(he_hf.module).path == "fast", "greedy requests keep the fast loop with sampling='hf'"

    he = HybridEngine(model, inference_config=CFG)
    torch.manual_seed(3)
    first = he.generate(**gen)
    torch.manual_seed(3)
    assert torch.equal(he.generate(**gen), first), "the fast loop's draws are seeded from torch's global RNG"
    with pytest.raises(ValueError, match="sampling='nope'"):
        HybridEngine(model, inference_config=CFG, sampling="nope")


def test_fast_sampling_has_hf_distribution():
    """First sampled token over many copies of one prompt: the frequencies match HF's warped softmax."""
    model = build_tiny("llama", seed=0).eval()
    rows = 3000
    ids = torch.tensor([prompts((6,))[0]])
    warp = dict(top_k=8, temperature=0.7)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1] / warp["temperature"]
    top = logits.topk(warp["top_k"])
    probs = torch.zeros_like(logits).scatter_(0, top.indices, top.values.softmax(-1))
    he = HybridEngine(model, inference_config={"max_out_tokens": 16, "max_batch_size": rows})
    torch.manual_seed(0)
    batch = ids.expand(rows, -1)
    out = he.generate(input_ids=batch, attention_mask=torch.ones_like(batch), max_new_tokens=1, do_sample=True,
                      pad_token_id=PAD, **warp)  # fmt: skip
    freq = torch.bincount(out[:, -1], minlength=logits.shape[0]).float() / rows
    assert set(out[:, -1].tolist()) <= set(top.indices.tolist()), "a token outside top-k was drawn"
    assert 0.5 * (freq - probs).abs().sum() < 0.05  # total variation; ~0.02 expected at 3000 draws


def test_release_cache_drops_decode_graphs_and_cache():
    model = build_tiny("llama", seed=0)
    he = HybridEngine(model, inference_config={**CFG, "enable_cuda_graph": True}, release_inference_cache=True)
    state = getattr(he.module, GEN_ATTR)
    assert state.graphs is not None, "enable_cuda_graph builds the per-bucket decode graphs (captured on CUDA)"
    cache = get_injection(he.module).runtime.cache
    resets = []

    class CapturedRunner:  # stands in for a GraphRunner captured on CUDA (graphs are never captured on CPU)
        def reset(self) -> None:
            resets.append(True)

    with he.inference():
        he.generate(**_gen(do_sample=False))
        assert cache.keys
        state.graphs.runner = CapturedRunner()
    assert not cache.keys, "release_inference_cache=True frees the KV cache when leaving inference"
    assert resets and state.graphs.runner is None, "graphs over the freed cache must be dropped"


@pytest.mark.parametrize("block", [8, 256])
def test_cpu_draw_follows_softmax_and_never_picks_removed_tokens(monkeypatch, block):
    """The fast loop's CPU draw (one uniform per row against the float64 CDF, searched block then token,
    generation/processors.py): frequencies equal ``softmax(scores)`` within sampling noise, removed (-inf) tokens are
    never drawn, a seeded generator repeats its draws, a uniform rounding up to the total falls back to the last
    possible token, and a row with every token removed is refused as ``torch.multinomial`` (HF's draw) refuses it.
    Blocks of 8 put the 40 tokens in 5 blocks (one wholly removed, the last one partly padded past the vocabulary)."""
    from hf_dsinfer.generation import processors
    from hf_dsinfer.generation.processors import _inverse_cdf_draw

    monkeypatch.setattr(processors, "_DRAW_BLOCK", block)

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 40, generator=g) * 2
    scores[:, 5:15] = float("-inf")  # with blocks of 8, block 1 (8-15) has no probability at all
    scores[:, -3:] = float("-inf")  # trailing removed tokens: the fallback must not land on them
    n = 30_000
    draws = _inverse_cdf_draw(scores.repeat(n, 1), torch.Generator().manual_seed(1)).view(n, 3)  # [n, 3]
    freq = torch.stack([torch.bincount(draws[:, r], minlength=40) for r in range(3)]).float() / n  # [3, 40]
    probs = scores.softmax(dim=-1)
    assert freq[:, 5:15].sum() == 0 and freq[:, -3:].sum() == 0
    assert (freq - probs).abs().max() < 4 * (0.25 / n) ** 0.5  # 4 sigma of the worst-case binomial noise
    again = _inverse_cdf_draw(scores.repeat(n, 1), torch.Generator().manual_seed(1)).view(n, 3)
    assert torch.equal(draws, again)
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, 1.0, dtype=kw.get("dtype")))
    assert _inverse_cdf_draw(scores, None).tolist() == [36, 36, 36], "u == total: the last token with probability"
    monkeypatch.undo()
    monkeypatch.setattr(processors, "_DRAW_BLOCK", block)
    odd = _inverse_cdf_draw(scores[:, :37], torch.Generator().manual_seed(2))  # V not a multiple of the block
    assert ((odd < 37) & (scores[torch.arange(3), odd.clamp(max=36)] > float("-inf"))).all()
    with pytest.raises(RuntimeError, match="inf or nan"):
        _inverse_cdf_draw(torch.full((1, 8), float("-inf")), None)
