"""The transformers boundary: every use of a transformers internal lives here.

transformers renames internals in minor releases (5.24 renamed the cache keyword ``past_key_values`` to ``cache`` in
``generate``, every forward and the output dataclasses). The rest of hf_dsinfer imports transformers' public API or
this module, never a private name, so a new release is adapted here once. Features are probed (signatures,
attributes), never inferred from version numbers; each behaviour relied on has a contract test
(``tests/test_hf_contracts.py``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import transformers

# The transformers releases the test suite runs on (CI: the newest the registry resolves, and the oldest below).
OLDEST_TESTED = "5.17.0"
NEWEST_TESTED = "5.24.0"


def transformers_version() -> str:
    """The installed transformers version string."""
    return transformers.__version__


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def in_tested_range(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed one) lies between the oldest and newest tested releases."""
    v = _release(version or transformers_version())
    return _release(OLDEST_TESTED) <= v <= _release(NEWEST_TESTED)


# -- the cache keyword ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def cache_kwarg() -> str:
    """The name transformers' models take their KV cache under: ``"cache"`` (5.24+) or ``"past_key_values"``.

    Probed on a model forward's signature (what ``generate`` and the attention layers call), not on the version.
    """
    from transformers import LlamaForCausalLM

    params = inspect.signature(LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


CACHE_NAMES = ("cache", "past_key_values")


def pop_cache(kwargs: dict[str, Any], where: str = "forward") -> Any:
    """Remove and return the cache from ``kwargs`` under either name.

    Both names given with different objects is an error (which one did the caller mean?).
    """
    new = kwargs.pop("cache", None)
    old = kwargs.pop("past_key_values", None)
    if new is not None and old is not None and new is not old:
        raise ValueError(
            f"{where} got both cache= and past_key_values= with different objects; pass the cache once "
            f"(transformers {transformers_version()} calls it {cache_kwarg()!r})."
        )
    return new if new is not None else old


# -- generate's auto-compile ----------------------------------------------------------------------------------------


def compile_config_all_devices(compile_config: Any) -> Any:
    """Let ``compile_config`` (a ``transformers.CompileConfig``) compile off CUDA too; returns it.

    transformers' generate auto-compiles only on CUDA unless the private flag ``_compile_all_devices`` is set (no
    public switch exists). ``hf-dsinfer bench`` needs it to time HF's static cache + ``torch.compile`` on a CPU.
    A release without the flag is left as is: generate then decides itself (eager on CPU).
    """
    if hasattr(compile_config, "_compile_all_devices"):
        compile_config._compile_all_devices = True
    return compile_config


def resolve_cache(cache: Any, past_key_values: Any, where: str = "forward") -> Any:
    """The cache a forward was given under either name (see :func:`pop_cache`)."""
    kwargs = {"cache": cache, "past_key_values": past_key_values}
    return pop_cache(kwargs, where)


def cache_field(output_cls: type) -> str:
    """The name of the cache field of a transformers output dataclass (``cache`` since 5.24)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(output_cls)}
    return "cache" if "cache" in names else "past_key_values"


def make_output(output_cls: type, cache: Any = None, **fields: Any) -> Any:
    """Build a transformers output dataclass with ``cache`` under the field name the installed release uses."""
    return output_cls(**fields, **{cache_field(output_cls): cache})


def output_cache(output: Any) -> Any:
    """The cache an output carries, read under the installed release's field name (no deprecation shim involved)."""
    if isinstance(output, dict) and not hasattr(output, "__dataclass_fields__"):
        return output.get("cache", output.get("past_key_values"))
    return getattr(output, cache_field(type(output)), None)


# -- config and model internals --------------------------------------------------------------------------------------


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a config selects (``config._attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


def set_config_attn_implementation(config: Any, name: str | None) -> None:
    """Select ``name`` on a config that a single module holds apart from its model's (AutoTP's per-rank copies): the
    model-level switch (``PreTrainedModel.set_attn_implementation``) does not reach it."""
    config._attn_implementation = name


def has_attn_implementation(config: Any) -> bool:
    """Whether ``config`` is a transformers config that carries an attention implementation."""
    return hasattr(config, "_attn_implementation")


def supports_attention_backend(model_cls: type) -> bool:
    """Whether a model class's attention modules call transformers' ``AttentionInterface``."""
    return bool(getattr(model_cls, "_supports_attention_backend", False))


def model_from_config(model_cls: type, config: Any, **kwargs: Any) -> Any:
    """A randomly initialized ``model_cls`` for ``config`` (``PreTrainedModel._from_config``: dtype handling and
    attention-implementation checks as ``from_pretrained`` does them)."""
    return model_cls._from_config(config, **kwargs)


def mark_initialized(param: Any) -> None:
    """Tell transformers' weight initialization to leave ``param`` alone (it holds loaded or computed values)."""
    param._is_hf_initialized = True


def pad_token_id(generation_config: Any) -> int | None:
    """The id ``generate`` pads finished rows with: ``pad_token_id``, else the first ``eos_token_id`` (what
    transformers' ``generate`` falls back to, with its own warning)."""
    pad = generation_config.pad_token_id
    if pad is not None:
        return int(pad)
    eos = generation_config.eos_token_id
    if eos is None:
        return None
    if isinstance(eos, int):
        return eos
    eos = eos.tolist() if hasattr(eos, "tolist") else list(eos)
    return int(eos[0]) if eos else None


# -- registration ----------------------------------------------------------------------------------------------------


def register_quantization_method(name: str, config_cls: type, quantizer_cls: type) -> None:
    """Map ``quant_method=name`` to ``config_cls`` / ``quantizer_cls`` through transformers' public registration
    functions. Idempotent; a re-registration with other classes (a module reloaded) replaces the stale ones."""
    # transformers.quantizers.auto, not the package: this runs from a hook while the package is still importing.
    from transformers.quantizers import auto

    config_map = auto.AUTO_QUANTIZATION_CONFIG_MAPPING
    quantizer_map = auto.AUTO_QUANTIZER_MAPPING
    if config_map.get(name) is config_cls and quantizer_map.get(name) is quantizer_cls:
        return
    # register_* refuse a name that is taken: drop our own stale entries first (never another method's).
    for mapping in (config_map, quantizer_map):
        if name in mapping and mapping[name].__module__.startswith("hf_dsinfer"):
            del mapping[name]
    if name not in config_map:
        auto.register_quantization_config(name)(config_cls)
    if name not in quantizer_map:
        auto.register_quantizer(name)(quantizer_cls)


def can_build_from_config(model_cls: type) -> bool:
    """Whether ``model_cls`` is a transformers model class :func:`model_from_config` can build."""
    return hasattr(model_cls, "_from_config")


def keep_in_fp32_modules(model: Any) -> tuple[str, ...]:
    """Module names transformers keeps in fp32 for this architecture (``_keep_in_fp32_modules``)."""
    return tuple(getattr(model, "_keep_in_fp32_modules", None) or ())


def is_expert_parallel(experts: Any) -> bool:
    """Whether transformers' own expert parallelism already split this fused experts module."""
    return bool(getattr(experts, "_is_expert_parallel", False))


def normalize_cache_kwargs(kwargs: dict[str, Any], where: str = "generate") -> dict[str, Any]:
    """``kwargs`` with a cache given under either name moved to the installed release's name (so transformers' own
    deprecation shim never fires from hf_dsinfer's calls); both names with different objects is an error."""
    if "cache" not in kwargs and "past_key_values" not in kwargs:
        return kwargs
    out = dict(kwargs)
    cache = pop_cache(out, where)
    if cache is not None:
        out[cache_kwarg()] = cache
    return out


def keys_recomputed_at_init(model: Any) -> tuple[str, ...]:
    """Regular expressions (matched with ``re.search``) of the parameter names that ``model``'s checkpoints leave out
    because its weight initialization computes them (``PreTrainedModel._keys_to_ignore_on_load_missing``: e.g.
    Marian's sinusoidal position tables). Sliced loading builds them through transformers' initialization too."""
    return tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
