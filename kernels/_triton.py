"""``triton`` and ``triton.language``, or stand-ins where Triton cannot be installed (its wheels are Linux-only).

With the stand-ins the kernel modules still import, so ``import hf_dsinfer`` and every plain-torch path work on macOS
and Windows; ``backend.use_triton`` never picks Triton there, and launching a kernel anyway raises a clear error.
The launchers' host-side helpers (``cdiv``, ``next_power_of_2``) are provided too, since shape logic such as
``pick_num_splits`` is shared with the torch side.
"""

from __future__ import annotations

from typing import Any

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised by tests/test_no_triton.py in a subprocess
    AVAILABLE = False

    _MISSING = "triton is not installed (it ships Linux wheels only); the plain-torch kernels are used instead"

    class _Unlaunchable:
        """What ``@triton.jit`` gives without Triton: a kernel that refuses to launch."""

        def __init__(self, fn: Any):
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")
            self.__doc__ = getattr(fn, "__doc__", None)

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(f"cannot launch {self.__name__}: {_MISSING}")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"cannot call {self.__name__}: {_MISSING}")

    class _TritonStandIn:
        @staticmethod
        def jit(fn: Any = None, **kwargs: Any) -> Any:
            return _Unlaunchable(fn) if fn is not None else _Unlaunchable

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()

    class _LanguageStandIn:
        """``tl``: only read inside kernel bodies and (string) annotations, which never run without Triton."""

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"triton.language.{name}: {_MISSING}")

    triton = _TritonStandIn()
    tl = _LanguageStandIn()

__all__ = ["AVAILABLE", "tl", "triton"]
