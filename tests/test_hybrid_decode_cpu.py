"""The eager CPU decode step the Hybrid Engine's copy runs at rollout batches (issue 35, GRPO shape): the attention's
batched-matmul path equals the kernels' store + decode attention, the GRPO shape's repeated prompts decode as HF does,
and the copy's LM head is row-major (re-packed at each switch without a transpose) yet still tied."""

from __future__ import annotations

import pytest
import torch
from hf_dsinfer.kernels import decode_attention, store_kv
from tiny_models import PAD, build_tiny, left_pad, prompts

from hf_dsinfer.hybrid import HybridEngine
from hf_dsinfer.modules.attention import StepContext, _cpu_decode_attend, _CPUDecodeStep

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("lengths", [(0, 3, 7, 7, 12), (6, 6, 6, 6, 6)])
def test_cpu_decode_attend_equals_store_and_decode_attention(window, lengths):
    """Rows of different lengths (a key mask) or equal ones (none), a sliding window, grouped query heads, a cache
    with more rows than the batch: the same cache contents and outputs as ``store_kv`` + ``decode_attention``."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hk, D, S = len(lengths), 6, 2, 16, 20
    kc, vc = torch.randn(B + 2, Hk, S, D, generator=g), torch.randn(B + 2, Hk, S, D, generator=g)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    cache_lens = torch.tensor(lengths, dtype=torch.int32)
    start = torch.zeros(B, dtype=torch.int32)
    qkv = torch.randn(B, 1, Hq + 2 * Hk, D, generator=g)  # a fused QKV output: q, k, v are strided views
    q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq : Hq + Hk], qkv[:, :, Hq + Hk :]
    ctx = StepContext(None, start, cache_lens, torch.zeros(B, dtype=torch.long), None, cache_lens + 1)
    step = _CPUDecodeStep.build(ctx, S, window)
    assert step and (step.bias is None) == (len(set(lengths)) == 1 and window is None)
    got = _cpu_decode_attend(q, k, v, kc, vc, step, 0.25)  # [B, 1, Hq, D]
    store_kv(k, v, kc_ref, vc_ref, cache_lens, start)
    want = decode_attention(q[:, 0], kc_ref, vc_ref, cache_lens + 1, 0.25, sliding_window=window)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    torch.testing.assert_close(got[:, 0], want, rtol=1e-5, atol=1e-6)


def test_cpu_decode_step_declines_padding_and_overflow():
    """A padding token in the step, or a slot past the cache: the general path (which skips or raises) runs."""
    lens = torch.tensor([2, 4], dtype=torch.int32)
    padded = StepContext(None, torch.tensor([0, 1], dtype=torch.int32), lens, None, None, lens + 1)
    assert _CPUDecodeStep.build(padded, 8, None) is False
    full = StepContext(None, torch.zeros(2, dtype=torch.int32), lens, None, None, lens + 1)
    assert _CPUDecodeStep.build(full, 4, None) is False  # row 1's new token would go to slot 4 of 4


def test_grpo_shaped_rollouts_equal_hf_greedy_with_a_row_major_tied_head():
    """Prompts repeated in a row (TRL's ``repeat_interleave``) at a batch that packs the linears: the engine's greedy
    tokens equal HF ``generate`` on the training model across an optimizer step (every weight changed and re-packed);
    the copy's head weight is row-major and still the embedding's parameter."""
    model = build_tiny("llama", seed=0, tie_word_embeddings=True)
    he = HybridEngine(model, inference_config={"max_out_tokens": 40, "max_batch_size": 8})
    head = he.module.get_output_embeddings().weight
    assert head.is_contiguous() and head is he.module.get_input_embeddings().weight
    ids, mask = left_pad(prompts((5, 9)))
    ids, mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)  # 2 prompts x 4 rows
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    outs = []
    for _ in range(2):
        with he.inference():
            outs.append(he.generate(**gen))
        model.eval()
        assert torch.equal(outs[-1], model.generate(**gen))
        model.train()
        model(input_ids=ids[::4], labels=ids[::4]).loss.backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(outs[0], outs[1]), "the update did not change the tokens (the test would prove nothing)"
