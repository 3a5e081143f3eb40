"""``InjectedCache`` as transformers' ``generate`` sees it: every ``Cache`` member decided on, continuing from a
returned cache, rolling it back (assisted decoding, prompt lookup) — each against HF eager on the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import PAD, left_pad, load_pair, prompts
from transformers.cache_utils import Cache

from hf_dsinfer import hf_compat
from hf_dsinfer.generation import last_generate_stats
from hf_dsinfer.policies.runtime import CACHE_MEMBERS_INHERITED, InjectedCache

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 96}


def test_every_cache_member_is_decided_on():
    """A transformers release that adds a ``Cache`` member fails here until InjectedCache overrides it (or lists it
    as inherited on purpose): inherited members read ``self.layers``, which is empty here."""
    public = {n for n in dir(Cache) if not n.startswith("__") or n == "__init__"}
    public = {n for n in public if not (n.startswith("_") and not n.startswith("__"))}
    undecided = sorted(n for n in public if n not in InjectedCache.__dict__ and n not in CACHE_MEMBERS_INHERITED)
    assert not undecided, f"Cache members InjectedCache does not override: {undecided}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_pair("llama", tmp_path_factory.mktemp("llama"), INJECT)


def _greedy(model, ids, **kw):
    kw = {"do_sample": False, "pad_token_id": PAD, **kw}
    return model.generate(input_ids=ids, **kw)


def test_the_layer_derived_members_describe_attention_layers(models):
    _, opt, _ = models
    out = _greedy(opt, torch.tensor([prompts()[0]]), max_new_tokens=2, return_dict_in_generate=True)
    cache = hf_compat.output_cache(out)
    assert isinstance(cache, InjectedCache)
    layers = len(opt.model.layers)
    assert cache.is_linear == [False] * layers and cache.is_sliding == [False] * layers  # not all([]) == True
    assert cache.is_dummy == [False] * layers and cache.is_croppable
    assert cache.get_query_offset() == cache.get_seq_length() == len(prompts()[0]) + 1


@pytest.mark.parametrize("name", ["installed", "past_key_values"])
def test_continuing_from_a_returned_cache_equals_hf(models, name):
    """generate(cache=out.cache) (or the old keyword) continues exactly like HF continues its own cache."""
    ref, opt, _ = models
    key = hf_compat.cache_kwarg() if name == "installed" else "past_key_values"
    ids = torch.tensor([prompts()[1]])
    first = {"max_new_tokens": 4, "return_dict_in_generate": True}
    a_ref, a_opt = _greedy(ref, ids, **first), _greedy(opt, ids, **first)
    assert torch.equal(a_ref.sequences, a_opt.sequences)
    more = torch.cat([a_ref.sequences, torch.tensor([[7, 11]])], dim=1)  # the caller appends two tokens
    b_ref = _greedy(ref, more, max_new_tokens=5, **{key: hf_compat.output_cache(a_ref)})
    b_opt = _greedy(opt, more, max_new_tokens=5, **{key: hf_compat.output_cache(a_opt)})
    assert torch.equal(b_opt, b_ref)
    assert torch.equal(b_opt, _greedy(ref, more, max_new_tokens=5))  # and equal to starting afresh


def test_a_stale_cache_is_refused(models):
    _, opt, _ = models
    ids = torch.tensor([prompts()[0]])
    old = hf_compat.output_cache(_greedy(opt, ids, max_new_tokens=2, return_dict_in_generate=True))
    _greedy(opt, ids, max_new_tokens=2)  # another sequence replaces the static cache's content
    with pytest.raises(ValueError, match="stale"):
        _greedy(opt, ids, max_new_tokens=2, past_key_values=old)
    assert torch.equal(_greedy(opt, ids, max_new_tokens=3)[:, :-1], _greedy(opt, ids, max_new_tokens=2))  # usable


def test_both_cache_keywords_with_different_objects_are_refused(models):
    _, opt, _ = models
    ids = torch.tensor([prompts()[0]])
    a = hf_compat.output_cache(_greedy(opt, ids, max_new_tokens=1, return_dict_in_generate=True))
    with pytest.raises(ValueError, match="both cache= and past_key_values="):
        opt(input_ids=ids[:, -1:], cache=a, past_key_values=transformers.DynamicCache())


def test_crop_rolls_back_exactly(models):
    """crop(-n) (5.24's convention) and crop(length) (the older one) leave the cache as if the tokens never came."""
    _, opt, _ = models
    ids, mask = left_pad(prompts()[:2])
    out = opt(input_ids=ids, attention_mask=mask, use_cache=True)
    cache = hf_compat.output_cache(out)
    width = ids.shape[1]
    lengths = cache.runtime.cache.lengths[:2].clone()
    step = torch.tensor([[5], [9]])
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    want = opt(input_ids=step, attention_mask=mask2, **{hf_compat.cache_kwarg(): cache}).logits
    for crop in (-1, width):  # remove one token / keep `width` tokens
        cache.crop(crop)
        assert cache.get_seq_length() == width and torch.equal(cache.runtime.cache.lengths[:2], lengths)
        got = opt(input_ids=step, attention_mask=mask2, **{hf_compat.cache_kwarg(): cache}).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_assisted_decoding_and_prompt_lookup_equal_plain_greedy(models, tmp_path):
    """The fused cache is croppable: assisted decoding (a fused draft on the fast loop, an HF draft on transformers'
    assisted loop) and prompt lookup run on the injected model and give HF's plain greedy tokens."""
    ref, opt, path = models
    draft = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=INJECT).eval()
    ids = torch.tensor([prompts()[2] * 2])  # repetitive: prompt lookup finds candidates
    want = _greedy(ref, ids, max_new_tokens=10)
    got = _greedy(opt, ids, max_new_tokens=10, assistant_model=draft)
    assert torch.equal(got, want)
    assert last_generate_stats(opt).path == "fast+draft"  # the fast loop verifies the fused draft's proposals
    plain_draft = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got = _greedy(opt, ids, max_new_tokens=10, assistant_model=plain_draft)
    assert torch.equal(got, want)
    assert last_generate_stats(opt).path == "hf"  # an HF draft: transformers' assisted loop on the fused forward
    got = _greedy(opt, ids, max_new_tokens=10, prompt_lookup_num_tokens=3)
    assert torch.equal(got, want)
