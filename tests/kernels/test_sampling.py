"""Sampling: masks equal to HF's logits warpers, per-row knobs, greedy rows, seeded reproducibility, statistics."""

import pytest
import torch
from hf_dsinfer.kernels.sampling import filter_logits, sample, sample_torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# (temperature, top_k, top_p, min_p): each filter alone, combinations, and configs that make filters interact.
CONFIGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.0, 5, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.6, 10, 0.9, 0.0),
    (1.3, 20, 0.5, 0.05),
    (0.9, 0, 0.95, 0.2),
    (2.0, 3, 0.3, 0.0),
    (0.5, 40, 0.99, 0.01),
    (1.0, 1000, 0.0, 0.0),  # top_k >= V; top_p = 0 keeps exactly the best token
]


def hf_filter(logits, temperature, top_k, top_p, min_p):
    """HF's warpers, added exactly when generate's _get_logits_processor adds them, in its order."""
    warpers = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=1))
    scores = logits.float()
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)
    for w in warpers:
        scores = w(ids, scores)
    return scores


def _logits(B, V, device, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(B, V, generator=g)).to(device)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_filter_matches_hf_warpers(device, cfg):
    logits = _logits(6, 97, device, seed=hash(cfg) % 1000)
    got = filter_logits(logits, *cfg)
    want = hf_filter(logits, *cfg)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    keep = ~torch.isinf(want)
    assert keep.any(dim=-1).all()
    torch.testing.assert_close(got[keep], want[keep])


def test_top_k_keeps_ties_like_hf(device):
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0], [5.0, 5.0, 5.0, 1.0, 1.0, 1.0]], device=device)
    for k in (1, 2, 3, 4):
        got = filter_logits(logits, 1.0, k, 1.0, 0.0)
        assert torch.equal(torch.isinf(got), torch.isinf(hf_filter(logits, 1.0, k, 1.0, 0.0)))
        # The tensor-knob path (sorted domain) agrees with the scalar path (topk).
        got_t = filter_logits(logits, 1.0, torch.tensor([k, k], device=device), 1.0, 0.0)
        assert torch.equal(torch.isinf(got_t), torch.isinf(got))


def test_per_row_knobs_equal_per_row_scalars(device):
    B, V = len(CONFIGS), 80
    logits = _logits(B, V, device, seed=7)
    t = torch.tensor([c[0] for c in CONFIGS], device=device)
    k = torch.tensor([c[1] for c in CONFIGS], device=device)
    # float64 top_p gives the exact threshold HF computes from a Python float.
    p = torch.tensor([c[2] for c in CONFIGS], dtype=torch.float64, device=device)
    m = torch.tensor([c[3] for c in CONFIGS], device=device)
    got = filter_logits(logits, t, k, p, m)
    for i, cfg in enumerate(CONFIGS):
        want = hf_filter(logits[i : i + 1], *cfg)
        assert torch.equal(torch.isinf(got[i : i + 1]), torch.isinf(want)), f"row {i} config {cfg}"
        keep = ~torch.isinf(want)
        torch.testing.assert_close(got[i : i + 1][keep], want[keep])


def test_disabling_values_are_noops(device):
    logits = _logits(3, 50, device, seed=3, scale=30.0)  # wide range: some probabilities underflow to 0
    B = logits.shape[0]
    got = filter_logits(
        logits,
        torch.ones(B, device=device),
        torch.zeros(B, dtype=torch.long, device=device),
        torch.ones(B, device=device),
        torch.zeros(B, device=device),
    )
    assert torch.equal(got, logits.float())
    assert torch.equal(filter_logits(logits, 1.0, 0, 1.0, 0.0), logits.float())


def test_greedy_when_temperature_not_positive(device):
    logits = _logits(5, 64, device, seed=4)
    gen = torch.Generator(device=device).manual_seed(0)
    assert torch.equal(sample(logits, 0.0, 0, 1.0, 0.0, gen), logits.argmax(-1))
    assert torch.equal(sample(logits, -1.0, 5, 0.5, 0.1, gen), logits.argmax(-1))
    # Per-row: rows 0 and 3 greedy, the others sample from a flat distribution (greedy would be a coincidence).
    flat = torch.zeros(5, 64, device=device)
    flat[:, 17] = 1e-3  # argmax of every row is 17, but sampling rows pick nearly uniformly
    temps = torch.tensor([0.0, 1.0, 1.0, -2.0, 1.0], device=device)
    picks = torch.stack([sample(flat, temps, 0, 1.0, 0.0, gen) for _ in range(20)])
    assert (picks[:, [0, 3]] == 17).all()
    assert (picks[:, [1, 2, 4]] != 17).any()
    assert picks.dtype == torch.int64 and picks.shape == (20, 5)


def test_seeded_reproducibility(device):
    logits = _logits(64, 100, device, seed=5, scale=1.0)
    runs = [sample(logits, 0.8, 50, 0.9, 0.02, torch.Generator(device=device).manual_seed(s)) for s in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    # The generator's state advances: two draws from one generator differ.
    gen = torch.Generator(device=device).manual_seed(1)
    first = sample(logits, 0.8, 50, 0.9, 0.02, gen)
    assert torch.equal(first, runs[0])
    assert not torch.equal(sample(logits, 0.8, 50, 0.9, 0.02, gen), first)


@pytest.mark.parametrize("cfg", [(1.0, 4, 1.0, 0.0), (1.5, 0, 0.7, 0.0), (1.0, 0, 1.0, 0.3), (1.2, 8, 0.9, 0.05)])
def test_samples_only_allowed_tokens_with_filtered_frequencies(device, cfg):
    V, draws = 30, 4000
    logits = _logits(1, V, device, seed=6, scale=1.5)
    filtered = hf_filter(logits, *cfg)[0]
    allowed = ~torch.isinf(filtered)
    assert 1 < allowed.sum() < V  # the config really filters something and leaves a choice
    gen = torch.Generator(device=device).manual_seed(123)
    picks = sample(logits.expand(draws, V), *cfg, generator=gen)
    assert allowed[picks].all(), "sampled a token the filters removed"
    freq = torch.bincount(picks, minlength=V).float() / draws
    probs = filtered.softmax(-1)
    # 4000 draws: every token's frequency within ~5 standard deviations of its filtered probability.
    sd = (probs * (1 - probs) / draws).sqrt()
    assert ((freq - probs).abs() <= 5 * sd + 1e-3).all(), (freq, probs)


def test_bf16_logits_and_shapes(device):
    logits = _logits(3, 41, device, seed=8).to(torch.bfloat16)
    out = sample_torch(logits, 0.9, 5, 0.9, 0.0, torch.Generator(device=device).manual_seed(0))
    assert out.shape == (3,) and out.dtype == torch.int64
    allowed = ~torch.isinf(hf_filter(logits, 0.9, 5, 0.9, 0.0))
    assert allowed.gather(1, out[:, None]).all()


def test_rejects_bad_knobs(device):
    logits = _logits(2, 10, device)
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, 1.0, 0, 1.5, 0.0)
    with pytest.raises(ValueError, match="min_p"):
        sample(logits, 1.0, 0, 1.0, -0.1)
    with pytest.raises(ValueError, match="top_k"):
        sample(logits, 1.0, -3, 1.0, 0.0)
    with pytest.raises(ValueError, match="top_k"):
        sample(logits, 1.0, torch.tensor([1, 2, 3], device=device), 1.0, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, torch.ones(3, device=device), 0, 1.0, 0.0)
    with pytest.raises(ValueError, match="logits"):
        sample(logits[0], 1.0, 0, 1.0, 0.0)


@pytest.mark.cuda
def test_cuda_no_host_sync_and_graph_capture():
    dev = torch.device("cuda")
    logits = _logits(4, 1000, dev, seed=9)
    t = torch.full((4,), 0.8, device=dev)
    k = torch.full((4,), 20, device=dev)
    p = torch.full((4,), 0.9, device=dev)
    m = torch.full((4,), 0.05, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, t, k, p, m, gen)
        sample(logits, 0.7, 20, 0.9, 0.05, gen)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sample(logits, t, k, p, m)  # warm up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample(logits, t, k, p, m)
    t.zero_()  # switch every row to greedy without recapturing
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, logits.argmax(-1))
