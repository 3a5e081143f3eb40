"""Contract tests: one per transformers behaviour hf_dsinfer relies on (docs/generation.md lists them).

Each fails with a message naming the contract, so a transformers release that changes one of them points at the
place to adapt (``hf_dsinfer/hf_compat.py``) instead of at a wrong token deep in another test.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from tiny_models import build_tiny, prompts
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, TrainerCallback

from hf_dsinfer import hf_compat


def _contract(name: str, ok: bool, detail: str = "") -> None:
    assert ok, f"transformers {transformers.__version__} broke the contract '{name}'. {detail}".strip()


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_custom_generate_receives_the_prepared_call(llama):
    """generate(custom_generate=callable) hands the callable the prepared ids, processors, criteria, config and model
    kwargs (with the cache under the installed name), and returns what it returns (the fast loop's entry)."""
    seen = {}

    def loop(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        seen.update(model_kwargs, ids=input_ids, procs=logits_processor, crits=stopping_criteria, cfg=generation_config)
        return "sentinel"

    ids = torch.tensor([[3, 4, 5]])
    out = llama.generate(input_ids=ids, max_new_tokens=3, do_sample=False, custom_generate=loop)
    _contract("custom_generate returns the callable's result", out == "sentinel")
    _contract("custom_generate gets input_ids", torch.equal(seen["ids"], ids))
    _contract("custom_generate gets a GenerationConfig", isinstance(seen["cfg"], GenerationConfig))
    _contract("custom_generate gets a stopping criteria list", len(seen["crits"]) >= 1)
    _contract(
        "the cache reaches custom_generate under hf_compat.cache_kwarg()",
        hf_compat.cache_kwarg() in seen,
        f"model kwargs were {sorted(k for k in seen if k not in ('ids', 'procs', 'crits', 'cfg'))}",
    )


def test_cache_keyword_name(llama):
    """Model forwards and prepare_inputs_for_generation take / emit the cache under hf_compat.cache_kwarg()."""
    name = hf_compat.cache_kwarg()
    _contract("forward takes the cache keyword", name in inspect.signature(type(llama).forward).parameters)
    ids = torch.tensor([[3, 4, 5]])
    out = llama(input_ids=ids, use_cache=True)
    cache = hf_compat.output_cache(out)
    _contract("outputs carry the cache under hf_compat.cache_field()", isinstance(cache, transformers.Cache))
    inputs = llama.prepare_inputs_for_generation(torch.tensor([[3, 4, 5, 6]]), **{name: cache})
    _contract("prepare_inputs_for_generation emits the cache keyword", inputs.get(name) is cache, str(sorted(inputs)))


def test_quantizer_hook_names():
    """Every hook DsInferQuantizer overrides is one HfQuantizer defines (else transformers never calls it)."""
    from transformers.quantizers.base import HfQuantizer

    from hf_dsinfer.integration.quantizer import DsInferQuantizer

    ours = {n for n, v in vars(DsInferQuantizer).items() if callable(v) or isinstance(v, property)}
    ours -= {"__init__", "__module__", "_device"}  # _device: a helper of ours
    missing = sorted(n for n in ours if not hasattr(HfQuantizer, n))
    _contract("HfQuantizer hook names", not missing, f"HfQuantizer has no {missing}")
    for name in ("_process_model_before_weight_loading", "_process_model_after_weight_loading"):
        called = name in inspect.getsource(HfQuantizer)
        _contract(f"HfQuantizer.{name} is called by preprocess/postprocess_model", called)


def test_conversion_ops_convert_signature():
    """The quantize-on-load op is a ConversionOps whose convert(input_dict, ..., model=..., full_layer_name=...)
    transformers calls with keywords the op reads."""
    from transformers.core_model_loading import ConversionOps

    params = inspect.signature(ConversionOps.convert).parameters
    _contract("ConversionOps.convert takes input_dict first", list(params)[1] == "input_dict", str(list(params)))
    src = inspect.getsource(transformers.core_model_loading)
    for key in ("full_layer_name=", "model="):
        _contract(f"transformers calls convert with {key}", key in src)


def test_attention_interface_forwards_call_kwargs():
    """A function registered with AttentionInterface gets (module, q [B, H, T, D], k, v, mask, scaling=..., ...) and
    the extra keyword arguments given to the model's forward (the generic path passes its step context that way)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from hf_dsinfer.policies.generic import STEP_KWARG

    calls = []

    def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append((query.shape, kwargs.get(STEP_KWARG), scaling))
        out = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(query.shape[1] //
                                                               key.shape[1], 1), value.repeat_interleave(
                                                               query.shape[1] // value.shape[1], 1), is_causal=True)
        return out.transpose(1, 2), None  # fmt: skip

    AttentionInterface.register("dsinfer_contract_probe", probe)
    AttentionMaskInterface.register("dsinfer_contract_probe", sdpa_mask)
    model = build_tiny("llama").eval()
    model.set_attn_implementation("dsinfer_contract_probe")
    marker = object()
    with torch.no_grad():
        model(input_ids=torch.tensor([prompts()[0]]), **{STEP_KWARG: marker})
    _contract("AttentionInterface function called per layer", len(calls) == model.config.num_hidden_layers)
    _contract("q is [B, H, T, D]", calls[0][0][1] == model.config.num_attention_heads, str(calls[0][0]))
    _contract("forward kwargs reach the attention function", all(c[1] is marker for c in calls))
    _contract("attention gets scaling=", all(isinstance(c[2], float) for c in calls))


def test_trainer_callback_events_used():
    """The Trainer events HybridEngineCallback implements exist on TrainerCallback (else they are never called)."""
    from hf_dsinfer.hybrid.callback import HybridEngineCallback

    ours = sorted(n for n in vars(HybridEngineCallback) if n.startswith("on_"))
    missing = [n for n in ours if not hasattr(TrainerCallback, n)]
    _contract("TrainerCallback events", ours and not missing, f"TrainerCallback has no {missing}")


def test_generate_batch_output_types(llama):
    """generate_batch returns {request_id: GenerationOutput} with prompt_ids, generated_tokens and a finished status
    (what hf_dsinfer's continuous batching returns in its place)."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

    cfg = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # A small paged cache: left to itself, transformers sizes it from the free memory of the machine (GBs on a CPU).
    cb = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=32)
    out = llama.generate_batch(inputs=[[3, 4, 5], [6, 7]], generation_config=cfg, continuous_batching_config=cb,
                               progress_bar=False)  # fmt: skip
    _contract("generate_batch returns a dict", isinstance(out, dict) and len(out) == 2, repr(type(out)))
    first = next(iter(out.values()))
    _contract("values are GenerationOutput", isinstance(first, GenerationOutput), repr(type(first)))
    _contract("GenerationOutput fields", all(hasattr(first, f) for f in ("prompt_ids", "generated_tokens", "status")))
    _contract("finished status", first.status == RequestStatus.FINISHED, repr(first.status))
    _contract("tokens generated", all(len(o.generated_tokens) == 3 for o in out.values()))


def test_compile_config_can_compile_off_cuda():
    """``hf-dsinfer bench``'s HF static+compile contender needs generate to compile on a CPU: CompileConfig's flag
    for it (``hf_compat.compile_config_all_devices``) exists, and generate's auto-compile check reads it."""
    from transformers import CompileConfig

    cc = hf_compat.compile_config_all_devices(CompileConfig())
    _contract("CompileConfig has the all-devices flag", getattr(cc, "_compile_all_devices", None) is True)
    from transformers.generation import utils

    _contract("generate's auto-compile reads the flag", "_compile_all_devices" in inspect.getsource(utils))
