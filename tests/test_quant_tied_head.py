"""``quant.weight.lm_head=True`` on a model whose LM head is tied to the input embedding: one quantized table (the
head's :class:`QuantLinear`), rows gathered and dequantized by a :class:`QuantEmbedding`, no float copy left; logits
equal to HF's model holding the dequantized weights; saved as a plain tied checkpoint and reloaded to the same
integers; ``lm_head_bits=8`` puts an int8 head under an int4 body."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import left_pad, prompts, save_tiny

import hf_dsinfer  # noqa: F401  (registers inference_config)
from hf_dsinfer.integration.quant_config import parse_quant
from hf_dsinfer.modules.quant_linear import QuantEmbedding, QuantLinear, activation_dtype

INT8_HEAD = {"enabled": True, "weight": {"num_bits": 8, "lm_head": True}}
INT4_HEAD8 = {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric", "group_size": 32,
                                          "zero_point": "float", "lm_head": True, "lm_head_bits": 8}}  # fmt: skip
# Against HF's model holding the same dequantized weights: only summation order differs (fused layers included).
SAME_WEIGHTS = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache: dict[bool, str] = {}

    def get(tied: bool) -> str:
        if tied not in cache:
            cache[tied] = save_tiny("llama", tmp_path_factory.mktemp(f"tied{tied}"), tie_word_embeddings=tied)
        return cache[tied]

    return get


def _load(path: str, quant: dict, inject: bool | str = "auto"):
    cfg = {"dtype": "fp32", "quant": quant, "replace_with_kernel_inject": inject}
    return transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)


def _reference(path: str, model) -> torch.nn.Module:
    """HF's fp32 model holding ``model``'s dequantized weights (``model`` on HF's modules: the same names)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, QuantLinear):
                ref.get_submodule(name).weight.copy_(module.dequantized_weight(torch.float32))
    return ref


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("quant", [INT8_HEAD, INT4_HEAD8], ids=["int8", "int4-head8"])
@torch.no_grad()
def test_quantized_head_equals_the_dequantized_reference(tiny, tied, quant):
    path = tiny(tied)
    plain = _load(path, quant, inject=False)  # HF's modules, QuantLinear swapped in: HF's names
    head, emb = plain.get_output_embeddings(), plain.get_input_embeddings()
    assert isinstance(head, QuantLinear) and head.spec.num_bits == 8  # lm_head_bits=8 under int4
    if tied:
        assert isinstance(emb, QuantEmbedding) and emb.weight is head.weight  # one table
        assert not any(p.numel() == head.in_features * head.out_features for p in plain.parameters())  # no float copy
        assert activation_dtype(emb) == torch.float32
    else:
        assert type(emb) is torch.nn.Embedding
    ref = _reference(path, plain)
    if tied:
        assert ref.lm_head.weight is ref.model.embed_tokens.weight  # the reference's tie holds the dequantized table
    ids, mask = left_pad(prompts())
    real = mask.bool()
    want = ref(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(plain(input_ids=ids, attention_mask=mask).logits[real], want[real], **SAME_WEIGHTS)
    fused = _load(path, quant)  # fused layers, the same quantized table
    torch.testing.assert_close(fused(input_ids=ids, attention_mask=mask).logits[real], want[real], **SAME_WEIGHTS)
    out = fused.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    hf = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, hf)


@torch.no_grad()
def test_tied_quantized_head_saves_a_plain_tied_checkpoint(tiny, tmp_path):
    from safetensors.torch import load_file

    model = _load(tiny(True), INT8_HEAD)
    ids, mask = left_pad(prompts())
    real = mask.bool()
    got = model(input_ids=ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    table = saved["model.embed_tokens.weight"]  # the float table, as a tied HF model saves it; no head keys
    assert table.dtype == torch.float32 and not any(k.startswith("lm_head") for k in saved)
    torch.testing.assert_close(table, model.get_input_embeddings().dequantized_weight(), rtol=0, atol=0)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(again.get_input_embeddings(), QuantEmbedding)
    assert torch.equal(again.get_output_embeddings().weight, model.get_output_embeddings().weight)  # same integers
    torch.testing.assert_close(again(input_ids=ids, attention_mask=mask).logits[real], got[real], **SAME_WEIGHTS)


@torch.no_grad()
def test_repeated_rows_with_a_quantized_tied_head(tiny):
    # prefix sharing (repeated prompts prefill once) and serving size the KV cache from the float dtype
    model = _load(tiny(True), INT8_HEAD)
    row = torch.tensor([[5, 9, 13, 2, 7]])
    one = model.generate(input_ids=row, max_new_tokens=5, do_sample=False, pad_token_id=0)
    three = model.generate(input_ids=row.repeat(3, 1), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(three, one.repeat(3, 1))
    from hf_dsinfer.serving.sizing import kv_bytes_per_token

    assert kv_bytes_per_token(model)[1] == torch.float32  # the serving KV cache too (the head's weight is int8)


def test_lm_head_bits_is_checked():
    assert parse_quant(INT4_HEAD8).to_dict()["weight"]["lm_head_bits"] == 8
    assert parse_quant(INT4_HEAD8).spec_for(96, head=True).num_bits == 8
    assert parse_quant(INT4_HEAD8).spec_for(96).num_bits == 4
    for bad in ({"num_bits": 4, "lm_head_bits": 8}, {"num_bits": 8, "lm_head": True, "lm_head_bits": 4},
                {"num_bits": 4, "lm_head": True, "lm_head_bits": True}):  # fmt: skip
        with pytest.raises(ValueError, match="quant.weight.lm_head_bits"):
            parse_quant({"enabled": True, "weight": bad})
