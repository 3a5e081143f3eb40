"""Speculative verification on the compiled CPU step (``DecodeStep.verifier``) against HF's plain greedy.

Prompt lookup and a fused draft verify ``1 + k`` tokens per forward; on CPU with ``cpu_compile`` that forward is one
``torch.compile``-d graph (proposals padded to ``k`` with fillers the cache then drops), and a step without proposals
runs the compiled decode step. The tokens stay plain greedy's. The suite runs with ``HF_DSINFER_CPU_COMPILE=0``
(conftest); these tests switch it on, on a one-layer model (compiling costs seconds per graph).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_dsinfer.kernels import decode_attention, prefill_attention, store_kv
from tiny_models import PAD, prompts, save_tiny

from hf_dsinfer import hf_compat
from hf_dsinfer.generation import last_generate_stats, speculative
from hf_dsinfer.generation.api import GEN_ATTR
from hf_dsinfer.modules.attention import AttentionSpec, StepContext, _sync_free_attend
from hf_dsinfer.policies.bloom import alibi_slopes

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 64}
NEW = 14
K = 5  # one verification graph (1 + K tokens) for every test here


@pytest.mark.parametrize("window, softcap, alibi", [(None, None, False), (5, None, False), (None, 7.0, False),
                                                    (None, None, True)])  # fmt: skip
@pytest.mark.parametrize("T", [1, 4])
def test_sync_free_attention_of_several_tokens_equals_the_kernels(T, window, softcap, alibi):
    """T tokens per row stored at ``cache_lens + t`` and attended causally, as ``store_kv`` + ``prefill_attention``
    (T = 1: as ``decode_attention``) compute it; GQA 6:2, rows of different lengths."""
    torch.manual_seed(0)
    B, Hq, Hk, D, S = 3, 6, 2, 8, 24
    slopes = torch.tensor(alibi_slopes(Hq)) if alibi else None
    spec = AttentionSpec(Hq, Hk, D, D**-0.5, rotary=False, sliding_window=window, softcap=softcap,
                         alibi_slopes=tuple(slopes.tolist()) if alibi else None)  # fmt: skip
    cache = torch.randn(2, B + 1, Hk, S, D)  # one spare row: the steps must leave it alone
    lens = torch.tensor([4, 9, 0], dtype=torch.int32)  # tokens cached before this step
    q, k, v = torch.randn(B, T, Hq, D), torch.randn(B, T, Hk, D), torch.randn(B, T, Hk, D)
    start = torch.zeros(B, dtype=torch.int32)
    ctx = StepContext(None, start, lens, torch.zeros(B * T), None, seq_lens=lens + 1 if T == 1 else None)
    ctx.attend_len = 15  # >= every row's length after the step
    got_k, got_v = cache[0].clone(), cache[1].clone()
    got = _sync_free_attend(q, k, v, got_k, got_v, ctx, spec, slopes)  # [B, T, Hq, D]
    want_k, want_v = cache[0].clone(), cache[1].clone()
    store_kv(k, v, want_k, want_v, lens, start)
    if T == 1:
        want = decode_attention(q[:, 0], want_k, want_v, lens + 1, D**-0.5, sliding_window=window, softcap=softcap,
                                alibi_slopes=slopes)[:, None]  # fmt: skip
    else:
        want = prefill_attention(q, want_k, want_v, lens, start, D**-0.5, sliding_window=window, softcap=softcap,
                                 alibi_slopes=slopes)  # fmt: skip
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_k, want_k)
    torch.testing.assert_close(got_v, want_v)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = save_tiny("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    opt = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=INJECT).eval()
    return ref, opt, path


@pytest.fixture
def compile_on(monkeypatch):
    monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", "sync")


def _greedy(model, ids, **kw):
    return model.generate(input_ids=ids, do_sample=False, pad_token_id=PAD, **{"max_new_tokens": NEW, **kw})


@pytest.fixture(scope="module")
def case(models):
    ref = models[0]
    ids = torch.tensor([prompts((7,))[0] * 3])  # a repeated prompt: lookups find matches
    return ids, _greedy(ref, ids)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lookup", "right", "wrong", "partly", "none"])
def test_compiled_verification_keeps_greedy_tokens(models, case, compile_on, monkeypatch, mode):
    _, opt, _ = models
    ids, want = case
    truth = want[0].tolist()
    if mode != "lookup":

        def propose(seq, k, max_ngram):
            follow = truth[len(seq) : len(seq) + k]
            if mode == "none":
                return []  # every step runs the compiled decode step
            if mode == "wrong":
                return [(t + 1) % 500 for t in follow]
            if mode == "partly":
                return follow[:2] + [(t + 1) % 500 for t in follow[2:]]
            return follow[:3]  # fewer than K: fillers pad the graph's input

        monkeypatch.setattr(speculative, "propose", propose)
    step = getattr(opt, GEN_ATTR).step

    def direct_steps() -> int:
        return sum(c.direct_steps for c in (step.compiled, *step._verifiers.values()) if c is not None)

    before = direct_steps()
    out = _greedy(opt, ids, prompt_lookup_num_tokens=K, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert last_generate_stats(opt).path == "fast+lookup"
    assert hf_compat.output_cache(out).get_seq_length() == want.shape[1] - 1  # as plain greedy leaves it
    if mode in ("wrong", "none"):  # one verification (or decode step) per token: most after the first run directly
        assert direct_steps() > before
    if mode == "none":
        assert step.compiled.compile_s, "the compiled decode step did not run"
    else:
        assert step._verifiers[1 + K].compile_s, "the compiled verification step did not run"
        assert not step._verifiers[1 + K].failed


@pytest.mark.slow
def test_compiled_verification_stops_at_eos_and_continues_like_hf(models, case, compile_on, monkeypatch):
    ref, opt, _ = models
    ids, want = case
    truth = want[0].tolist()
    eos = truth[ids.shape[1] + 4]  # the fifth new token ends the sequence
    monkeypatch.setattr(speculative, "propose", lambda seq, k, n: truth[len(seq) : len(seq) + k])
    out = _greedy(opt, ids, eos_token_id=eos, prompt_lookup_num_tokens=K, return_dict_in_generate=True)
    want_eos = _greedy(ref, ids, eos_token_id=eos, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want_eos.sequences)
    key = hf_compat.cache_kwarg()  # the cache the fillers passed through continues exactly
    more = _greedy(opt, out.sequences, max_new_tokens=4, **{key: hf_compat.output_cache(out)})
    assert torch.equal(more, _greedy(ref, want_eos.sequences, max_new_tokens=4,
                                     **{key: hf_compat.output_cache(want_eos)}))  # fmt: skip


@pytest.mark.slow
def test_compiled_verification_with_a_fused_draft(models, case, compile_on):
    _, opt, path = models
    ids, want = case
    draft = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=INJECT).eval()
    out = _greedy(opt, ids, assistant_model=draft, num_assistant_tokens=K)  # same weights: all proposals accepted
    assert torch.equal(out, want)
    assert last_generate_stats(opt).path == "fast+draft"
    assert getattr(opt, GEN_ATTR).step._verifiers[1 + K].compile_s


@pytest.mark.slow
def test_verification_near_the_end_of_the_cache_falls_back_to_the_forward(models, case, compile_on, monkeypatch):
    """A cache with no room for the padded ``1 + K`` tokens at the end: the last verifications run the model's forward
    (unpadded), the earlier ones the compiled step; the tokens are still plain greedy's."""
    _, _, path = models
    ids, want = case
    tight = transformers.AutoModelForCausalLM.from_pretrained(
        path, inference_config={**INJECT, "max_out_tokens": ids.shape[1] + NEW}
    ).eval()
    truth = want[0].tolist()
    monkeypatch.setattr(speculative, "propose", lambda seq, k, n: truth[len(seq) : len(seq) + min(k, 2)])
    calls = []
    forward = tight.forward  # the injected forward (bound)
    monkeypatch.setattr(tight, "forward", lambda *a, **kw: calls.append(kw["input_ids"].shape[1]) or forward(*a, **kw))
    assert torch.equal(_greedy(tight, ids, prompt_lookup_num_tokens=K), want)
    assert getattr(tight, GEN_ATTR).step._verifiers[1 + K].compile_s  # the compiled step ran ...
    # ... and the forward: the prefill, then the verifications at the end, unpadded (the last token + 2 proposals)
    assert calls[0] == ids.shape[1] and calls[1:] and all(n <= 3 for n in calls[1:]), calls
