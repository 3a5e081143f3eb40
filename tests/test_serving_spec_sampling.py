"""Speculation for sampled requests and from a draft model (hf_dsinfer.serving.speculation / .draft).

The distribution: on a fake target over 8 tokens (the logits after a token are a fixed row of a random matrix) with
temperature, top-k and a repetition penalty (so position 2's probabilities depend on the accepted token), the first two
tokens that verification of fixed proposals emits, over 6000 seeds, match the exact joint distribution computed with
transformers' own processors (chi-square), and match plain sampling seed for seed; accepting every proposal fails the
same test (the test has power). Then on tiny random Llamas: seeded sampled requests keep their text with n-gram
speculation, alone and in a batch; a smaller draft model gives plain greedy's tokens (and sampled requests their
seeded text); the target as its own draft has every proposal accepted; a draft with another vocabulary is refused;
a draft without a policy runs unfused; the stats and /metrics count sampled and draft-model speculation.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from tiny_models import PAD, load_pair, prompts, save_tiny

import hf_dsinfer  # noqa: F401 - registers inference_config=
from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.serving import ServingEngine
from hf_dsinfer.serving.requests import SamplingParams, Sequence
from hf_dsinfer.serving.sampling import select_tokens
from hf_dsinfer.serving.speculation import verify

pytestmark = pytest.mark.usefixtures("one_thread")

V = 8
W = torch.randn(V, V, generator=torch.Generator().manual_seed(3)) * 1.5  # logits of the token after token i: W[i]
PROMPT = [1, 4]
DRAFT = [3, 6]  # fixed proposals: x1 = 3 (p = 0.27), then x2 = 6 (p = 0.61 after 3)
KNOBS = dict(do_sample=True, temperature=0.8, top_k=6, repetition_penalty=1.4)
TRIALS = 6000


def seq_for(seed: int) -> Sequence:
    params = SamplingParams(max_new_tokens=4, eos_token_ids=frozenset(), seed=seed, **KNOBS)
    return Sequence(request_id=str(seed), prompt=list(PROMPT), params=params, handle=None)


def exact_joint() -> torch.Tensor:
    """``[V, V]``: P(t1, t2) under transformers' processors (the oracle): penalty, temperature, top-k."""
    procs = transformers.LogitsProcessorList([
        transformers.RepetitionPenaltyLogitsProcessor(KNOBS["repetition_penalty"]),
        transformers.TemperatureLogitsWarper(KNOBS["temperature"]),
        transformers.TopKLogitsWarper(KNOBS["top_k"]),
    ])  # fmt: skip

    def probs(tokens: list[int]) -> torch.Tensor:
        return torch.softmax(procs(torch.tensor([tokens]), W[tokens[-1]][None].clone())[0].double(), -1)

    p1 = probs(PROMPT)
    return torch.stack([p1[a] * probs([*PROMPT, a]) for a in range(V)])


def first_two_speculative(seed: int, accept_all: bool = False) -> tuple[int, int]:
    seq = seq_for(seed)
    rows = W[[seq.tokens[-1], *DRAFT]]  # [3, V]: after the last token, after x1, after x2
    accepted: dict[int, int] = {}
    token = verify(rows, [(seq, DRAFT)], accepted)[id(seq)]
    out = DRAFT[: accepted[id(seq)]] + [token]
    if accept_all:
        out = DRAFT
    if len(out) < 2:  # only the first token came out of this step: the next plain step draws the second
        seq.tokens.append(out[0])
        seq.generated += 1
        out.append(select_tokens(W[[out[0]]], [seq])[0])
    return out[0], out[1]


def first_two_plain(seed: int) -> tuple[int, int]:
    seq = seq_for(seed)
    out = []
    for _ in range(2):
        out.append(select_tokens(W[[seq.tokens[-1]]], [seq])[0])
        seq.tokens.append(out[-1])
        seq.generated += 1
    return out[0], out[1]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells of expected count >= 5 (the rest pooled), and its degrees of freedom."""
    expected = probs.flatten() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts.flatten()[big], counts.flatten()[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def chi_square_bound(dof: int) -> float:
    """A bound the statistic exceeds with probability about 1e-4 (Wilson-Hilferty)."""
    z = 3.72
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_sampled_verification_keeps_the_target_distribution():
    joint = exact_joint()
    assert joint[DRAFT[0]].sum() > 0.2 and 0.2 < joint[DRAFT[0], DRAFT[1]] / joint[DRAFT[0]].sum() < 0.8, (
        "the proposals must be accepted sometimes and rejected sometimes for the test to mean something"
    )
    counts, plain_counts, naive = (torch.zeros(V, V, dtype=torch.float64) for _ in range(3))
    for seed in range(TRIALS):
        spec = first_two_speculative(seed)
        assert spec == first_two_plain(seed), f"seed {seed}: speculation changed a seeded request's tokens"
        counts[spec] += 1
        naive[first_two_speculative(seed, accept_all=True)] += 1
    stat, dof = chi_square(counts, joint)
    assert stat < chi_square_bound(dof), f"chi-square {stat:.1f} over {dof} degrees of freedom"
    tv = 0.5 * float((counts / TRIALS - joint).abs().sum())
    assert tv < 0.05, f"total variation {tv:.3f}"
    assert chi_square(naive, joint)[0] > 10 * chi_square_bound(dof), "accepting every proposal must fail the test"


# -- on tiny random Llamas ---------------------------------------------------------------------------------------

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 96}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    _, opt, path = load_pair("llama", tmp_path_factory.mktemp("target"), INJECT)
    return opt, path


def config(n: int, **kw) -> transformers.GenerationConfig:
    return transformers.GenerationConfig(max_new_tokens=n, pad_token_id=PAD, eos_token_id=-1, **kw)


def requests() -> list[tuple[list[int], transformers.GenerationConfig, dict]]:
    a, b, c = prompts((7, 5, 9), seed=21)
    return [
        (a * 4, config(20, do_sample=True, temperature=0.05), dict(seed=1)),  # near-greedy: proposals accepted
        (b * 5, config(20, do_sample=True, temperature=1.0, top_p=0.9), dict(seed=2)),  # mostly rejected
        (a * 3, config(20, do_sample=True, temperature=0.3, top_k=20), dict(seed=3, presence_penalty=0.4)),
        (c * 3, config(20), dict(repetition_penalty=1.2)),
        (c * 2, config(20), {}),
    ]


def run(opt, reqs, speculative_config=None, **kw):
    engine = ServingEngine(opt, block_size=4, speculative_config=speculative_config, **kw)
    handles = [engine.submit(p, cfg, **over) for p, cfg, over in reqs]
    engine.run_until_idle()
    engine.runner.blocks.check()
    assert all(h.finish_reason == "length" for h in handles), [h.error for h in handles]
    return [h.tokens for h in handles], engine.stats


def test_seeded_sampled_requests_keep_their_text_with_ngram_speculation(llama):
    opt, _ = llama
    reqs = requests()
    plain, _ = run(opt, reqs)
    together, stats = run(opt, reqs, NGRAM, max_batch_tokens=24)
    alone = [run(opt, [r], NGRAM)[0][0] for r in reqs[:3]]
    assert together == plain
    assert alone == plain[:3]
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    small = save_tiny("llama", tmp_path_factory.mktemp("draft"), seed=5, num_hidden_layers=1, hidden_size=48,
                      intermediate_size=64, num_attention_heads=3, num_key_value_heads=1)  # fmt: skip
    other = save_tiny("llama", tmp_path_factory.mktemp("other"), seed=5, num_hidden_layers=1, vocab_size=400)
    return small, other


def test_a_draft_model_gives_plain_decodings_tokens(llama, drafts):
    opt, path = llama
    small, _ = drafts
    reqs = requests()
    plain, _ = run(opt, reqs)
    spec, stats = run(opt, reqs, {"model": small, "num_speculative_tokens": 3}, max_batch_tokens=24)
    assert spec == plain
    assert stats.spec_decode_num_draft_tokens > 0
    # a cache too small for all at once: decodes preempt, and the draft's cache (as many blocks) runs short too
    tight, stats = run(opt, reqs, {"model": small, "num_speculative_tokens": 3}, num_blocks=40, max_batch_tokens=16)
    assert tight == plain and stats.preemptions > 0 and stats.spec_decode_num_draft_tokens > 0
    # the target as its own draft: every proposal is the target's greedy token, so the greedy ones are all accepted
    greedy = [r for r in reqs if not r[1].do_sample and not r[2]]
    same, stats = run(opt, greedy, {"model": path, "num_speculative_tokens": 3})
    assert same == [plain[reqs.index(r)] for r in greedy]
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused(llama, drafts):
    opt, _ = llama
    _, other = drafts
    with pytest.raises(ValueError, match="speculative_config model=.*vocabulary has 400 tokens, the target's 500"):
        ServingEngine(opt, speculative_config={"model": other, "num_speculative_tokens": 2})


def test_a_draft_without_a_policy_runs_unfused_with_a_warning(llama, tmp_path, caplog):
    from tiny_models import make_tokenizer

    opt, _ = llama
    config = transformers.PhiConfig(vocab_size=500, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=3, max_position_embeddings=256, pad_token_id=PAD)  # fmt: skip
    torch.manual_seed(0)
    transformers.PhiForCausalLM(config).save_pretrained(tmp_path)  # phi (not phi3): no policy
    make_tokenizer().save_pretrained(tmp_path)
    reqs = [r for r in requests() if not r[1].do_sample]
    plain, _ = run(opt, reqs)
    with caplog.at_level("WARNING", logger=LOGGER_NAME):
        spec, stats = run(opt, reqs, {"model": str(tmp_path), "num_speculative_tokens": 2})
    assert spec == plain and stats.spec_decode_num_draft_tokens > 0
    assert "runs unfused" in caplog.text


def test_stats_and_metrics_count_sampled_and_draft_speculation(llama):
    pytest.importorskip("prometheus_client")
    from hf_dsinfer.serving.metrics import ServerMetrics

    opt, path = llama
    sampled_only = [r for r in requests() if r[1].do_sample]
    for cfg in (NGRAM, {"model": path, "num_speculative_tokens": 3}):
        engine = ServingEngine(opt, block_size=4, speculative_config=cfg)
        for prompt, config_, over in sampled_only:
            engine.submit(prompt, config_, **over)
        engine.run_until_idle()
        stats = engine.stats
        assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0, cfg
        body = ServerMetrics(engine, "tiny", 96).render()[0].decode()
        for name in ("drafts", "draft_tokens", "accepted_tokens"):
            value = float(getattr(stats, f"spec_decode_num_{name}"))
            assert f'hf_dsinfer:spec_decode_num_{name}_total{{model_name="tiny"}} {value}' in body, name


def test_generate_batch_speculates_sampled_prompt_lookup_and_an_assistant_model(llama, drafts):
    from hf_dsinfer.serving.hf_api import last_batch_stats

    opt, path = llama
    small, _ = drafts
    reqs = [p for p, _, _ in requests()]
    greedy = config(16)
    plain = opt.generate_batch(reqs, generation_config=greedy)
    assistant = transformers.AutoModelForCausalLM.from_pretrained(small, inference_config=INJECT).eval()
    greedy.num_assistant_tokens = 3
    drafted = opt.generate_batch(reqs, generation_config=greedy, assistant_model=assistant)
    assert [o.generated_tokens for o in drafted.values()] == [o.generated_tokens for o in plain.values()]
    assert last_batch_stats(opt).spec_decode_num_draft_tokens > 0
    # sampled with prompt lookup: near-greedy on prompts that repeat themselves, so proposals are found and kept
    lookup = config(16, do_sample=True, temperature=0.05, prompt_lookup_num_tokens=3)
    out = opt.generate_batch(reqs, generation_config=lookup)
    assert all(o.error is None and len(o.generated_tokens) == 16 for o in out.values())
    stats = last_batch_stats(opt)
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens > 0
