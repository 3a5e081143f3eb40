"""The compiled CPU step called without dynamo's per-call guards inside one decoding loop (generation/direct_call.py).

The oracle is the same step with dynamo's guards on every call (``HF_DSINFER_CPU_GUARDS=every``) and HF's generate:
the same greedy tokens and logits, and what changes between ``generate`` calls (weights replaced or updated in place,
another bucket, the whole cache attended) still reaches the step.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import PAD, left_pad, prompts, save_tiny

from hf_dsinfer.generation import direct_call
from hf_dsinfer.generation.api import GEN_ATTR

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 40, "max_batch_size": 4}


@pytest.fixture
def compile_on(monkeypatch):
    monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", "sync")  # compiled in the calling thread: the first call runs it
    # One thread: no second (team) variant per bucket, whose first step would be guarded too, so the counts below
    # are exact.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _load(tmp_path):
    path = save_tiny("llama", tmp_path / "llama", num_hidden_layers=1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    opt = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=INJECT).eval()
    return ref, opt


def _gen(model, ids, mask, n=10, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=PAD, **kw)  # fmt: skip


@pytest.mark.slow
def test_direct_steps_equal_guarded_steps_and_hf(tmp_path, compile_on, monkeypatch):
    ref, opt = _load(tmp_path)
    compiled = getattr(opt, GEN_ATTR).step.compiled
    ids, mask = left_pad(prompts())  # 3 rows: bucket 4

    monkeypatch.setenv(direct_call.GUARDS_ENV, "every")
    guarded = _gen(opt, ids, mask, return_dict_in_generate=True, output_logits=True)
    assert compiled.direct_steps == 0  # every step went through dynamo's guards
    monkeypatch.setenv(direct_call.GUARDS_ENV, "first")
    direct = _gen(opt, ids, mask, return_dict_in_generate=True, output_logits=True)
    # 9 decode steps: the first guarded (and captured), the other 8 called directly
    assert compiled.direct_steps == 8
    assert compiled._direct is None  # the loop's scope is closed after generate
    assert torch.equal(direct.sequences, guarded.sequences)
    for a, b in zip(direct.logits, guarded.logits):
        assert torch.equal(a, b)  # the same compiled graph: bit for bit
    assert torch.equal(direct.sequences, _gen(ref, ids, mask))

    # another bucket in the next call: its first step is guarded again
    p = prompts()[0]
    single = _gen(opt, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
    assert set(compiled.compile_s) == {1, 4}
    assert compiled.direct_steps == 8 + 7  # the bucket's first step compiles, the second is guarded
    assert torch.equal(single[0, len(p) :], direct.sequences[0, ids.shape[1] :])


@pytest.mark.slow
def test_weights_changed_between_calls_reach_the_direct_steps(tmp_path, compile_on):
    ref, opt = _load(tmp_path)
    ids, mask = left_pad(prompts())
    before = _gen(opt, ids, mask)
    # a tensor replaced (a new Parameter object, as load_state_dict(assign=True) or a refresh may do) and another
    # updated in place: both are read by the next call's steps, guarded or direct
    scale = torch.linspace(0.2, 3.0, opt.lm_head.weight.shape[0])[:, None]  # [V, 1]
    with torch.no_grad():
        opt.lm_head.weight = torch.nn.Parameter(opt.lm_head.weight * scale, requires_grad=False)
        ref.lm_head.weight.mul_(scale)
        layer = opt.model.layers[0]
        for name, p in layer.named_parameters():
            if name.endswith("o.weight"):
                p.mul_(-1.0)
        ref.model.layers[0].self_attn.o_proj.weight.mul_(-1.0)
    after = _gen(opt, ids, mask)
    assert not torch.equal(after, before), "the change did not move the tokens (the test would prove nothing)"
    assert torch.equal(after, _gen(ref, ids, mask))
    assert getattr(opt, GEN_ATTR).step.compiled.direct_steps >= 8


@pytest.mark.slow
def test_what_the_entry_does_not_cover_is_refused(tmp_path, compile_on, monkeypatch):
    ref, opt = _load(tmp_path)
    ids, mask = left_pad(prompts())
    seen = []
    real = direct_call.DirectCall.__call__

    def spy(self, *args):
        seen.append((self, args))
        return real(self, *args)

    monkeypatch.setattr(direct_call.DirectCall, "__call__", spy)
    assert torch.equal(_gen(opt, ids, mask), _gen(ref, ids, mask))
    direct, (step, input_ids, positions, slots) = seen[-1]
    lengths = step.cache.lengths.clone()
    # Refused before anything runs (the cache lengths do not move): an attended length of 1 (dynamo specializes
    # 0 and 1), grad mode on (the entry was compiled under no_grad), another batch shape.
    assert real(direct, step, input_ids, positions, slots[:1]) is None
    with torch.enable_grad():
        assert real(direct, step, input_ids, positions, slots) is None
    assert real(direct, step, input_ids[:1], positions[:1], slots) is None
    assert torch.equal(step.cache.lengths, lengths)


@pytest.mark.slow
def test_missing_torch_internals_keep_every_step_guarded(tmp_path, compile_on, monkeypatch):
    ref, opt = _load(tmp_path)
    ids, mask = left_pad(prompts())
    from torch._C._dynamo import eval_frame

    def gone(code):
        raise AttributeError("not in this torch")

    monkeypatch.setattr(eval_frame, "_debug_get_cache_entry_list", gone)
    got = _gen(opt, ids, mask)
    assert getattr(opt, GEN_ATTR).step.compiled.direct_steps == 0
    assert torch.equal(got, _gen(ref, ids, mask))


def test_bad_guards_setting_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(direct_call.GUARDS_ENV, "sometimes")
    with pytest.raises(ValueError, match=r"HF_DSINFER_CPU_GUARDS='sometimes'.*'first'.*'every'"):
        direct_call.guards_mode()
    monkeypatch.setenv(direct_call.GUARDS_ENV, " Every ")
    assert direct_call.guards_mode() == "every"
