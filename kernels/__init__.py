"""Triton kernels with plain-torch references, installed as ``hf_dsinfer.kernels``. Imports only torch and triton.

See docs/kernels.md for the contract every kernel follows.
"""

from .backend import describe, get_backend, interpreter_enabled, triton_available, use_triton

__all__ = ["describe", "get_backend", "interpreter_enabled", "triton_available", "use_triton"]
