"""Bad input, faults and misuse, through every way in: never silently wrong, never a crash inside torch.

Every way in (``from_pretrained``, ``pipeline``, ``init_inference``, ``HybridEngine``, the CLI) gets unknown, typo'd
and conflicting keys, wrong types and ranges, missing and invalid JSON files, absurd sizes, and requests it cannot
serve (empty prompts, over-long requests, ids outside the vocabulary, masks of the wrong shape, a streamer or a
stopping criterion that raises). Each must raise an error that names the setting, the value and the
fix, or fall back with one warning; afterwards the same model must still generate exactly what HF generates.
The regression tests of issue 13's defects are marked ``# defect N``. The HF reference, its tokens and the saved
model are module fixtures; a test that changes a model builds its own tiny one (a fraction of a second).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import transformers
from tiny_models import ARCHITECTURES, build_tiny, left_pad, prompts, save_tiny
from tolerances import MODEL_LOGITS_TOL
from transformers import AutoModelForCausalLM

import hf_dsinfer
from hf_dsinfer import parallel
from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.parallel import autotp
from hf_dsinfer.policies import is_injected

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

# every causal-LM row of the fidelity table (each family with a fused policy, and the MoE ones)
_CAUSAL_ROWS = [n for n, a in ARCHITECTURES.items() if a.auto_class == "AutoModelForCausalLM"]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", _CAUSAL_ROWS)
@torch.no_grad()
def test_save_reload_round_trip_for_every_policy_family(name, tied, tmp_path):  # defect 1 (the tied rows)
    """Tied LM head / embedding in the CPU layout injection gives them: save_pretrained writes plain HF weights that
    reload."""
    ref = build_tiny(name, tie_word_embeddings=tied)
    engine = hf_dsinfer.init_inference(build_tiny(name, tie_word_embeddings=tied), **FAST)
    assert is_injected(engine.module), name  # every causal row has a fused policy: the fused layout is what is saved
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
    got = _in_threads(lambda i: greedy(engine, rows[i]), len(rows))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    # forward calls of other threads wait for a running generate too
    logits = _in_threads(lambda i: greedy(engine, *batch) if i == 0 else engine(IDS).logits, 3)
    torch.testing.assert_close(logits[0], want, rtol=0, atol=0)
    torch.testing.assert_close(logits[1], hf(IDS).logits, **MODEL_LOGITS_TOL[torch.float32])
    generates_like_hf(engine, batch, want)


@torch.no_grad()
def test_hybrid_engine_generate_from_several_threads_equals_hf(hf):  # defect 2, Hybrid Engine
    """In inference mode the engine's calls take turns on its inference copy's lock (eval/train stay in one thread)."""
    he = hf_dsinfer.HybridEngine(build_tiny("llama"), inference_config=FAST)
    rows = [torch.tensor([p]) for p in prompts((5, 9, 3))]
    he.eval()
    got = _in_threads(lambda i: greedy(he, rows[i]), len(rows))
    he.train()
    for g, r in zip(got, rows):
        torch.testing.assert_close(g, greedy(hf, r), rtol=0, atol=0)


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
def test_tp_splits_every_embedding_tied_to_the_vocab_weight(shared):  # defect 8, fixed by encoder-decoder TP
    """Marian ties separate embedding modules (the decoder's embed_tokens) to the vocab-split weight: each becomes
    vocab-parallel with the same rows (it was refused before; tests/test_parallel_encdec.py checks the outputs and
    that a non-embedding module sharing the weight is still refused)."""
    model = _marian(share_encoder_decoder_embeddings=shared)
    plan = parallel.build_plan(model, 2, 0)
    tied = {name for name, _, _ in plan.tied_embeddings}
    assert "model.decoder.embed_tokens" in tied, tied


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
def test_right_padding_runs_left_aligned_in_the_callers_layout(batch, want):  # defect 11 / issue 26 item 5
    """A right-padded batch (and one with a hole) is not refused: it runs left-aligned, the new tokens are those of
    the left-padded batch (each prompt as if alone), and the output keeps the caller's layout (prompt as given, then
    the new tokens). Documented in docs/generation.md."""
    engine = hf_dsinfer.init_inference(build_tiny("llama"), **FAST)
    ids, mask = batch
    right_ids, right_mask = ids.clone(), mask.clone()
    for row in range(ids.shape[0]):  # move each row's padding to the right
        n = int(mask[row].sum())
        right_ids[row] = torch.cat((ids[row, -n:], ids[row, :-n])) if n < ids.shape[1] else ids[row]
        right_mask[row] = torch.cat((mask[row, -n:], mask[row, :-n])) if n < ids.shape[1] else mask[row]
    width = ids.shape[1]
    out = greedy(engine, right_ids, right_mask)
    assert torch.equal(out[:, :width], right_ids) and torch.equal(out[:, width:], want[:, width:])
    holed_ids, holed_mask = ids.clone(), mask.clone()
    holed_ids[2], holed_mask[2] = right_ids[2].roll(2), right_mask[2].roll(2)  # padding on both sides of row 2
    out = greedy(engine, holed_ids, holed_mask, return_dict_in_generate=True).sequences
    assert torch.equal(out[:, :width], holed_ids) and torch.equal(out[:, width:], want[:, width:])
    generates_like_hf(engine, batch, want)


# -- every way in: bad settings first, then the same entry point works and generates HF's tokens ----------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """The tiny llama of ``hf`` (same seed) saved with a tokenizer."""
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    """A config file with invalid JSON, one holding a list, and a path that does not exist."""
    d = tmp_path_factory.mktemp("bad")
    (d / "bad.json").write_text('{"dtype": "fp32",')
    (d / "list.json").write_text('["dtype"]')
    return {"invalid": str(d / "bad.json"), "list": str(d / "list.json"), "missing": str(d / "missing.json")}


# (bad config, the error it must raise): each names the setting and the value or the fix
BAD_CONFIGS = [
    ({"max_out_tokn": 64}, r"Unknown InferenceConfig key 'max_out_tokn'\. Did you mean 'max_out_tokens'\?"),
    ({"max_out_tokens": "64"}, r"max_out_tokens must be an integer >= 1, got '64'"),
    ({"max_out_tokens": 0}, r"max_out_tokens must be an integer >= 1, got 0"),
    ({"max_batch_size": -1}, r"max_batch_size must be an integer >= 1, got -1"),
    ({"dtype": "int4"}, r"dtype='int4' is not a dtype hf_dsinfer knows"),
    ({"enable_cuda_graph": "yes"}, r"enable_cuda_graph must be True or False, got 'yes'"),
    ({"replace_with_kernel_inject": 1.5}, r"replace_with_kernel_inject must be True, False or 'auto'"),
    ({"kernel_inject": True, "replace_with_kernel_inject": False}, r"same setting with different values"),
    ({"max_out_tokens": 4, "min_out_tokens": 8}, r"max_out_tokens \(4\) is smaller than min_out_tokens \(8\)"),
    ({"tensor_parallel": {"tp_sise": 2}}, r"Unknown tensor_parallel key 'tp_sise'\. Did you mean 'tp_size'\?"),
    ({"cuda_graph_batch_sizes": [1, 16], "max_batch_size": 8}, r"cuda_graph_batch_sizes reaches 16"),
    ({"injection_policy": {"LlamaDecoderLayer": ["self_attn.nope"]}}, r"'self_attn\.nope'"),
]
BAD_FILES = [
    ("invalid", r"config file '.*bad\.json' is not valid JSON"),
    ("list", r"must hold a JSON object, got list"),
    ("missing", r"config='.*missing\.json' is not a JSON file"),
]


def _bad_cases(bad_files):
    return [*BAD_CONFIGS, *[(bad_files[kind], match) for kind, match in BAD_FILES]]


@torch.no_grad()
def test_from_pretrained_refuses_bad_configs_then_works(llama_dir, bad_files, batch, want):
    for config, match in _bad_cases(bad_files):
        with pytest.raises(ValueError, match=match):
            AutoModelForCausalLM.from_pretrained(llama_dir, inference_config=config)
    with pytest.raises(ValueError, match="both inference_config and a different quantization_config"):
        AutoModelForCausalLM.from_pretrained(llama_dir, inference_config=FAST,
                                             quantization_config=hf_dsinfer.InferenceConfig(dtype="bf16"))  # fmt: skip
    with pytest.raises(ValueError, match=r"dtype='float16' but the inference config says dtype='float32'"):
        AutoModelForCausalLM.from_pretrained(llama_dir, inference_config=FAST, dtype=torch.float16)
    generates_like_hf(AutoModelForCausalLM.from_pretrained(llama_dir, inference_config=FAST), batch, want)


def test_pipeline_refuses_bad_configs_then_works(llama_dir, hf):
    from transformers import pipeline

    for config, match in BAD_CONFIGS[:3]:
        with pytest.raises(ValueError, match=match):
            pipeline("text-generation", model=llama_dir, model_kwargs={"inference_config": config})
    fast = pipeline("text-generation", model=llama_dir, model_kwargs={"inference_config": FAST})
    plain = pipeline("text-generation", model=llama_dir, model_kwargs={"dtype": torch.float32})
    kw = dict(max_new_tokens=NEW, do_sample=False, return_full_text=False)
    text = ["The quick brown fox", "Hello world"]
    assert fast(text, **kw) == plain(text, **kw)


@torch.no_grad()
def test_init_inference_refuses_bad_settings_then_works(bad_files, batch, want):
    model = build_tiny("llama")
    for config, match in _bad_cases(bad_files):
        with pytest.raises(ValueError, match=match):
            hf_dsinfer.init_inference(model, config)
    with pytest.raises(ValueError, match=r"Unknown InferenceConfig key 'max_token'"):
        hf_dsinfer.init_inference(model, max_token=8)
    with pytest.raises(ValueError, match=r"Conflicting values .* max_out_tokens \(64 in config, 32 in kwargs\)"):
        hf_dsinfer.init_inference(model, {"max_out_tokens": 64}, max_out_tokens=32)
    for kind, match in BAD_FILES[:2]:
        with pytest.raises(ValueError, match=match.replace("config", "checkpoint")):
            hf_dsinfer.init_inference(model, **FAST, checkpoint=bad_files[kind])
    with pytest.raises(TypeError, match="needs a torch.nn.Module, got dict"):
        hf_dsinfer.init_inference({"model": model})
    engine = hf_dsinfer.init_inference(model, **FAST)
    with pytest.raises(ValueError, match="pass engine.module"):
        hf_dsinfer.init_inference(engine)
    generates_like_hf(engine, batch, want)


@torch.no_grad()
def test_hybrid_engine_refuses_bad_settings_then_works(bad_files, batch, want):
    model = build_tiny("llama")
    for config, match in _bad_cases(bad_files)[:6]:
        match = match.replace("config=", "inference_config=").replace("config file", "inference_config file")
        with pytest.raises(ValueError, match=match):
            hf_dsinfer.HybridEngine(model, inference_config=config)
    for kind, match in BAD_FILES:
        with pytest.raises(ValueError, match=match.replace("config", "inference_config")):
            hf_dsinfer.HybridEngine(model, inference_config=bad_files[kind])
    with pytest.raises(ValueError, match=r"refresh='sometimes': use 'always' or 'auto'"):
        hf_dsinfer.HybridEngine(model, refresh="sometimes")
    with pytest.raises(ValueError, match=r"sampling='exact'"):
        hf_dsinfer.HybridEngine(model, sampling="exact")
    with pytest.raises(ValueError, match="remove `checkpoint`"):
        hf_dsinfer.HybridEngine(model, checkpoint={"type": "ds_model", "checkpoints": []})
    he = hf_dsinfer.HybridEngine(model, inference_config=FAST)
    generates_like_hf(he, batch, want)


def test_cli_refuses_bad_settings_then_works(llama_dir, bad_files, hf, capsys):
    from hf_dsinfer.cli import main

    run = ["generate", llama_dir, "--prompt", "Hello world", "--max-new-tokens", "4"]
    with pytest.raises(ValueError, match=r"Did you mean 'max_out_tokens'"):
        main([*run, "--set", "max_out_tokn=64"])
    with pytest.raises(ValueError, match=r"max_out_tokens must be an integer >= 1, got 0"):
        main([*run, "--set", "max_out_tokens=0"])
    with pytest.raises(ValueError, match=r"dtype='fp8' is not a dtype"):
        main([*run, "--dtype", "fp8"])
    for kind, match in BAD_FILES:
        with pytest.raises(ValueError, match=match):
            main([*run, "--config", bad_files[kind]])
    with pytest.raises(SystemExit, match="--set expects key=value"):
        main([*run, "--set", "max_out_tokens"])
    capsys.readouterr()
    assert main([*run, "--dtype", "fp32", "--set", "replace_with_kernel_inject=true"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    ids = tok(["Hello world"], return_tensors="pt")["input_ids"]
    expected = "Hello world" + tok.decode(greedy(hf, ids, new=4)[0, ids.shape[1]:], skip_special_tokens=True)
    assert capsys.readouterr().out.splitlines()[0] == expected  # then a timing line


# -- requests no path can serve, on one injected model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    """An injected tiny llama (same weights as ``hf``) with a small cache."""
    return hf_dsinfer.init_inference(build_tiny("llama"), **FAST, max_out_tokens=64, max_batch_size=4)


class Boom(RuntimeError):
    pass


class RaisingStreamer:
    """A streamer that fails on its ``n``-th token."""

    def __init__(self, n: int):
        self.n, self.seen = n, 0

    def put(self, value):
        self.seen += 1
        if self.seen > self.n:  # the first put is the prompt
            raise Boom("streamer failed")

    def end(self):
        pass


def raising_criterion(input_ids, scores, **kwargs):
    if input_ids.shape[1] > IDS.shape[1] + 2:
        raise Boom("criterion failed")
    return torch.zeros(input_ids.shape[0], dtype=torch.bool)


BAD_REQUESTS = {
    "empty prompt": (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, r"input_ids is empty"),
    "id past the vocab": (dict(input_ids=torch.tensor([[5, 500, 7]])), ValueError, r"outside the vocabulary \[0, 500"),
    "negative id": (dict(input_ids=torch.tensor([[5, -1, 7]])), ValueError, r"outside the vocabulary .*min -1"),
    "mask of the wrong shape": (dict(input_ids=IDS, attention_mask=torch.ones(1, 3, dtype=torch.long)), ValueError,
                                r"attention_mask has shape \(1, 3\) but input_ids has shape \(1, 7\)"),
    "over-long request": (dict(input_ids=torch.tensor([prompts((60,))[0]])), ValueError,
                          r"needs 68 KV-cache slots .* max_out_tokens=64"),
    "streamer raises": (dict(input_ids=IDS, streamer=RaisingStreamer(3)), Boom, "streamer failed"),
    "criterion raises": (dict(input_ids=IDS, stopping_criteria=[raising_criterion]), Boom, "criterion failed"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
@torch.no_grad()
def test_bad_requests_raise_and_leave_the_model_as_hf(engine, case, batch, want):
    kwargs, error, match = BAD_REQUESTS[case]
    if case == "criterion raises":
        from transformers import StoppingCriteriaList

        kwargs = dict(kwargs, stopping_criteria=StoppingCriteriaList(kwargs["stopping_criteria"]))
    with pytest.raises(error, match=match):
        engine.generate(**kwargs, max_new_tokens=NEW, do_sample=False)
    generates_like_hf(engine, batch, want)


@torch.no_grad()
def test_varying_shapes_reuse_the_cache_without_growth(engine, hf):
    from hf_dsinfer.policies import get_injection

    cache = get_injection(engine.module).runtime.cache
    greedy(engine, IDS)
    ptr, rows = cache.keys[0].data_ptr(), cache.allocated_rows
    for lengths in [(9, 2, 5), (12, 1, 7, 3), (6,)]:
        ids, mask = left_pad(prompts(lengths, seed=len(lengths)))
        torch.testing.assert_close(greedy(engine, ids, mask), greedy(hf, ids, mask), rtol=0, atol=0)
        assert cache.keys[0].data_ptr() == ptr and cache.allocated_rows == rows
