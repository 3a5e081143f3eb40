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
