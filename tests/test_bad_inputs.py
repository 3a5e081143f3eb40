"""Bad input, faults and misuse, through every way in: never silently wrong, never a crash inside torch.

Every way in (``from_pretrained``, ``pipeline``, ``init_inference``, ``HybridEngine``, the CLI) gets unknown, typo'd
and conflicting keys, wrong types and ranges, missing and invalid JSON files, absurd sizes, and requests it cannot
serve (empty prompts, over-long requests, ids outside the vocabulary, masks of the wrong shape, a streamer or a
stopping criterion that raises, right padding). Each must raise an error that names the setting, the value and the
fix, or fall back with one warning; afterwards the same model must still generate exactly what HF generates.
The regression tests of issue 13's defects are marked ``# defect N``. Tiny models are built once per module.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import transformers
from tiny_models import build_tiny, left_pad, prompts, save_tiny
from tolerances import MODEL_LOGITS_TOL
from transformers import AutoModelForCausalLM

import hf_dsinfer
from hf_dsinfer import parallel
from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.parallel import autotp

NEW = 8  # new tokens per greedy check
FAST = dict(dtype="fp32", replace_with_kernel_inject=True)  # explicit: the defaults ("auto") may change
IDS = torch.tensor([prompts((7,))[0]])


def greedy(model, ids, mask=None, new: int = NEW, **kwargs):
    """Greedy generation of ``new`` tokens."""
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kwargs)


@pytest.fixture(scope="module")
def hf():
    """The reference: HF's eager tiny llama in fp32."""
    return build_tiny("llama")


@pytest.fixture(scope="module")
def batch():
    """A left-padded batch of three prompts: ``(input_ids, attention_mask)``."""
    return left_pad(prompts((5, 9, 3)))


@pytest.fixture(scope="module")
def want(hf, batch):
    """HF's greedy tokens for ``batch``."""
    with torch.no_grad():
        return greedy(hf, *batch)


def generates_like_hf(model, batch, want) -> None:
    """``model`` generates exactly HF's tokens for ``batch`` (called after every error)."""
    torch.testing.assert_close(greedy(model, *batch), want, rtol=0, atol=0)


# -- save / reload ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "opt", "falcon", "llama_tied"])
@torch.no_grad()
def test_init_inference_saves_tied_embeddings_in_hf_layout(name, tmp_path):  # defect 1
    """Tied LM head / embedding in the CPU K-major layout: save_pretrained writes plain HF weights that reload."""
    row, extra = ("llama", {"tie_word_embeddings": True}) if name == "llama_tied" else (name, {})
    ref = build_tiny(row, **extra)
    engine = hf_dsinfer.init_inference(build_tiny(row, **extra), **FAST)
    engine.module.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    torch.testing.assert_close(again(IDS).logits, ref(IDS).logits, rtol=0, atol=0)


@torch.no_grad()
def test_from_pretrained_saves_tied_embeddings(tmp_path):  # defect 1
    src = save_tiny("gpt2", tmp_path / "src")
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    AutoModelForCausalLM.from_pretrained(src, inference_config=FAST).save_pretrained(tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # reloads optimized (config.json holds the config)
    assert again.config.quantization_config.replace_with_kernel_inject is True
    torch.testing.assert_close(again(IDS).logits, ref(IDS).logits, **MODEL_LOGITS_TOL[torch.float32])


# -- concurrency -----------------------------------------------------------------------------------------------------


def _in_threads(fn, n: int) -> list:
    out, errors = [None] * n, []

    def work(i: int) -> None:
        try:
            out[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@torch.no_grad()
def test_generate_from_several_threads_equals_hf(hf, batch, want):  # defect 2
    """One static KV cache per model: concurrent calls take turns on the model's lock, each gets HF's tokens."""
    engine = hf_dsinfer.init_inference(build_tiny("llama"), **FAST)
    rows = [torch.tensor([p]) for p in prompts((5, 9, 3, 7))]
    expected = [greedy(hf, r) for r in rows]
    for _ in range(2):
        got = _in_threads(lambda i: greedy(engine, rows[i]), len(rows))
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
    # forward calls of other threads wait for a running generate too
    logits = _in_threads(lambda i: greedy(engine, *batch) if i == 0 else engine(IDS).logits, 3)
    torch.testing.assert_close(logits[0], want, rtol=0, atol=0)
    torch.testing.assert_close(logits[1], hf(IDS).logits, **MODEL_LOGITS_TOL[torch.float32])
    generates_like_hf(engine, batch, want)


# -- init_inference --------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_second_init_inference_with_other_settings_is_refused(batch, want):  # defect 3
    model = build_tiny("llama")
    hf_dsinfer.init_inference(model, **FAST, max_out_tokens=64)
    with pytest.raises(ValueError, match=r"max_out_tokens=16 \(applied: 64\).*load or build the model again"):
        hf_dsinfer.init_inference(model, **FAST, max_out_tokens=16)
    again = hf_dsinfer.init_inference(model, **FAST, max_out_tokens=64)  # the same settings: a no-op
    assert again.inference_config.max_out_tokens == 64 and again.module is model
    generates_like_hf(again, batch, want)


# -- HybridEngine ----------------------------------------------------------------------------------------------------


def test_hybrid_engine_names_a_bad_config_file(tmp_path):  # defect 4
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    model = build_tiny("llama")
    with pytest.raises(ValueError, match=r"inference_config file '.*bad\.json' is not valid JSON"):
        hf_dsinfer.HybridEngine(model, inference_config=str(bad))
    with pytest.raises(ValueError, match=r"inference_config='.*missing\.json' is not a JSON file"):
        hf_dsinfer.HybridEngine(model, inference_config=str(tmp_path / "missing.json"))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        hf_dsinfer.HybridEngine(model, inference_config=listed)


@torch.no_grad()
def test_absurd_max_out_tokens_names_the_memory_it_needs(batch, want):  # defect 5
    model = build_tiny("llama")
    with pytest.raises(MemoryError, match=r"max_out_tokens=10000000000 needs [\d.]+ GiB.*lower max_out_tokens"):
        hf_dsinfer.init_inference(model, **FAST, max_out_tokens=10**10)
    generates_like_hf(hf_dsinfer.init_inference(model, **FAST), batch, want)  # untouched: a corrected call works


class NoConfigNet(torch.nn.Sequential):
    """A module with no transformers config (DeepSpeed's config tests pass such modules to init_inference)."""


@torch.no_grad()
def test_module_without_hf_config_passes_through_with_one_warning(caplog):  # defect 6
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        for _ in range(2):
            net = NoConfigNet(torch.nn.Linear(4, 4), torch.nn.ReLU())
            torch.testing.assert_close(hf_dsinfer.init_inference(net, **FAST)(x), net(x), rtol=0, atol=0)
        linear = torch.nn.Linear(4, 4)
        torch.testing.assert_close(hf_dsinfer.init_inference(linear, **FAST)(x), linear(x), rtol=0, atol=0)
    warned = [r.getMessage() for r in caplog.records if "NoConfigNet is not a transformers model" in r.getMessage()]
    assert len(warned) == 1, warned


@torch.no_grad()
def test_meta_model_loaded_from_a_checkpoint_takes_the_config_dtype(tmp_path):  # defect 7
    path = save_tiny("llama", tmp_path)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path), dtype=torch.float32)
    desc = {"type": "ds_model", "checkpoints": ["model.safetensors"], "base_dir": path}
    engine = hf_dsinfer.init_inference(meta, dtype="bf16", checkpoint=desc, replace_with_kernel_inject=False)
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    # the same as the built model given to init_inference (both cast with .to(dtype), rotary buffers included)
    built = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = hf_dsinfer.init_inference(built, dtype="bf16", replace_with_kernel_inject=False)
    torch.testing.assert_close(engine(IDS).logits, ref(IDS).logits, rtol=0, atol=0)


# -- tensor parallelism (plans are built in one process; the 2-rank runs are in test_parallel.py) --------------------


def _marian(**extra):
    config = transformers.MarianConfig(
        vocab_size=500, d_model=96, encoder_layers=1, decoder_layers=1, encoder_attention_heads=6,
        decoder_attention_heads=6, encoder_ffn_dim=136, decoder_ffn_dim=136, pad_token_id=0, eos_token_id=2,
        decoder_start_token_id=0, max_position_embeddings=64, **extra,
    )  # fmt: skip
    return transformers.MarianMTModel(config).eval()


@pytest.mark.parametrize("shared", [True, False])
def test_tp_refuses_embeddings_it_cannot_split_exactly(shared):  # defect 8
    """Marian ties separate embedding modules (the decoder's embed_tokens) to the vocab-split weight: refused."""
    model = _marian(share_encoder_decoder_embeddings=shared)
    with pytest.raises(ValueError, match=r"model\.decoder\.embed_tokens\.weight.*tensor_parallel\.tp_size=1"):
        parallel.build_plan(model, 2, 0)


def _t5():
    config = transformers.T5Config(vocab_size=500, d_model=96, d_kv=16, d_ff=136, num_layers=1, num_decoder_layers=1,
                                   num_heads=6, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config).eval()


def _roberta():
    config = transformers.RobertaConfig(vocab_size=500, hidden_size=96, intermediate_size=136, num_hidden_layers=1,
                                        num_attention_heads=6, pad_token_id=1, max_position_embeddings=64)
    return transformers.RobertaModel(config).eval()


# DeepSpeed's documented injection_policy examples, written as its users write them: T5 and RoBERTa
T5_POLICY = {transformers.models.t5.modeling_t5.T5Block: ("SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo")}
ROBERTA_POLICY = {transformers.models.roberta.modeling_roberta.RobertaLayer: ("output.dense",)}


@torch.no_grad()
def test_injection_policy_names_match_by_suffix_as_in_deepspeed():  # defect 9
    roberta = _roberta()
    cfg = hf_dsinfer.InferenceConfig(dtype="fp32", injection_policy=ROBERTA_POLICY)
    traced = parallel.build_plan(roberta, 2, 0)
    # "output.dense" selects both output projections of the layer, as in DeepSpeed: the plan the trace finds
    assert parallel.build_plan(roberta, 2, 0, injection_policy=cfg.injection_policy).shards == traced.shards
    llama = build_tiny("llama")
    suffixes = {"LlamaDecoderLayer": ["o_proj", "down_proj"]}
    assert parallel.build_plan(llama, 2, 1, injection_policy=suffixes).shards == parallel.build_plan(llama, 2, 1).shards
    with pytest.raises(ValueError, match=r"'attention\.nope', which is not a linear layer of RobertaLayer"):
        parallel.build_plan(roberta, 2, 0, injection_policy={"RobertaLayer": ["output.dense", "attention.nope"]})
    # T5: names absent from some blocks (no EncDecAttention in the encoder) select what each block has
    t5 = _t5()
    blocks = {type(b).__name__ + n.split(".")[0]: b for n, b in autotp.find_blocks(t5).items()}
    names = list(T5_POLICY.values())[0]
    assert autotp.match_policy_names(blocks["T5Blockencoder"], names) == [
        "layer.0.SelfAttention.o", "layer.1.DenseReluDense.wo"]  # fmt: skip
    assert autotp.match_policy_names(blocks["T5Blockdecoder"], names) == [
        "layer.0.SelfAttention.o", "layer.1.EncDecAttention.o", "layer.2.DenseReluDense.wo"]  # fmt: skip
    # without tensor parallelism the names are validated the same way (fused layers where a policy exists)
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    for model, policy, inputs in ((t5, T5_POLICY, {"input_ids": ids, "decoder_input_ids": ids}),
                                  (roberta, ROBERTA_POLICY, {"input_ids": ids})):  # fmt: skip
        want = model(**inputs)[0]
        engine = hf_dsinfer.init_inference(model, **FAST, injection_policy=policy)
        torch.testing.assert_close(engine(**inputs)[0], want, **MODEL_LOGITS_TOL[torch.float32])


# -- generate requests -----------------------------------------------------------------------------------------------


@torch.no_grad()
def test_max_out_tokens_holds_without_kernel_injection(hf):  # defect 10
    engine = hf_dsinfer.init_inference(build_tiny("llama"), dtype="fp32", replace_with_kernel_inject=False,
                                       max_out_tokens=16)  # fmt: skip
    with pytest.raises(ValueError, match=r"needs 24 KV-cache slots .* max_out_tokens=16\. Raise max_out_tokens"):
        engine.generate(torch.tensor([prompts((20,))[0]]), max_new_tokens=4)
    ids = torch.tensor([prompts((6,))[0]])
    torch.testing.assert_close(greedy(engine, ids, new=4), greedy(hf, ids, new=4), rtol=0, atol=0)


@torch.no_grad()
def test_max_new_tokens_zero_gets_transformers_error_and_no_fallback_warning(caplog, batch, want):  # defect 11
    engine = hf_dsinfer.init_inference(build_tiny("llama"), **FAST)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME), pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(IDS, max_new_tokens=0)
    assert not [r.getMessage() for r in caplog.records if "not covered by the fast loop" in r.getMessage()]
    generates_like_hf(engine, batch, want)


@torch.no_grad()
def test_right_padding_is_refused_with_the_fix(batch, want):  # defect 11 (documented in docs/generation.md)
    engine = hf_dsinfer.init_inference(build_tiny("llama"), **FAST)
    ids, mask = batch
    right_ids, right_mask = ids.clone(), mask.clone()
    for row in range(ids.shape[0]):  # move each row's padding to the right
        n = int(mask[row].sum())
        right_ids[row] = torch.cat((ids[row, -n:], ids[row, :-n])) if n < ids.shape[1] else ids[row]
        right_mask[row] = torch.cat((mask[row, -n:], mask[row, :-n])) if n < ids.shape[1] else mask[row]
    with pytest.raises(ValueError, match=r"left padding only \(tokenizer padding_side='left'\)"):
        greedy(engine, right_ids, right_mask)
    generates_like_hf(engine, batch, want)
