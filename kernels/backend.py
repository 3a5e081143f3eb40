"""Backend switch for every kernel: ``HF_DSINFER_BACKEND`` = ``auto`` | ``triton`` | ``torch``.

``auto`` (the default) runs the Triton kernels on CUDA tensors and the plain-torch references elsewhere.
``triton`` forces the Triton kernels everywhere; on CPU this needs ``TRITON_INTERPRET=1`` (Triton's interpreter),
which is how CI proves whole models through the kernels without a GPU. ``torch`` forces the references.
The variable is read on every call, so tests can flip it with ``monkeypatch.setenv``.
"""

from __future__ import annotations

import functools
import os

import torch

from ._triton import AVAILABLE

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "HF_DSINFER_BACKEND"


def triton_available() -> bool:
    """True when ``import triton`` works (Linux wheels only; see ``_triton.py`` for the stand-in elsewhere)."""
    return AVAILABLE


def interpreter_enabled() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def get_backend() -> str:
    """The requested backend, validated."""
    return _parse_backend(os.environ.get(ENV_VAR, "auto"))


@functools.lru_cache(maxsize=16)
def _parse_backend(raw: str) -> str:
    # Cached by the raw string: every kernel call asks, and the variable may still change between calls.
    value = raw.strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r} is not a backend; use one of {', '.join(BACKENDS)}.")
    return value


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a kernel called on ``tensor`` should take its Triton path.

    Raises a clear error when ``triton`` is forced but cannot run on the tensor's device.
    """
    backend = get_backend()
    if backend == "torch":
        return False
    if backend == "auto":
        return tensor.is_cuda and triton_available()
    if not triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton but triton is not installed; install triton or set {ENV_VAR}=auto.")
    if not tensor.is_cuda and not interpreter_enabled():
        raise RuntimeError(
            f"{ENV_VAR}=triton on a {tensor.device.type} tensor needs Triton's interpreter: set TRITON_INTERPRET=1 "
            f"before importing hf_dsinfer, or use {ENV_VAR}=auto."
        )
    return True


def describe() -> dict:
    """A short report for ``hf-dsinfer info``: which path the kernels take here."""
    cuda = torch.cuda.is_available()
    backend = get_backend()
    if backend == "torch":
        path = "torch"
    elif backend == "triton":
        path = "triton" if (cuda or interpreter_enabled()) else "unavailable (set TRITON_INTERPRET=1 on CPU)"
    else:
        path = "triton" if (cuda and triton_available()) else "torch"
    return {
        "backend": backend,
        "triton_installed": triton_available(),
        "interpreter": interpreter_enabled(),
        "kernel_path": path,
    }
