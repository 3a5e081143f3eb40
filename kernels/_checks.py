"""Argument checks shared by the kernel launchers. Every error names the argument and what was expected."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | Iterable[int] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Validate one launcher argument; raise ``TypeError``/``ValueError`` naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}; move it to {device}")
    if last_dim_contiguous and t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a unit stride in its last dim (got strides {t.stride()}); call .contiguous()"
        )
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None]) -> None:
    """Check ``t.shape`` against ``expected`` (``None`` matches any size)."""
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


def check_same_dtype(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """All tensors must share one dtype."""
    first = tensors[0].dtype
    for n, t in zip(names[1:], tensors[1:]):
        if t.dtype != first:
            raise ValueError(f"{n} has dtype {t.dtype} but {names[0]} has {first}; cast them to one dtype")
