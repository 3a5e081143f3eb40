"""The fast generate loop against transformers' generate: greedy tokens, EOS, padding, limits, streamers, timing.

Every architecture with a kernel-injection policy is loaded twice (plain HF, and with ``replace_with_kernel_inject``)
from the same saved tiny model; the injected one runs hf_dsinfer's loop (``last_generate_stats(model).path``).
"""

from __future__ import annotations

import contextlib
import io
import threading

import pytest
import torch
import transformers
from tiny_models import ARCHITECTURES, PAD, left_pad, load_pair, prompts, save_tiny

import hf_dsinfer
from hf_dsinfer.generation import last_generate_stats
from hf_dsinfer.policies import POLICIES

DECODERS = [n for n, a in ARCHITECTURES.items() if not a.encoder and a.model_type in POLICIES]
INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 64}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``pair(name) -> (hf_model, injected_model, path)``, cached per module."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_pair(name, tmp_path_factory.mktemp(name), INJECT)
        return cache[name]

    return get


def _gen(model, ids, mask, **kw):
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": PAD, **kw}
    return model.generate(input_ids=ids, attention_mask=mask, **kw)


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_identical_to_hf_with_eos_and_padding(name, pair):
    ref, opt, _ = pair(name)
    ids, mask = left_pad(prompts())
    free = _gen(ref, ids, mask, min_new_tokens=12)
    ours = _gen(opt, ids, mask, min_new_tokens=12)
    assert torch.equal(ours, free), "greedy tokens differ from HF"
    assert last_generate_stats(opt).path == "fast"
    # EOS: two ids, one of which row 1 emits mid-way; rows finish at different steps and get padded like HF's
    width = ids.shape[1]
    eos = [int(free[1, width + 4]), int(free[0, width + 7])]
    want = _gen(ref, ids, mask, eos_token_id=eos)
    got = _gen(opt, ids, mask, eos_token_id=eos)
    assert torch.equal(got, want)
    assert got.shape[1] < free.shape[1] or (got == PAD).any()
    # min_new_tokens keeps EOS masked for the first tokens
    assert torch.equal(_gen(opt, ids, mask, eos_token_id=eos, min_new_tokens=6),
                       _gen(ref, ids, mask, eos_token_id=eos, min_new_tokens=6))  # fmt: skip
    # the padded batch equals the prompts run one by one
    for i, p in enumerate(prompts()):
        single = _gen(opt, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), min_new_tokens=12)
        assert torch.equal(ours[i, width:], single[0, len(p):]), f"row {i} of the padded batch differs from its single"


def test_over_long_request_errors_before_work_and_next_request_works(pair):
    ref, opt, path = pair("llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids, mask = left_pad(prompts())
    before = _gen(opt, ids, mask)
    streamer = transformers.TextStreamer(tok)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(ValueError) as err:
        opt.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=60, streamer=streamer)
    msg = str(err.value)
    assert "max_out_tokens=64" in msg and f"prompt length {ids.shape[1]}" in msg and "max_new_tokens 60" in msg
    assert out.getvalue() == ""  # nothing was streamed: the check ran before any work
    with pytest.raises(ValueError, match="max_out_tokens=64"):
        opt.generate(input_ids=ids, attention_mask=mask, max_length=80)
    assert torch.equal(_gen(opt, ids, mask), before)  # nothing corrupted
    assert torch.equal(_gen(opt, ids, mask), _gen(ref, ids, mask))


def _streamed(model, tok, **kw) -> tuple[str, str]:
    enc = tok(["The quick brown fox"], return_tensors="pt")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        streamer = transformers.TextStreamer(tok)
        model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=PAD, streamer=streamer)
    it = transformers.TextIteratorStreamer(tok, skip_prompt=True)
    worker = threading.Thread(target=model.generate, kwargs=dict(**enc, max_new_tokens=10, do_sample=False,
                                                                 pad_token_id=PAD, streamer=it))  # fmt: skip
    worker.start()
    text = "".join(it)
    worker.join()
    return buf.getvalue(), text


def test_streamers_receive_hf_text(pair):
    ref, opt, path = pair("llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert _streamed(opt, tok) == _streamed(ref, tok)
    assert last_generate_stats(opt).path == "fast"


def test_stop_strings_like_hf(pair):
    ref, opt, path = pair("qwen2" if "qwen2" in DECODERS else "llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    enc = tok(["Hello world, this is"], return_tensors="pt")
    free = ref.generate(**enc, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=PAD)
    text = tok.decode(free[0, enc["input_ids"].shape[1]:])
    stop = text[len(text) // 2: len(text) // 2 + 2]  # appears mid-way through the greedy continuation
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=PAD, stop_strings=[stop], tokenizer=tok)
    want, got = ref.generate(**enc, **kw), opt.generate(**enc, **kw)
    assert torch.equal(got, want) and got.shape[1] < free.shape[1]
    assert last_generate_stats(opt).path == "fast"


def test_pipeline_uses_fast_loop(pair):
    ref, opt, path = pair("llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    kw = dict(max_new_tokens=8, do_sample=False)
    got = transformers.pipeline("text-generation", model=opt, tokenizer=tok)("Hello world", **kw)
    assert last_generate_stats(opt).path == "fast"
    want = transformers.pipeline("text-generation", model=ref, tokenizer=tok)("Hello world", **kw)
    assert got == want


def test_stats_and_engine_model_times(pair):
    ref, opt, path = pair("llama")
    ids, mask = left_pad(prompts())
    _gen(opt, ids, mask, min_new_tokens=12)
    st = last_generate_stats(opt)
    assert (st.batch_size, st.prompt_tokens, st.new_tokens, st.path) == (3, ids.shape[1], 12, "fast")
    assert st.ttft_ms > 0 and st.ms_per_token > 0 and st.tokens_per_s > 0 and st.decode_tokens_per_s > 0
    assert st.step_ms == [] and hf_dsinfer.generation.last_generate_stats() is st
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = hf_dsinfer.init_inference(model, dtype="fp32", replace_with_kernel_inject=True, max_out_tokens=64)
    engine.profile_model_time()
    engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, pad_token_id=PAD)
    times = engine.model_times()
    assert len(times) == 5 and all(t > 0 for t in times)  # one per forward step: the prefill, then 4 decode steps
    # the HF path (beam search) times each forward too
    engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, num_beams=2,
                    pad_token_id=PAD)  # fmt: skip
    assert len(engine.model_times()) == 3 and last_generate_stats(engine).path == "hf"


def test_models_without_fused_layers_keep_hf_generate(tmp_path):
    path = save_tiny("llama", tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        path, inference_config={"dtype": "fp32", "replace_with_kernel_inject": False}
    )
    ids, mask = left_pad(prompts())
    assert torch.equal(_gen(plain, ids, mask), _gen(ref, ids, mask))
    assert last_generate_stats(plain).path == "hf"


# -- CUDA graphs (GPU only) -------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("name", [n for n in ("llama", "gemma2", "gpt2") if n in DECODERS])
def test_cuda_graph_decode_equals_eager_and_hf(name, tmp_path):
    path = save_tiny(name, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    base = {**INJECT, "max_batch_size": 4, "cuda_graph_batch_sizes": [1, 2, 4]}
    eager = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=base)
    graphed = transformers.AutoModelForCausalLM.from_pretrained(
        path, inference_config={**base, "enable_cuda_graph": True}
    )
    ids, mask = (t.cuda() for t in left_pad(prompts()))
    want = _gen(ref, ids, mask, min_new_tokens=12)
    assert torch.equal(_gen(eager, ids, mask, min_new_tokens=12), want)
    got = _gen(graphed, ids, mask, min_new_tokens=12)  # batch 3 -> bucket 4
    assert last_generate_stats(graphed).path == "fast+graphs"
    assert torch.equal(got, want)
    runner = graphed._dsinfer_generation.graphs.runner
    assert runner.stats.captured == (1, 2, 4) and runner.stats.replays == 11
    # EOS mid-way (deferred stop checks are rolled back), then a single row, then a batch above the buckets
    eos = int(want[1, ids.shape[1] + 3])
    assert torch.equal(_gen(graphed, ids, mask, eos_token_id=eos), _gen(ref, ids, mask, eos_token_id=eos))
    assert torch.equal(_gen(graphed, ids[:1], mask[:1]), _gen(ref, ids[:1], mask[:1]))
    big_ids, big_mask = ids.repeat(2, 1), mask.repeat(2, 1)  # 6 rows: cache re-allocates, steps run eagerly
    assert torch.equal(_gen(graphed, big_ids, big_mask), _gen(ref, big_ids, big_mask))
    assert torch.equal(_gen(graphed, ids, mask, min_new_tokens=12), want)  # graphs re-captured on the new cache
    torch.manual_seed(0)
    a = _gen(graphed, ids, mask, do_sample=True, top_k=20)
    torch.manual_seed(0)
    assert torch.equal(a, _gen(graphed, ids, mask, do_sample=True, top_k=20))
