"""Kernel injection end to end: cached forwards against HF, errors, saving, the Triton path, the no-policy fallback.

The fidelity table (test_fidelity.py, ``inject`` mode) covers logits and greedy generation per architecture; these
tests cover what it does not: step-by-step cache use, unsupported inputs, save/reload, and fallbacks.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import transformers
from tiny_models import PAD, left_pad, prompts, save_tiny
from tolerances import MODEL_LOGITS_TOL
from transformers import DynamicCache

import hf_dsinfer  # noqa: F401
from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.policies import get_injection, is_injected
from hf_dsinfer.policies.runtime import InjectedCache

TOL = MODEL_LOGITS_TOL[torch.float32]
INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = save_tiny(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def _pair(path: str, **cfg):
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    opt = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config={**INJECT, **cfg}).eval()
    return ref, opt


@pytest.mark.parametrize("name", ["llama", "gemma2", "phi3"])
@torch.no_grad()
def test_prefill_then_single_token_steps_match_hf(name, saved):
    """A left-padded prefill then single-token steps through past_key_values, as generate drives them."""
    ref, opt = _pair(saved(name))
    assert is_injected(opt) and not is_injected(ref)
    ids, mask = left_pad(prompts())
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    hf_cache = DynamicCache(config=ref.config)
    r = ref(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=hf_cache)
    g = opt(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=DynamicCache(config=opt.config))
    real = mask.bool()
    torch.testing.assert_close(g.logits[real], r.logits[real], **TOL)  # padding positions carry no meaning
    cache = g.past_key_values
    assert isinstance(cache, InjectedCache) and cache.get_seq_length() == ids.shape[1]
    step = torch.tensor([[5], [6], [7]])
    for _ in range(3):
        mask = torch.cat([mask, torch.ones_like(step)], dim=1)
        pos = pos[:, -1:] + 1
        r = ref(input_ids=step, attention_mask=mask, position_ids=pos, past_key_values=r.past_key_values)
        g = opt(input_ids=step, attention_mask=mask, position_ids=pos, past_key_values=g.past_key_values)
        torch.testing.assert_close(g.logits, r.logits, **TOL)
        step = r.logits[:, -1].argmax(-1, keepdim=True)
    assert g.past_key_values.get_seq_length() == mask.shape[1]


@torch.no_grad()
def test_forward_without_cache_and_default_positions(saved):
    """No past, no position_ids, no mask: HF's defaults; use_cache=False returns no cache; labels give HF's loss."""
    ref, opt = _pair(saved("llama"))
    ids, mask = left_pad(prompts())
    r = ref(input_ids=ids, attention_mask=mask)  # positions = arange (HF's default ignores the padding)
    g = opt(input_ids=ids, attention_mask=mask, use_cache=False)
    assert g.past_key_values is None
    torch.testing.assert_close(g.logits[mask.bool()], r.logits[mask.bool()], **TOL)
    single = torch.tensor([prompts()[1]])
    r = ref(input_ids=single, labels=single)
    g = opt(input_ids=single, labels=single, return_dict=False)
    torch.testing.assert_close(g[0], r.loss, **TOL)
    torch.testing.assert_close(g[1], r.logits, **TOL)
    # the bare base model's forward is replaced too
    h = opt.model(input_ids=single).last_hidden_state
    torch.testing.assert_close(h, ref.model(input_ids=single).last_hidden_state, **TOL)


@torch.no_grad()
def test_generate_variants_match_hf(saved):
    """Beam search (cache reorder), chunked prefill, inputs_embeds and use_cache=False through HF's generate."""
    ref, opt = _pair(saved("llama"))
    ids, mask = left_pad(prompts())
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, attention_mask=mask)
    for extra in (dict(num_beams=2), dict(prefill_chunk_size=4), dict(use_cache=False)):
        assert torch.equal(opt.generate(input_ids=ids, **kw, **extra), ref.generate(input_ids=ids, **kw, **extra)), (
            extra
        )
    emb = ref.get_input_embeddings()(ids)
    assert torch.equal(opt.generate(inputs_embeds=emb, **kw), ref.generate(inputs_embeds=emb, **kw))


@torch.no_grad()
def test_unsupported_inputs_raise_naming_the_argument(saved):
    _, opt = _pair(saved("llama"), max_out_tokens=16)
    ids = torch.tensor([prompts()[1]])
    with pytest.raises(ValueError, match="output_attentions"):
        opt(input_ids=ids, output_attentions=True)
    with pytest.raises(ValueError, match="output_hidden_states"):
        opt(input_ids=ids, output_hidden_states=True)
    with pytest.raises(ValueError, match="attention_mask"):
        opt(input_ids=ids, attention_mask=torch.ones(1, 1, ids.shape[1], ids.shape[1]))
    with pytest.raises(ValueError, match="left padding"):
        opt(input_ids=ids, attention_mask=torch.tensor([[1] * (ids.shape[1] - 1) + [0]]))
    filled = DynamicCache(config=opt.config)
    filled.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)
    with pytest.raises(ValueError, match="past_key_values"):
        opt(input_ids=ids, past_key_values=filled)
    # a stale handle: the model started another sequence since
    old = opt(input_ids=ids).past_key_values
    opt(input_ids=ids)
    with pytest.raises(ValueError, match="stale"):
        opt(input_ids=ids[:, :1], past_key_values=old)
    # over max_out_tokens: raises before any state change, and the model stays usable
    live = opt(input_ids=ids).past_key_values
    with pytest.raises(ValueError, match="max_out_tokens=16"):
        opt(input_ids=torch.ones(1, 8, dtype=torch.long), past_key_values=live)
    assert live.get_seq_length() == ids.shape[1]
    with pytest.raises(ValueError, match="max_out_tokens=16"):
        opt(input_ids=torch.ones(1, 17, dtype=torch.long))
    ref = transformers.AutoModelForCausalLM.from_pretrained(saved("llama"), dtype=torch.float32).eval()
    torch.testing.assert_close(opt(input_ids=ids).logits, ref(input_ids=ids).logits, **TOL)


@torch.no_grad()
def test_batch_above_max_batch_size_reallocates(saved, caplog):
    ref, opt = _pair(saved("llama"), max_batch_size=1)
    ids, mask = left_pad(prompts())
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        g = opt(input_ids=ids, attention_mask=mask)
    assert "max_batch_size=1" in caplog.text
    assert get_injection(opt).runtime.cache.allocated_rows == 3
    torch.testing.assert_close(
        g.logits[mask.bool()], ref(input_ids=ids, attention_mask=mask).logits[mask.bool()], **TOL
    )


_PLAIN_LOAD = """
import sys, torch, transformers
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    torch.save(m(input_ids=torch.tensor([{ids}])).logits, sys.argv[2])
assert "hf_dsinfer" not in sys.modules, "the plain load imported hf_dsinfer"
assert not hasattr(m, "_dsinfer_injection")
"""


@pytest.mark.parametrize("name", ["llama", "phi3"])
@torch.no_grad()
def test_save_writes_plain_hf_weights(name, saved, tmp_path):
    """An injected model saves HF-layout tensors: it reloads injected with the package and plain without it."""
    from safetensors import safe_open

    ref, opt = _pair(saved(name))
    ids = prompts()[1]
    want = ref(input_ids=torch.tensor([ids])).logits
    out, plain = tmp_path / "saved", tmp_path / "plain"
    opt.save_pretrained(out)
    ref.save_pretrained(plain)
    with safe_open(out / "model.safetensors", "pt") as f, safe_open(plain / "model.safetensors", "pt") as p:
        assert set(f.keys()) == set(p.keys())
        for key in p.keys():
            assert torch.equal(f.get_tensor(key), p.get_tensor(key)), key
    assert json.loads((out / "config.json").read_text())["quantization_config"]["replace_with_kernel_inject"]
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert is_injected(again)
    torch.testing.assert_close(again(input_ids=torch.tensor([ids])).logits, want, **TOL)
    # a process that never imports hf_dsinfer loads the checkpoint as a plain HF model
    script = tmp_path / "plain_load.py"
    script.write_text(_PLAIN_LOAD.format(ids=ids))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, str(script), str(out), str(tmp_path / "logits.pt")],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), want, **TOL)


@torch.no_grad()
def test_llama_through_triton_kernels(saved, monkeypatch):
    """HF_DSINFER_BACKEND=triton: every kernel of a whole model runs in Triton (interpreted on CPU)."""
    import importlib

    monkeypatch.setenv("HF_DSINFER_BACKEND", "triton")
    calls: dict[str, int] = {}
    launchers = {
        "norms": "rms_norm_triton", "rotary": "apply_rotary_triton", "activations": "act_and_mul_triton",
        "kv_cache": "store_kv_triton", "prefill_attention": "prefill_attention_triton",
        "decode_attention": "decode_attention_triton",
    }  # fmt: skip
    for module_name, fn_name in launchers.items():
        module = importlib.import_module(f"hf_dsinfer.kernels.{module_name}")
        fn = getattr(module, fn_name)

        def counted(*args, _fn=fn, _name=fn_name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(module, fn_name, counted)
    ref, opt = _pair(saved("llama"))
    ids, mask = left_pad(prompts())
    g = opt(input_ids=ids, attention_mask=mask)
    r = ref(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(g.logits[mask.bool()], r.logits[mask.bool()], **TOL)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert torch.equal(opt.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw))
    assert set(calls) == set(launchers.values()), f"kernels that did not run through Triton: {calls}"


@torch.no_grad()
def test_architecture_without_policy_warns_once_and_matches_hf(tmp_path, caplog, monkeypatch):
    """A tiny t5 (no policy): one warning naming it, HF's own modules, HF's output."""

    monkeypatch.setattr("hf_dsinfer.log._WARNED", set())
    config = transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0
    )
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(config).eval().save_pretrained(tmp_path)
    ref = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        opt = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, inference_config=INJECT).eval()
        opt2 = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, inference_config=INJECT).eval()
    warnings = [r for r in caplog.records if r.name == LOGGER_NAME and "no kernel-injection policy" in r.message]
    assert len(warnings) == 1 and "t5" in warnings[0].message
    assert not is_injected(opt) and not is_injected(opt2)
    ids = torch.tensor([[5, 6, 7, 8]])
    kw = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(opt.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw))


@torch.no_grad()
def test_cpu_layouts_of_fused_linears_and_head(tmp_path):
    """On CPU (fp32) the fused linears and the (tied) LM head are row-major (their decode GEMV streams rows,
    modules/linear.py); values, ties and outputs are unchanged, and the head takes no gradient (as the fused layers)."""
    path = save_tiny("llama", tmp_path / "tied", tie_word_embeddings=True)
    ref, opt = _pair(path)
    layer = get_injection(opt).runtime.layers[0]
    for linear in (layer.attn.qkv, layer.attn.o, layer.mlp.up, layer.mlp.down):
        assert linear.weight.is_contiguous(), "fused linear weight should be row-major on CPU"
    head, emb = opt.get_output_embeddings().weight, opt.get_input_embeddings().weight
    assert head is emb and head.is_contiguous() and not head.requires_grad
    torch.testing.assert_close(head, ref.get_output_embeddings().weight, atol=0, rtol=0)
    ids = torch.tensor([prompts()[0]])
    torch.testing.assert_close(opt(input_ids=ids).logits, ref(input_ids=ids).logits, **TOL)
