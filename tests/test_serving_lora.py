"""Several LoRA adapters per batch (ServingEngine(enable_lora=True), serving/lora.py): every request's greedy tokens
equal peft's ``PeftModel`` with that adapter alone (fp32), while requests of adapters of different ranks and the base
share each step; prefix sharing never crosses adapters; adapters load and unload at run time; bad adapters and
settings are refused with the setting named."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from hf_dsinfer.kernels.lora import lora_add_triton
from peft import LoraConfig, PeftModel, get_peft_model
from tiny_models import PAD, prompts, randomize_lora, save_tiny

import hf_dsinfer  # noqa: F401 - registers inference_config=
from hf_dsinfer.modules import lora as lora_module
from hf_dsinfer.modules.lora import MultiLoRALinear
from hf_dsinfer.serving import ServingEngine

pytestmark = pytest.mark.usefixtures("one_thread")

INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 64}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, rslora): different ranks (one at max_lora_rank), one rank-stabilized scale.
ADAPTERS = {"a2": (2, 4, False), "a8": (8, 16, True), "a16": (16, 8, False)}
NEW = 8


def _save_adapter(base_path: str, out: str, rank: int, alpha: int, rslora: bool, seed: int, targets=TARGETS) -> str:
    model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    randomize_lora(peft_model, seed=seed, scale=0.3)  # peft starts B at zero: a real, non-zero delta
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The base folder, one folder per adapter, the injected model, and the peft oracle holding every adapter."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny("llama", root / "base")
    dirs = {n: _save_adapter(base, str(root / n), r, a, rs, seed=i + 1) for i, (n, (r, a, rs)) in
            enumerate(ADAPTERS.items())}  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(base, inference_config=INJECT).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    oracle = None
    for name, d in dirs.items():
        if oracle is None:
            oracle = PeftModel.from_pretrained(ref, d, adapter_name=name).eval()
        else:
            oracle.load_adapter(d, adapter_name=name)
    return {"base": base, "dirs": dirs, "model": model, "oracle": oracle, "root": root}


def _greedy() -> transformers.GenerationConfig:
    return transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=-1)


def _peft_alone(oracle, adapter: str | None, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=_greedy())
    with torch.no_grad():
        if adapter is None:
            with oracle.disable_adapter():
                out = oracle.generate(**kwargs)
        else:
            oracle.set_adapter(adapter)
            out = oracle.generate(**kwargs)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def engine(setup):
    eng = ServingEngine(setup["model"], block_size=4, max_batch_tokens=16, enable_lora=True, max_loras=4,
                        max_lora_rank=16, generation_config=_greedy())  # fmt: skip
    for name, d in setup["dirs"].items():
        eng.load_lora_adapter(name, d)
    return eng


def test_mixed_adapters_and_base_in_one_step_equal_peft_alone(setup, engine):
    """3 adapters (ranks 2, 8, 16; one rslora) and the base, two prompts each, all submitted at once: they share
    steps (prefill chunks of several adapters with decode tokens), and each equals peft with its adapter alone."""
    batch = prompts((5, 11), seed=3)
    names = [*ADAPTERS, None]
    handles = [(a, p, engine.submit(p, adapter=a)) for p in batch for a in names]
    engine.run_until_idle()
    outputs = {}
    for a, p, h in handles:
        want = _peft_alone(setup["oracle"], a, p)
        assert h.result() == want, f"adapter {a}, prompt of {len(p)} tokens"
        outputs.setdefault(tuple(p), set()).add(tuple(want))
    assert all(len(outs) == len(names) for outs in outputs.values())  # every adapter really changes the output
    assert sum(isinstance(m, MultiLoRALinear) for m in setup["model"].modules()) == 4 * 2  # 4 fused linears x 2 layers


def test_prefix_sharing_never_crosses_adapters(setup, engine):
    """The same 12-token prompt under a8, then a16, then the base, then a8 again: only the last one reuses KV."""
    prompt = prompts((12,), seed=7)[0]
    hits = []
    for adapter in ("a8", "a16", None, "a8"):
        before = engine.stats.prefix_hit_tokens
        h = engine.submit(prompt, adapter=adapter)
        engine.run_until_idle()
        assert h.result() == _peft_alone(setup["oracle"], adapter, prompt), adapter
        hits.append(engine.stats.prefix_hit_tokens - before)
    assert hits[:3] == [0, 0, 0] and hits[3] > 0, hits


def test_load_unload_at_run_time_and_refusals(setup, engine, tmp_path):
    prompt = prompts((6,), seed=11)[0]
    # unload is refused while a request holds the adapter, then works
    h = engine.submit(prompt, adapter="a2")
    with pytest.raises(ValueError, match="unfinished"):
        engine.unload_lora_adapter("a2")
    engine.run_until_idle()
    assert h.result() == _peft_alone(setup["oracle"], "a2", prompt)
    engine.unload_lora_adapter("a2")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a2'"):
        engine.submit(prompt, adapter="a2")
    # a new adapter takes the freed slot; its output is its own (the old weights are gone)
    d = _save_adapter(setup["base"], str(tmp_path / "b4"), 4, 8, False, seed=9, targets=["q_proj", "v_proj"])
    engine.load_lora_adapter("b4", d)
    ref = transformers.AutoModelForCausalLM.from_pretrained(setup["base"], dtype=torch.float32).eval()
    b4 = PeftModel.from_pretrained(ref, d, adapter_name="b4").eval()
    h = engine.submit(prompt, adapter="b4")
    engine.run_until_idle()
    assert h.result() == _peft_alone(b4, "b4", prompt)
    # the slots are full now (a8, a16, b4 + one free): a 5th load is refused naming --max-loras
    engine.load_lora_adapter("a2", setup["dirs"]["a2"])
    with pytest.raises(ValueError, match="--max-loras"):
        engine.load_lora_adapter("again", setup["dirs"]["a8"])
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora_adapter("a8", setup["dirs"]["a8"])
    # rank above --max-lora-rank, and a target with no side path (the LM head)
    big = _save_adapter(setup["base"], str(tmp_path / "r32"), 32, 8, False, seed=2, targets=["q_proj"])
    engine.unload_lora_adapter("b4")
    with pytest.raises(ValueError, match="--max-lora-rank"):
        engine.load_lora_adapter("r32", big)
    head = _save_adapter(setup["base"], str(tmp_path / "head"), 2, 4, False, seed=2, targets=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="lm_head"):
        engine.load_lora_adapter("head", head)
    cfg = json.load(open(os.path.join(head, "adapter_config.json")))
    cfg["use_dora"] = True
    json.dump(cfg, open(os.path.join(head, "adapter_config.json"), "w"))
    with pytest.raises(ValueError, match="use_dora"):
        engine.load_lora_adapter("dora", head)
    with pytest.raises(ValueError, match="adapter_config.json"):
        engine.load_lora_adapter("nothing", str(tmp_path))
    # the engine still serves after every refusal
    h = engine.submit(prompt, adapter="a16")
    engine.run_until_idle()
    assert h.result() == _peft_alone(setup["oracle"], "a16", prompt)


def test_adapter_without_enable_lora_is_refused(setup):
    eng = ServingEngine(setup["model"], block_size=4, generation_config=_greedy())
    with pytest.raises(ValueError, match="enable_lora=True"):
        eng.submit([5, 6, 7], adapter="a8")


def test_side_path_through_the_triton_kernel(setup, engine, monkeypatch):
    """The side paths on the gathered Triton kernel (the interpreter on CPU; the rest of the step on torch), one
    prompt under every adapter and the base in one batch: still equal to peft alone."""
    calls = []
    monkeypatch.setattr(lora_module, "lora_add", lambda *a: calls.append(1) or lora_add_triton(*a[:5]))
    prompt = prompts((7,), seed=5)[0]
    names = [n for n in ("a8", "a16", "a2") if n in engine.lora.names()] + [None]
    handles = [(a, engine.submit(prompt, adapter=a, max_new_tokens=4)) for a in names]
    engine.run_until_idle()
    assert calls
    for a, h in handles:
        assert h.result() == _peft_alone(setup["oracle"], a, prompt)[:4], a


def test_openai_client_picks_the_adapter_by_model(setup, engine):
    """Over HTTP (openai client): ``model`` picks the adapter or the base, ``/v1/models`` lists the adapters, and
    vLLM's ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` change what is served while the server runs."""
    import openai
    from transformers import AutoTokenizer

    from hf_dsinfer.serving.server import OpenAIServer

    tok = AutoTokenizer.from_pretrained(setup["base"])
    server = OpenAIServer(engine, tok, "base")
    url = server.start("127.0.0.1", 0)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", timeout=120, max_retries=0)
        loaded = engine.lora.names()
        assert [m.id for m in client.models.list().data] == ["base", *loaded]
        prompt = prompts((6,), seed=13)[0]

        def check(model: str, adapter: str | None) -> None:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
            want = _peft_alone(setup["oracle"], adapter, prompt)[:5]
            assert r.model == model and r.choices[0].text == tok.decode(want), model

        check("base", None)
        check("a8", "a8")
        with pytest.raises(openai.NotFoundError, match="LoRA adapters"):
            client.completions.create(model="c2", prompt=prompt, max_tokens=2)
        post = client.with_options(max_retries=0).post
        text = post("/load_lora_adapter", body={"lora_name": "c2", "lora_path": setup["dirs"]["a16"]}, cast_to=str)
        assert "c2" in text and "c2" in [m.id for m in client.models.list().data]
        check("c2", "a16")  # the same folder as a16, under its own name
        with pytest.raises(openai.BadRequestError, match="--max-loras"):
            post("/load_lora_adapter", body={"lora_name": "c3", "lora_path": setup["dirs"]["a2"]}, cast_to=str)
        post("/unload_lora_adapter", body={"lora_name": "c2"}, cast_to=str)
        with pytest.raises(openai.NotFoundError):
            post("/unload_lora_adapter", body={"lora_name": "c2"}, cast_to=str)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="c2", prompt=prompt, max_tokens=2)
    finally:
        server.stop()


def test_serve_command_line_options(setup):
    """``hf-dsinfer serve``'s adapter options reach the engine: --lora-modules as name=DIR and as vLLM's JSON."""
    import argparse

    from hf_dsinfer.serving.serve_cli import _lora_modules, add_serve_arguments, build_server

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    a2, a8 = setup["dirs"]["a2"], setup["dirs"]["a8"]
    args = parser.parse_args([setup["base"], "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"x={a2}",
                              json.dumps({"name": "y", "path": a8})])  # fmt: skip
    modules = _lora_modules(args.lora_modules)
    assert modules == {"x": a2, "y": a8} and args.max_loras is None
    with pytest.raises(SystemExit, match="name=path"):
        _lora_modules(["no-equals-sign"])
    server = build_server(setup["base"], INJECT, enable_lora=True, lora_modules=modules, max_lora_rank=8)
    assert server.engine.lora.names() == ["x", "y"] and server.engine.lora.max_loras == 4
    with pytest.raises(ValueError, match="--enable-lora"):
        build_server(setup["base"], INJECT, lora_modules=modules)


def test_rank_and_alpha_patterns_and_a_model_with_fused_hf_projections(setup, engine, tmp_path):
    """peft's rank_pattern / alpha_pattern (per-module rank and scale), and phi3, whose HF layers already hold the
    fused qkv_proj / gate_up_proj (one adapted projection per fused linear): greedy equal to peft alone."""
    model = transformers.AutoModelForCausalLM.from_pretrained(setup["base"], dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, rank_pattern={"q_proj": 8},
                        alpha_pattern={"v_proj": 32, "down_proj": 2})  # fmt: skip
    pm = get_peft_model(model, config)
    randomize_lora(pm, seed=21, scale=0.3)
    pm.save_pretrained(tmp_path / "pat")
    engine.load_lora_adapter("pat", str(tmp_path / "pat"))
    prompt = prompts((9,), seed=17)[0]
    h = engine.submit(prompt, adapter="pat")
    engine.run_until_idle()
    ref = transformers.AutoModelForCausalLM.from_pretrained(setup["base"], dtype=torch.float32).eval()
    assert h.result() == _peft_alone(PeftModel.from_pretrained(ref, str(tmp_path / "pat"), adapter_name="p"), "p",
                                     prompt)  # fmt: skip
    engine.unload_lora_adapter("pat")

    base = save_tiny("phi3", tmp_path / "phi3")
    d = _save_adapter(base, str(tmp_path / "phi3-lora"), 4, 8, False, seed=5, targets=["qkv_proj", "o_proj",
                      "gate_up_proj", "down_proj"])  # fmt: skip
    opt = transformers.AutoModelForCausalLM.from_pretrained(base, inference_config=INJECT).eval()
    eng = ServingEngine(opt, block_size=4, enable_lora=True, max_loras=1, generation_config=_greedy())
    eng.load_lora_adapter("x", d)
    handles = [eng.submit(prompt, adapter=a) for a in ("x", None)]
    eng.run_until_idle()
    ref = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    oracle = PeftModel.from_pretrained(ref, d, adapter_name="x").eval()
    assert [h.result() for h in handles] == [_peft_alone(oracle, "x", prompt), _peft_alone(oracle, None, prompt)]
