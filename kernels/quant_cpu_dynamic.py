"""Activation-quantized int8 decode GEMV on CPU: fbgemm's dynamic quantized linear over the stored int8 weights.

A compiled decode step of a per-channel symmetric int8 weight reduces ``x * q`` in fp32 (:mod:`.quant_cpu_fused`):
per 16 weights a widen, a convert, a multiply and an add on one accumulator chain, so the loop is bound by
instructions, not by the bytes it reads. llama.cpp's Q8_0 instead quantizes the activations to 8 bits and multiplies
integers (32 products per instruction). fbgemm's ``quantized::linear_dynamic`` does the same with the same int8 weight
integers: it quantizes ``x`` to uint8 with one scale and zero point per call (min/max of the tensor, so per token at
one row), multiplies u8 x s8 with int32 accumulation and scales back to fp32. On SmolLM2's decode shapes (30 layers x 4
matmuls, one row, one thread, loaded machine) it took about half the fused loop's time (docs/quantization.md).

It is not the reference's exact values: the activations are rounded to 256 levels per row (llama.cpp rounds per
block of 32), ~1e-2 relative on the outputs; the perplexity cost is measured in docs/quantization.md. Hence it is
used only for one-row matmuls inside a compiled decode step, and can be turned off with
``HF_DSINFER_QUANT_INT8_ACTIVATIONS=0`` (the exact fused loop then runs).

On CPUs whose fbgemm kernel sums pairs of u8 x s8 products into int16 with saturation (AVX2 / AVX-512 without VNNI),
full-range activations could overflow; :func:`reduce_range_needed` probes that once with the worst case and, if it
saturates, activations are quantized to 7 bits (``reduce_range=True``, as torch's own dynamic quantization does).

The packed weight is an opaque fbgemm object (a TorchScript class): like the fp16 pack of :mod:`.quant_cpu` it is kept
in a table under an int slot that the graph's op receives.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import warnings

import torch

__all__ = ["ACTIVATIONS_ENV", "Int8DynamicPack", "enabled", "int8_dynamic_linear", "reduce_range_needed"]

#: ``HF_DSINFER_QUANT_INT8_ACTIVATIONS=0``: one-row int8 decode matmuls keep fp32 activations (exact fused loop).
ACTIVATIONS_ENV = "HF_DSINFER_QUANT_INT8_ACTIVATIONS"

_PACKS: dict[int, torch.ScriptObject] = {}


@contextlib.contextmanager
def _fbgemm_engine():
    """fbgemm as the quantized engine while packing (the packed object keeps its backend), the caller's put back."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def _per_channel_qint8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` int8 as the per-channel qint8 tensor fbgemm's prepack takes (zero points 0). torch 2.13 warns that
    quantized tensor creation is deprecated; fbgemm's prepack has no other input, so that warning is silenced here."""
    n = q.shape[0]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        return torch._make_per_channel_quantized_tensor(q.contiguous(), scales.reshape(n).double(),
                                                        torch.zeros(n, dtype=torch.long), 0)  # fmt: skip
_SLOTS = itertools.count()


def enabled() -> bool:
    """Whether int8 weights may get the activation-quantized decode pack: not turned off, and fbgemm's ops present and
    working here (:func:`_probe`)."""
    return os.environ.get(ACTIVATIONS_ENV, "1") != "0" and _probe() is not None


def reduce_range_needed() -> bool:
    """True when fbgemm's u8 x s8 kernel saturates on full-range activations here (then 7-bit activations are used).
    Only meaningful when :func:`enabled`."""
    return bool(_probe())


@functools.cache
def _probe() -> bool | None:
    """None when fbgemm's dynamic linear is missing or fails here (torch deprecates quantized tensors: a release
    without them turns this path off, not the model), else whether it saturates (:func:`reduce_range_needed`).

    The worst case: every activation at the top of the uint8 range against weights of 127, where a pair of products
    (2 * 255 * 127) exceeds int16; an exact int32 kernel (VNNI) returns the float product, a saturating one less."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    try:
        k = 64
        q = torch.full((16, k), 127, dtype=torch.int8)  # [N, K]
        w = _per_channel_qint8(q, torch.ones(16))  # scale 1 per row
        x = torch.full((1, k), 255.0)  # one scale of 1.0, zero point 0: every activation quantizes to 255
        x[0, 0] = 0.0
        with _fbgemm_engine():
            packed = torch.ops.quantized.linear_prepack(w, None)
        got = torch.ops.quantized.linear_dynamic(x, packed, False)  # [1, 16]
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return not torch.allclose(got, x @ q.float().t(), rtol=1e-3)


class Int8DynamicPack:
    """fbgemm's prepacked per-channel int8 weight and its slot in the op's table."""

    __slots__ = ("slot", "reduce_range", "__weakref__")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        """Pack ``q [N, K]`` int8 with fp32 row scales ``scales [N]`` (symmetric: zero points 0). The integers are
        used as they are: ``q * s`` is the reference's weight."""
        w = _per_channel_qint8(q, scales)
        self.reduce_range = reduce_range_needed()
        self.slot = next(_SLOTS)
        with _fbgemm_engine():
            _PACKS[self.slot] = torch.ops.quantized.linear_prepack(w, None)

    def __del__(self, _packs: dict = _PACKS) -> None:  # the table bound now: module globals are gone at exit
        _packs.pop(self.slot, None)


_LIB = torch.library.Library("hf_dsinfer", "FRAGMENT")
try:
    _LIB.define("int8_dynamic_linear(Tensor x, int slot, int out_features, bool reduce_range) -> Tensor")
except RuntimeError:  # pragma: no cover - defined already (the module imported twice under two names)
    pass
else:
    _LIB.impl("int8_dynamic_linear", lambda x, slot, out_features, reduce_range: torch.ops.quantized.linear_dynamic(
        x, _PACKS[slot], reduce_range), "CPU")  # fmt: skip
    torch.library.register_fake("hf_dsinfer::int8_dynamic_linear", lambda x, slot, out_features, reduce_range:
                                x.new_empty(x.shape[0], out_features), lib=_LIB)  # fmt: skip


def int8_dynamic_linear(x: torch.Tensor, pack: Int8DynamicPack, out_features: int) -> torch.Tensor:
    """``x [M, K]`` fp32 times the packed weight with ``x`` quantized to uint8 (one scale for the call) ->
    ``[M, out_features]`` fp32. Under ``torch.compile`` one opaque op (the graph's inputs stay tensors and ints)."""
    x = x.to(torch.float32).contiguous()
    if torch.compiler.is_compiling():
        return torch.ops.hf_dsinfer.int8_dynamic_linear(x, pack.slot, out_features, pack.reduce_range)
    return torch.ops.quantized.linear_dynamic(x, _PACKS[pack.slot], pack.reduce_range)
