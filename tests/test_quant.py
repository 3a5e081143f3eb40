"""Weight-only int8/int4 quantization at load (DeepSpeed's ``quant`` section / ``dtype="int8"``).

The oracle has two parts: (1) a quantized model computes exactly what HF's fp32 model computes with every quantized
linear's weight replaced by its dequantized values (so the quantized paths add no error of their own), and (2) the
quantization error itself, relative logits error against HF's fp32 model, is within the per-format bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from tiny_models import ARCHITECTURES, PAD, build_tiny, left_pad, prompts, save_tiny

import hf_dsinfer  # noqa: F401  (registers inference_config)
from hf_dsinfer import InferenceConfig
from hf_dsinfer.modules.quant_linear import CPU_KIND_ENV, QuantLinear
from hf_dsinfer.policies import is_injected

INT8 = {"enabled": True, "weight": {"num_bits": 8}}
INT4 = {"enabled": True, "weight": {"num_bits": 4}}  # groups of 128, clamped to the row (96 here)
INT4_ASYM = {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric", "group_size": 32}}
NEW_TOKENS = 20
# Relative logits error vs fp32 (Frobenius norm over the real tokens of a left-padded batch).
INT8_BOUND = 0.03
# int4 (groups of 128) against issue 15's bound: held on briefly trained tiny models (test_error_bounds_trained).
INT4_BOUND = 0.15
# int4 with round-to-nearest on the random-init models measures 0.21 (llama), 0.22 (qwen3), 0.33 (gemma2): isotropic
# Gaussian weights carry no structure for the rounding noise to hide behind (docs/quantization.md). This bound only
# guards against regressions.
INT4_GUARD = 0.40
TRAIN_STEPS = 100


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = save_tiny(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def _batch():
    ids, mask = left_pad(prompts())
    return ids, mask, mask.bool()


def _rel_err(got: torch.Tensor, ref: torch.Tensor, real: torch.Tensor) -> float:
    return ((got - ref)[real].norm() / ref[real].norm()).item()


def _load(path: str, quant, **extra):
    cfg = {"dtype": "fp32", "quant": quant, **extra}
    return transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)


def _dequantized_reference(path: str, model) -> torch.nn.Module:
    """HF's fp32 model whose quantized linears hold the dequantized weights of ``model`` (an HF-path model)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, QuantLinear):
                ref.get_submodule(name).weight.copy_(module.dequantized_weight(torch.float32))
                count += 1
    assert count > 0
    return ref


# -- config ----------------------------------------------------------------------------------------------------------


def test_config_deepspeed_names_and_int8_dtype():
    cfg = InferenceConfig(dtype="int8")
    assert cfg.dtype == "auto" and cfg.quant_settings.num_bits == 8 and cfg.quant_settings.q_groups == 1
    cfg = InferenceConfig(quant={"enabled": True, "weight": {"num_bits": 4, "q_groups": 2, "q_type": "asymmetric"}})
    s = cfg.quant_settings
    assert (s.num_bits, s.q_groups, s.symmetric, s.lm_head) == (4, 2, False, False)
    assert s.spec_for(96).group_size == 48  # two groups per row
    assert InferenceConfig(quant=INT4).quant_settings.spec_for(96).group_size == 96  # 128 clamped to the row
    assert InferenceConfig(quant=INT4).quant_settings.spec_for(300).group_size == 128
    assert InferenceConfig(quant={"enabled": False, "weight": {"num_bits": 4}}).quant is None
    again = InferenceConfig.from_dict(json.loads(cfg.to_json_string()))
    assert again == cfg and again.quant_settings == s


def test_int8_activations_half_on_gpu_fp32_on_cpu():
    cfg = InferenceConfig(dtype="int8")
    assert cfg.resolve_dtype(torch.float32, "cpu") == torch.float32
    assert InferenceConfig(dtype="int8").resolve_dtype(torch.float16, "cpu") == torch.float32
    assert InferenceConfig(dtype="int8").resolve_dtype(torch.float32, "cuda") in (torch.bfloat16, torch.float16)
    assert InferenceConfig().resolve_dtype(torch.float32, "cuda") == torch.float32  # unquantized: unchanged


@pytest.mark.parametrize(
    "quant, match",
    [
        ({"weight": {"num_bits": 2}}, r"quant\.weight\.num_bits must be 8 or 4"),
        ({"weight": {"q_groups": 4, "group_size": 32}}, r"quant\.weight\.group_size=32 and quant\.weight\.q_groups=4"),
        ({"weight": {"q_type": "nf4"}}, r"quant\.weight\.q_type"),
        ({"weight": {"group_size": 0}}, r"quant\.weight\.group_size must be an integer >= 1"),
        ({"weigth": {}}, r"Did you mean 'weight'"),
        ({"activation": {"enabled": True, "num_bits": 4}}, r"only weight-only quantization"),  # beyond DS defaults
    ],
)
def test_config_errors_name_the_key(quant, match):
    with pytest.raises(ValueError, match=match):
        InferenceConfig(quant=quant)


# -- loading, exactness, error bounds -------------------------------------------------------------------------------


@pytest.fixture
def exact_cpu_kind(monkeypatch):
    """CPU packs that compute exactly the reference (grouped weights dequantized per call, not fp16-rounded)."""
    monkeypatch.setenv(CPU_KIND_ENV, "exact")


@pytest.mark.parametrize("quant", [INT8, INT4, INT4_ASYM], ids=["int8", "int4", "int4-asym-g32"])
@torch.no_grad()
def test_hf_path_equals_dequantized_weights(saved, quant, exact_cpu_kind):
    """Without injection (HF's modules): every nn.Linear but the LM head is a QuantLinear, and the logits are those
    of HF's fp32 model holding the dequantized weights."""
    path = saved("llama")
    model = _load(path, quant, replace_with_kernel_inject=False)
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 2 * 7 and not isinstance(model.lm_head, QuantLinear)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    ids, mask, real = _batch()
    ref = _dequantized_reference(path, model)
    got = model(input_ids=ids, attention_mask=mask).logits
    want = ref(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("quant", [INT8, INT4_ASYM], ids=["int8", "int4-asym-g32"])
@torch.no_grad()
def test_injected_equals_hf_path(saved, quant, exact_cpu_kind):
    """Fused layers pack quantized q/k/v and gate/up (row-wise cat): same logits as the quantized HF modules."""
    path = saved("llama")
    fused = _load(path, quant, replace_with_kernel_inject=True)
    plain = _load(path, quant, replace_with_kernel_inject=False)
    assert is_injected(fused)
    layer = fused.model.layers[0]
    assert isinstance(layer.attn.qkv, QuantLinear) and isinstance(layer.mlp.up, QuantLinear)
    assert layer.attn.qkv.out_features == (6 + 2 * 2) * 16 and layer.mlp.up.out_features == 2 * 136
    ids, mask, real = _batch()
    got = fused(input_ids=ids, attention_mask=mask).logits
    want = plain(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_default_cpu_kind_exact(saved, monkeypatch):
    """The default CPU pack for grouped int4 (fbgemm's fp16-weight GEMM over (q - z) * s in fp16) is exact: the
    quantizer keeps int4 scales to 8 (7 asymmetric) significant bits so every product fits fp16. Scales from
    elsewhere that do not fit make the default fall back to the exact dequantizing kind; asking for fp16gemm rounds
    them (~1e-3)."""
    path = saved("llama")
    ids, mask, real = _batch()
    monkeypatch.setenv(CPU_KIND_ENV, "exact")
    exact = _load(path, INT4_ASYM)(input_ids=ids, attention_mask=mask).logits
    monkeypatch.setenv(CPU_KIND_ENV, "auto")
    model = _load(path, INT4_ASYM)

    def kinds():
        return {m.cpu_packed().kind for m in model.modules() if isinstance(m, QuantLinear)}

    got = model(input_ids=ids, attention_mask=mask).logits
    assert kinds() == {"fp16gemm"}
    assert _rel_err(got, exact, real) < 1e-6  # fp32 summation order only
    # scales with more bits (one fp32 ulp-ish nudge): the default is exact again, by another kind
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.weight_scales.mul_(1 + 2**-12)
    monkeypatch.setenv(CPU_KIND_ENV, "exact")
    nudged_exact = model(input_ids=ids, attention_mask=mask).logits
    monkeypatch.setenv(CPU_KIND_ENV, "auto")
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m._cpu_packed = None  # the env var is read at pack time
    assert "fp16gemm" not in kinds()
    assert _rel_err(model(input_ids=ids, attention_mask=mask).logits, nudged_exact, real) < 1e-6
    monkeypatch.setenv(CPU_KIND_ENV, "fp16gemm")
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m._cpu_packed = None
    rounded = model(input_ids=ids, attention_mask=mask).logits
    assert kinds() == {"fp16gemm"} and 0 < _rel_err(rounded, nudged_exact, real) < 2e-3


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2"])
@torch.no_grad()
def test_error_bounds_vs_fp32(saved, name):
    path = saved(name)
    ids, mask, real = _batch()
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = ref(input_ids=ids, attention_mask=mask).logits
    errors = {}
    for label, quant in (("int8", INT8), ("int4", INT4)):
        model = _load(path, quant)
        assert is_injected(model)
        errors[label] = _rel_err(model(input_ids=ids, attention_mask=mask).logits, want, real)
    assert errors["int8"] <= INT8_BOUND, errors
    assert errors["int4"] <= INT4_GUARD, errors
    assert errors["int4"] > errors["int8"]  # the 4-bit weights really are coarser


def _train_briefly(name: str, directory) -> tuple[str, torch.Tensor]:
    """Row ``name`` after ``TRAIN_STEPS`` AdamW steps of next-byte prediction on a Python source file (bytes as
    tokens 3..258): weights with the structure trained models have, saved to ``directory``."""
    import collections

    text = open(collections.__file__, "rb").read()[:100_000]
    data = torch.tensor(list(text)) + 3  # [L] token ids
    model = build_tiny(name).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(TRAIN_STEPS):
        starts = torch.randint(0, len(data) - 65, (8,), generator=g)
        x = torch.stack([data[i : i + 64] for i in starts.tolist()])  # [8, 64]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(directory)
    return str(directory), data


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2"])
@torch.no_grad()
def test_error_bounds_trained(tmp_path, name):
    """Issue 15's bounds (int8 <= 3%, int4 group 128 <= 15% relative logits error vs fp32) on tiny models trained for
    100 steps; their next-token argmax agrees with fp32 on nearly every position."""
    with torch.enable_grad():
        path, data = _train_briefly(name, tmp_path)
    ids = torch.stack([data[i : i + 24] for i in (1000, 5000, 9000)])  # [3, 24] held text
    mask = torch.ones_like(ids)
    want = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids=ids).logits
    for quant, bound in ((INT8, INT8_BOUND), (INT4, INT4_BOUND)):
        got = _load(path, quant)(input_ids=ids, attention_mask=mask).logits
        err = ((got - want).norm() / want.norm()).item()
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        assert err <= bound, (quant, err)
        assert agree >= 0.9, (quant, agree)


@pytest.mark.slow
@torch.no_grad()
def test_int8_greedy_matches_fp32(saved):
    path = saved("llama")
    ids, mask, _ = _batch()
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = ref.generate(input_ids=ids, attention_mask=mask, **kw)
    got = _load(path, INT8).generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(got, want)


@torch.no_grad()
def test_dtype_int8_and_init_inference(saved):
    """``dtype="int8"`` is int8 weights with fp32 activations on CPU; ``init_inference`` quantizes a built model
    the same way the loader does."""
    path = saved("llama")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config={"dtype": "int8"})
    assert loaded.model.layers[0].attn.qkv.weight.dtype == torch.int8
    assert loaded.model.layers[0].attn.qkv.weight_scales.dtype == torch.float32
    built = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = hf_dsinfer.init_inference(built, dtype="int8")
    ids, mask, real = _batch()
    a = loaded(input_ids=ids, attention_mask=mask).logits
    b = engine.module(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(a[real], b[real], rtol=0, atol=0)


# -- save / reload ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inject", [True, False], ids=["injected", "hf"])
@torch.no_grad()
def test_save_reload_identical(saved, tmp_path, inject):
    path = saved("qwen3")
    model = _load(path, INT4_ASYM, replace_with_kernel_inject=inject)
    ids, mask, real = _batch()
    before = model(input_ids=ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "dsinfer" and config["quant"]["weight"]["num_bits"] == 4
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        assert q.dtype == torch.uint8 and q.ndim == 1  # flat: plain transformers cannot read it as a float weight
        assert "model.layers.0.self_attn.q_proj.weight_scales" in f.keys()
        assert "model.layers.0.self_attn.q_proj.weight_zeros" in f.keys()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert is_injected(reloaded) == inject
    after = reloaded(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before[real], after[real])
    # Other quant settings than the checkpoint's are refused, naming both.
    with pytest.raises(ValueError, match="quantized as int4 asymmetric.*asks for int8"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, inference_config={"quant": INT8})


@pytest.mark.slow  # a fresh interpreter importing transformers and torch
def test_reload_without_hf_dsinfer_fails_loudly(saved, tmp_path):
    path = saved("llama")
    _load(path, INT8).save_pretrained(tmp_path)
    script = textwrap.dedent(
        f"""
        import transformers
        transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/", env=env)
    assert proc.returncode != 0, "transformers loaded a quantized checkpoint without hf_dsinfer"
    out = proc.stdout + proc.stderr
    assert "Unknown quantization type" in out and "dsinfer" in out  # transformers' registry names the method
    assert "ignore_mismatched_sizes" in out and "q_proj.weight" in out  # and the load stops on the flat weights


# -- Hybrid Engine -----------------------------------------------------------------------------------------------


def test_hybrid_engine_refuses_quantized_training_weights(saved):
    quantized = _load(saved("llama"), INT8)
    with pytest.raises(ValueError, match="training model is quantized"):
        hf_dsinfer.HybridEngine(quantized, inference_config={"dtype": "fp32"})


@pytest.mark.parametrize("quant", [INT8, INT4_ASYM], ids=["int8", "int4-asym-g32"])
@torch.no_grad()
def test_hybrid_engine_quantized_inference_copy(saved, quant, exact_cpu_kind):
    """QLoRA-style rollouts: a float training model, an int8/int4 inference copy refreshed in place from it. The
    copy computes what a model loaded quantized from the same weights computes, before and after an update."""
    path = saved("llama")
    ids, mask, real = _batch()
    train = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    he = hf_dsinfer.HybridEngine(train, inference_config={"dtype": "fp32", "quant": quant})
    qkv = he.module.model.layers[0].attn.qkv
    assert isinstance(qkv, QuantLinear)
    address = qkv.weight.data_ptr()

    def expected(model):
        copy = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        copy.load_state_dict(model.state_dict())
        return hf_dsinfer.init_inference(copy, dtype="fp32", quant=quant).module(input_ids=ids, attention_mask=mask)

    he.eval()
    got = he.module(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], expected(train).logits[real], rtol=1e-5, atol=1e-6)
    he.train()
    for p in train.parameters():  # a training step's worth of change
        p.add_(torch.randn_like(p) * 0.01)
    he.eval()
    after = he.module(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(after[real], got[real])
    torch.testing.assert_close(after[real], expected(train).logits[real], rtol=1e-5, atol=1e-6)
    assert qkv.weight.data_ptr() == address  # refreshed in place (captured graphs stay valid)
    out = he.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert out.shape == (ids.shape[0], ids.shape[1] + 4)


# -- compiled CPU decode step ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("quant", [INT8, INT4_ASYM], ids=["int8", "int4-asym-g32"])
@torch.no_grad()
def test_compiled_cpu_decode_step_equals_eager(saved, monkeypatch, quant):
    """The quantized linears (their CPU packs) run inside the compiled decode step: same tokens as the eager step."""
    from hf_dsinfer.generation.api import GEN_ATTR

    path = saved("llama")
    ids, mask, _ = _batch()
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=PAD)
    monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", "0")
    eager = _load(path, quant, max_out_tokens=48, max_batch_size=4).generate(input_ids=ids, attention_mask=mask, **kw)
    monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", "sync")
    model = _load(path, quant, max_out_tokens=48, max_batch_size=4)
    got = model.generate(input_ids=ids, attention_mask=mask, **kw)
    compiled = getattr(model, GEN_ATTR).step.compiled
    assert compiled.compile_s and not compiled.failed, "the decode step did not run compiled"
    assert torch.equal(got, eager)


# -- hf-dsinfer bench --quant --------------------------------------------------------------------------------------


def test_bench_quant_contenders():
    from hf_dsinfer.bench.cli import _quant_peers
    from hf_dsinfer.bench.decode import BenchArgs, run_bench

    assert _quant_peers("int8, int4") == ("dsinfer-int8", "dsinfer-int4") and _quant_peers(None) == ()
    with pytest.raises(SystemExit, match="--quant takes int8, int4"):
        _quant_peers("int3")
    args = BenchArgs(preset="tiny", batch_sizes=(1,), prompt_len=8, new_tokens=4, repeats=1,
                     peers=("dsinfer", "dsinfer-int8", "dsinfer-int4"))  # fmt: skip
    rows = {r["peer"]: r for r in run_bench(args)["rows"]}
    for peer in args.peers:
        assert rows[peer]["decode_tokens_per_s"] > 0, rows[peer]
    assert rows["dsinfer-int8"]["name"] == "hf_dsinfer int8"
    # bytes per decode step: the quantized contenders read fewer weight bytes (GB/s x ms/token)
    step_bytes = {p: rows[p]["gbs"] * rows[p]["ms_per_token"] for p in args.peers}
    assert step_bytes["dsinfer-int4"] < step_bytes["dsinfer-int8"] < step_bytes["dsinfer"]


@torch.no_grad()
def test_lm_head_quantized_on_request(saved, tmp_path):
    path = saved("llama")  # untied head
    quant = {"enabled": True, "weight": {"num_bits": 8, "lm_head": True}}
    model = _load(path, quant)
    assert isinstance(model.lm_head, QuantLinear) and not isinstance(model.model.embed_tokens, QuantLinear)
    ids, mask, real = _batch()
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got = model(input_ids=ids, attention_mask=mask).logits
    assert _rel_err(got, ref(input_ids=ids, attention_mask=mask).logits, real) <= INT8_BOUND
    model.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(again.lm_head, QuantLinear)
    assert torch.equal(again(input_ids=ids, attention_mask=mask).logits[real], got[real])


@torch.no_grad()
def test_cpu_pack_follows_buffer_changes():
    """The CPU pack is rebuilt when the buffers are written in place or replaced, so it never serves stale weights."""
    from hf_dsinfer.kernels.quant_format import QuantSpec

    torch.manual_seed(0)
    lin = QuantLinear.from_float(torch.randn(40, 72), QuantSpec(8, 72), bias=torch.randn(40))
    x = torch.randn(3, 72)
    before = lin(x)
    first = lin.cpu_packed()
    assert first is not None and lin.cpu_packed() is first  # built once
    lin.weight_scales.mul_(2.0)  # in place: same storage, new version
    want = (x @ lin.dequantized_weight(torch.float32).t()) + lin.bias
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(lin(x), before)
    lin.weight = torch.zeros_like(lin.weight)  # replaced
    torch.testing.assert_close(lin(x), lin.bias.expand(3, 40), rtol=0, atol=0)


# -- every decoder family of the fidelity table ----------------------------------------------------------------


_DECODERS = [n for n, a in ARCHITECTURES.items() if not a.encoder]


@pytest.mark.slow
@pytest.mark.parametrize("name", _DECODERS)
@torch.no_grad()
def test_int8_every_decoder_family(saved, name, tmp_path):
    """Fused (or generic) int8 models of every decoder row stay within the int8 bound; regrouped fused qkv
    (gpt_neox, falcon, bloom) packs its quantized rows like its float ones and saves back under HF's names."""
    path = saved(name)
    ids, mask, real = _batch()
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = ref(input_ids=ids, attention_mask=mask).logits
    model = _load(path, INT8)
    quantized = sum(isinstance(m, QuantLinear) for m in model.modules())
    assert quantized > 0 or name == "gpt2"  # GPT-2's Conv1D stays float (one warning)
    got = model(input_ids=ids, attention_mask=mask).logits
    assert _rel_err(got, want, real) <= INT8_BOUND
    if name in ("gpt_neox", "falcon_new", "bloom"):
        model.save_pretrained(tmp_path)
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
        assert torch.equal(again(input_ids=ids, attention_mask=mask).logits[real], got[real])


def test_tensor_parallel_load_of_a_quantized_checkpoint_is_refused(saved, tmp_path):
    _load(saved("llama"), INT8).save_pretrained(tmp_path)
    cfg = {"tensor_parallel": {"tp_size": 1}, "checkpoint": None}
    from hf_dsinfer.integration import hooks

    with pytest.raises(ValueError, match="saved with quantized weights; tensor-parallel loading reads float"):
        hooks._load_tensor_parallel(transformers.LlamaForCausalLM, (str(tmp_path),), InferenceConfig(**cfg), {})
