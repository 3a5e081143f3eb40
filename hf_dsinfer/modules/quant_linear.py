"""Weight-only quantized linear layers (int8 / int4, ``kernels/quant_format.py``'s storage format).

:class:`QuantLinear` stands in for both ``nn.Linear`` inside HF's own modules (models or layers without a policy) and
:class:`~hf_dsinfer.modules.Linear` inside fused layers (packed ``qkv`` / ``gate_up``, row-parallel ``o`` / ``down``).
Its state is three buffers with fixed names, so ``state_dict`` keys say what they are:

* ``weight``: the quantized weight ``[N, K]`` int8, or ``[N, ceil(K / 2)]`` uint8 (int4, two per byte);
* ``weight_scales`` ``[N, n_groups]`` and, asymmetric only, ``weight_zeros`` ``[N, n_groups]`` (activation dtype;
  fp32 with ``spec.float_zero``).

Everything is row-wise, so packing q/k/v or gate/up is a ``torch.cat`` of the three along rows, and slicing rows
(column-parallel TP) slices them alike. The matmul goes through one function, :func:`quant_matmul`, which picks the
device kernel (``kernels/quant_gemm.py``) when it is installed and the torch reference otherwise.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator

import torch
from torch import nn

from hf_dsinfer import hf_compat
from hf_dsinfer.kernels.quant_format import QuantSpec, dequantize_weight, quant_matmul_reference, quantize_weight

Reduce = Callable[[torch.Tensor], torch.Tensor]

try:  # the device kernels (Triton on CUDA, torch's packed CPU ops on CPU); the reference where they are missing
    from hf_dsinfer.kernels.quant_cpu import pack_for_cpu, supported_kinds
    from hf_dsinfer.kernels.quant_gemm import quant_matmul as _kernel_matmul
except ImportError:  # pragma: no cover - depends on which kernels are installed
    _kernel_matmul = pack_for_cpu = supported_kinds = None

#: ``HF_DSINFER_QUANT_CPU_PACK=0`` turns the packed CPU copy off (the reference dequantizes on every call).
CPU_PACK_ENV = "HF_DSINFER_QUANT_CPU_PACK"
#: Which CPU kind packs a weight: ``auto`` (default: fbgemm's fp16-weight GEMM wherever it applies and is exact, the
#: fastest with fp32 activations: per channel always, with groups when every ``(q - z) * s`` fits fp16, as int4
#: weights quantized by hf_dsinfer do; else ``exact``), ``exact`` (``kernels/quant_cpu.default_kind``: exact for
#: every spec, dequantizing grouped weights per call) or a kind name (``fp16gemm`` rounds other scales to fp16).
CPU_KIND_ENV = "HF_DSINFER_QUANT_CPU_KIND"


def _cpu_kind(spec: QuantSpec, in_features: int) -> str | None:
    """The ``kind`` passed to ``pack_for_cpu`` (None: its own default) under :data:`CPU_KIND_ENV`."""
    choice = os.environ.get(CPU_KIND_ENV, "auto")
    if choice == "exact":
        return None
    if choice == "auto":
        return "fp16gemm" if "fp16gemm" in supported_kinds(spec, in_features) else None
    return choice


def quant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    spec: QuantSpec,
    in_features: int,
    bias: torch.Tensor | None = None,
    cpu_packed: object | None = None,
) -> torch.Tensor:
    """``x [..., K] @ dequant(weight).T (+ bias) -> [..., N]`` in ``x.dtype``: the one switch between kernels
    (``cpu_packed``: the weight packed for torch's CPU ops, see :meth:`QuantLinear.cpu_packed`)."""
    if _kernel_matmul is None:
        return quant_matmul_reference(x, weight, scales, zeros, spec, in_features, bias)
    return _kernel_matmul(x, weight, scales, zeros, spec, in_features, bias, cpu_packed=cpu_packed)


def _cpu_pack_enabled() -> bool:
    return pack_for_cpu is not None and os.environ.get(CPU_PACK_ENV, "1") != "0"


class QuantLinear(nn.Module):
    """``y = x @ dequant(weight).T + bias`` with a weight-only quantized ``weight`` (see the module docstring).

    Same call interface as :class:`~hf_dsinfer.modules.Linear`: ``reduce`` makes it row-parallel (an in-place sum
    over tensor-parallel ranks applied before the bias), and ``forward(x, defer_reduce=True)`` returns this rank's
    partial product. Also a drop-in for ``nn.Linear`` inside HF modules (``in_features``/``out_features`` attributes,
    ``forward(x)``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        spec: QuantSpec,
        weight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        reduce: Reduce | None = None,
    ):
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.spec = spec.for_features(self.in_features)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scales", scales)
        self.register_buffer("weight_zeros", zeros)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.bias = bias
        self.reduce = reduce
        self._cpu_packed = None  # CpuPackedWeight, built once (cpu_packed()) and again when the buffers change
        self._cpu_key: tuple | None = None

    # -- construction --------------------------------------------------------------------------------------------

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        spec: QuantSpec,
        bias: torch.Tensor | None = None,
        scale_dtype: torch.dtype | None = None,
        reduce: Reduce | None = None,
        hessian: torch.Tensor | None = None,
        damp: float = 0.01,
    ) -> QuantLinear:
        """Quantize a float ``weight [N, K]``: round to nearest, or GPTQ given ``hessian [K, K]`` (the inputs'
        ``X^T X / n``, with dampening ``damp``); ``scale_dtype``: default the weight's dtype."""
        n, k = weight.shape
        q, s, z = quantize_weight(weight, spec.for_features(k), scale_dtype, hessian, damp)
        return cls(k, n, spec, q, s, z, bias, reduce)

    @classmethod
    def placeholder(
        cls,
        in_features: int,
        out_features: int,
        spec: QuantSpec,
        bias: bool,
        dtype: torch.dtype,
        quantized_checkpoint: bool,
    ) -> QuantLinear:
        """A meta-device module for transformers' loader to fill.

        ``quantized_checkpoint=False``: ``weight`` is a float ``[N, K]`` placeholder that the loader's quantize op
        turns into the quantized tensors; True: the flat quantized weight a saved model stores (see
        :func:`flat_for_save`), restored to 2-d by :meth:`finalize`.
        """
        spec = spec.for_features(in_features)
        meta = torch.device("meta")
        groups = spec.n_groups(in_features)
        if quantized_checkpoint:
            wdtype = torch.int8 if spec.num_bits == 8 else torch.uint8
            weight = torch.empty(out_features * spec.packed_cols(in_features), dtype=wdtype, device=meta)
        else:
            weight = torch.empty(out_features, in_features, dtype=dtype, device=meta)
        scales = torch.empty(out_features, groups, dtype=dtype, device=meta)
        zdtype = torch.float32 if spec.float_zero else dtype  # fractional zero points are stored in fp32
        zeros = None if spec.symmetric else torch.empty(out_features, groups, dtype=zdtype, device=meta)
        b = nn.Parameter(torch.empty(out_features, dtype=dtype, device=meta), requires_grad=False) if bias else None
        return cls(in_features, out_features, spec, weight, scales, zeros, b)

    def finalize(self) -> None:
        """Check the loaded buffers (and give a flat saved weight its 2-d shape); errors say what does not match."""
        n, k, spec = self.out_features, self.in_features, self.spec
        want = (n, spec.packed_cols(k))
        wdtype = torch.int8 if spec.num_bits == 8 else torch.uint8
        if self.weight.ndim == 1 and self.weight.numel() == want[0] * want[1]:
            self.weight = self.weight.view(want)
        problems = []
        if tuple(self.weight.shape) != want or self.weight.dtype != wdtype:
            problems.append(f"weight {self.weight.dtype} {tuple(self.weight.shape)} (expected {wdtype} {want})")
        g = spec.n_groups(k)
        if tuple(self.weight_scales.shape) != (n, g):
            problems.append(f"weight_scales {tuple(self.weight_scales.shape)} (expected {(n, g)})")
        if (self.weight_zeros is None) != spec.symmetric:
            problems.append("weight_zeros " + ("missing (asymmetric)" if self.weight_zeros is None else "unexpected"))
        if problems:
            raise ValueError(
                f"quantized weights do not match int{spec.num_bits} {'symmetric' if spec.symmetric else 'asymmetric'} "
                f"groups of {spec.group_size}: {'; '.join(problems)}. Load the checkpoint with the quant settings it "
                "was saved with (they are in its config.json)."
            )

    # -- compute ---------------------------------------------------------------------------------------------------

    def _buffer_key(self) -> tuple:
        ts = [t for t in (self.weight, self.weight_scales, self.weight_zeros) if t is not None]
        return tuple((t.data_ptr(), t._version, t.device) for t in ts)

    def cpu_packed(self) -> object | None:
        """The weight packed for torch's CPU ops (``kernels/quant_cpu.py``), built on first use and again whenever
        the buffers change (replaced, moved or written in place); None off CPU or when packing is off.

        Decoding reads it instead of dequantizing the stored buffers on every call. Built before a step is compiled
        (:func:`prepack_cpu`): inside ``torch.compile`` the existing pack is used as is.
        """
        if self.weight.device.type != "cpu" or self.weight.is_meta or not _cpu_pack_enabled():
            return None
        if torch.compiler.is_compiling():
            return self._cpu_packed
        key = self._buffer_key()
        if self._cpu_packed is None or key != self._cpu_key:
            kind = _cpu_kind(self.spec, self.in_features)
            args = (self.weight, self.weight_scales, self.weight_zeros, self.spec, self.in_features)
            self._cpu_packed = pack_for_cpu(*args, kind=kind)
            if not self._cpu_packed.exact and os.environ.get(CPU_KIND_ENV, "auto") == "auto":
                self._cpu_packed = pack_for_cpu(*args)  # scales from elsewhere: the exact default kind
            self._cpu_key = key
        return self._cpu_packed

    def forward(self, x: torch.Tensor, defer_reduce: bool = False) -> torch.Tensor:
        """``x [..., in] -> [..., out]`` (``defer_reduce``: see :meth:`hf_dsinfer.modules.Linear.forward`)."""
        packed = self.cpu_packed() if x.device.type == "cpu" else None
        if self.reduce is None:
            return quant_matmul(x, self.weight, self.weight_scales, self.weight_zeros, self.spec, self.in_features,
                                self.bias, packed)  # fmt: skip
        y = quant_matmul(x, self.weight, self.weight_scales, self.weight_zeros, self.spec, self.in_features,
                         cpu_packed=packed)  # fmt: skip
        if defer_reduce:
            return y
        y = self.reduce(y)
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight ``[N, K]`` these buffers stand for (default dtype: the scales')."""
        return dequantize_weight(self.weight, self.weight_scales, self.weight_zeros, self.spec, self.in_features, dtype)

    def cpu_pack_nbytes(self) -> int:
        """Bytes held by the CPU pack (0: none); fbgemm's opaque fp16 matrix counts as 2 bytes per weight."""
        p = self._cpu_packed
        if p is None:
            return 0
        held = sum(t.numel() * t.element_size() for t in p.buffers().values())
        return held + (2 * self.in_features * self.out_features if p.kind == "fp16gemm" else 0)

    def decode_nbytes(self) -> int:
        """Bytes a compiled CPU decode step reads for this weight: the stored integers and fp32 scales (and zeros)
        where the pack reduces over them directly (``CpuPackedWeight.fused``), else the pack, else the buffers."""
        fused = getattr(self._cpu_packed, "fused", ())
        if fused:
            return sum(t.numel() * t.element_size() for t in fused if t is not None)
        return self.cpu_pack_nbytes() or self.quantized_nbytes()

    def quantized_nbytes(self) -> int:
        """Bytes held by the quantized weight, its scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scales, self.weight_zeros)
                   if t is not None)  # fmt: skip

    def extra_repr(self) -> str:
        s = self.spec
        kind = "sym" if s.symmetric else ("asym float-zero" if s.float_zero else "asym")
        tp = ", row_parallel=True" if self.reduce is not None else ""
        return (f"in={self.in_features}, out={self.out_features}, int{s.num_bits} {kind} group={s.group_size}, "
                f"bias={self.bias is not None}{tp}")  # fmt: skip


class QuantEmbedding(nn.Module):
    """An input embedding whose table is the quantized weight of the LM head it is tied to (one table, as in
    llama.cpp's GGUFs): ``forward(ids)`` gathers the rows' integers and dequantizes only those rows.

    It holds no tensor of its own: it reads ``head.weight`` / ``weight_scales`` / ``weight_zeros`` at every call, so
    moving or copying the model keeps one table (the head is referenced, not registered: ``state_dict`` lists the
    table once, under the head's names). ``weight`` is the head's integer weight (for ``.device``); the float dtype
    the rows come out in is :attr:`dtype`.
    """

    def __init__(self, head: QuantLinear, dtype: torch.dtype, padding_idx: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype, self.padding_idx = dtype, padding_idx
        self._head = (head,)  # a tuple: not a registered submodule (the head is the model's own)

    @property
    def head(self) -> QuantLinear:
        return self._head[0]

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [...]`` -> ``[..., embedding_dim]`` in :attr:`dtype`: the rows of the dequantized table."""
        head, flat = self.head, input_ids.reshape(-1)  # [T]
        zeros = head.weight_zeros.index_select(0, flat) if head.weight_zeros is not None else None
        rows = dequantize_weight(head.weight.index_select(0, flat), head.weight_scales.index_select(0, flat), zeros,
                                 head.spec, self.embedding_dim, self.dtype)  # [T, H]  # fmt: skip
        return rows.view(*input_ids.shape, self.embedding_dim)

    def dequantized_weight(self) -> torch.Tensor:
        """The whole float table ``[V, H]`` in :attr:`dtype` (what ``save_pretrained`` writes for it)."""
        return self.head.dequantized_weight(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tied to the quantized LM head"


def activation_dtype(module: nn.Module) -> torch.dtype:
    """The float dtype an embedding or LM head computes in, quantized or not (``weight.dtype`` of a float module;
    a quantized one stores integers)."""
    if isinstance(module, QuantEmbedding):
        return module.dtype
    if isinstance(module, QuantLinear):
        return module.weight_scales.dtype
    return module.weight.dtype


# ---------------------------------------------------------------------------------------------------------------------
# Which linears of an HF model are quantized, and swapping them
# ---------------------------------------------------------------------------------------------------------------------

# MoE routers and everything inside experts stay in the activation dtype: routing is sensitive to small errors, and
# fused expert tensors are not nn.Linear modules.
_SKIP_LEAF = re.compile(r"(^|\.)(gate|router|shared_expert_gate)$")


def quantizable_linears(model: nn.Module, lm_head: bool = False) -> Iterator[tuple[str, nn.Linear]]:
    """``(name, module)`` of every ``nn.Linear`` to quantize: all of them except the LM head (unless ``lm_head``),
    MoE routers and experts, and modules transformers keeps in fp32 (``_keep_in_fp32_modules``)."""
    head = None
    get_head = getattr(model, "get_output_embeddings", None)
    if get_head is not None:
        try:
            head = get_head()
        except (AttributeError, NotImplementedError):
            head = None
    keep_fp32 = set(hf_compat.keep_in_fp32_modules(model))
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if module is head and not lm_head:
            continue
        if _SKIP_LEAF.search(name) or "expert" in name or any(k in name.split(".") for k in keep_fp32):
            continue
        yield name, module


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted path ``name``."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def tied_table_for_save(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with a quantized tied head (:class:`QuantEmbedding`) saved as HF saves a tied model: the input
    embedding's float table (the dequantized integers: the values the model computes with) under its own name and no
    head keys, so the checkpoint reads as a plain tied model; a reload with ``lm_head=True`` quantizes that table
    again and gets the same integers (a grid point rounds to itself)."""
    embs = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantEmbedding)]
    if not embs:
        return state_dict
    names = {id(m): n for n, m in model.named_modules()}
    out = dict(state_dict)
    for name, emb in embs:
        head = names.get(id(emb.head))
        for key in (f"{head}.weight", f"{head}.weight_scales", f"{head}.weight_zeros"):
            out.pop(key, None)
        out[f"{name}.weight"] = emb.dequantized_weight()  # [V, H] in the embedding's float dtype
    return out


def flat_for_save(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with every quantized weight (a ``*.weight`` next to a ``*.weight_scales``) flattened to 1-d.

    Saved under HF's own names but not in HF's ``[out, in]`` shape, so transformers without hf_dsinfer refuses the
    checkpoint (a size mismatch) instead of reading quantized integers as float weights.
    """
    out = dict(state_dict)
    for key in state_dict:
        if key.endswith(".weight_scales"):
            wkey = key[: -len("_scales")]
            if wkey in out:
                out[wkey] = out[wkey].reshape(-1)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Packing quantized HF linears into fused ones (kernel injection)
# ---------------------------------------------------------------------------------------------------------------------

#: State-dict suffixes of a quantized weight's companions (``<name>.weight`` + suffix).
QUANT_SUFFIXES = ("_scales", "_zeros")


def _owner(layer: nn.Module, name: str) -> tuple[nn.Module | None, str]:
    owner_name, _, attr = name.rpartition(".")
    try:
        return (layer.get_submodule(owner_name) if owner_name else layer), attr
    except AttributeError:
        return None, attr


def is_quantized_weight(layer: nn.Module, name: str) -> bool:
    """True when ``name`` (relative to ``layer``) is the ``weight`` of a :class:`QuantLinear`."""
    owner, attr = _owner(layer, name)
    return isinstance(owner, QuantLinear) and attr == "weight"


def _row_wise(source: object) -> bool:
    """Whether a policy source only moves whole rows (``Source.moves_rows_only``: sharing, row concatenation, row
    regrouping), the operations that commute with row-wise quantization."""
    return bool(getattr(source, "moves_rows_only", False))


def pack_quantized(source: object, layer: nn.Module) -> QuantLinear | None:
    """The fused :class:`QuantLinear` a policy ``source`` (``Param`` or ``Cat``) builds from quantized HF linears in
    ``layer``: ``weight``, ``weight_scales`` and ``weight_zeros`` each packed by the same source (row-wise format).

    None when the source reads float weights. Raises when it mixes quantized and float parts, quantization settings
    or row lengths, or transforms the weight in a way row-wise quantization does not survive (GPT-2's ``Conv1D``).
    """
    names = source.names()
    owners = [_owner(layer, n) for n in names]
    quant = [isinstance(o, QuantLinear) and a == "weight" for o, a in owners]
    if not any(quant):
        return None
    parts = [o for o, _ in owners]
    if not all(quant) or not _row_wise(source):
        raise ValueError(
            f"cannot pack {names} into one fused quantized linear: some are quantized and some are not, or the policy "
            "transforms them beyond moving whole rows (e.g. transposes). Load without `quant`."
        )
    first = parts[0]
    if any(p.spec != first.spec or p.in_features != first.in_features for p in parts):
        raise ValueError(f"{names} are quantized with different settings or row lengths; they cannot be packed.")

    def get(suffix: str):
        return lambda n: layer.get_buffer(n + suffix)

    weight = source.pack(get(""))  # [N, packed_cols]
    scales = source.pack(get("_scales"))  # [N, n_groups]
    zeros = source.pack(get("_zeros")) if first.weight_zeros is not None else None
    return QuantLinear(first.in_features, weight.shape[0], first.spec, weight, scales, zeros)


def release_quantized(modules: list[nn.Module]) -> None:
    """Empty the buffers of HF quantized linears whose contents were copied into packed fused ones."""
    for m in modules:
        if isinstance(m, QuantLinear):
            for name in ("weight", "weight_scales", "weight_zeros"):
                t = getattr(m, name)
                if t is not None:
                    setattr(m, name, torch.empty(0, dtype=t.dtype, device=t.device))


def prepack_cpu(model: nn.Module) -> int:
    """Build the CPU pack of every :class:`QuantLinear` of ``model`` now (before a step is compiled); returns how
    many were packed."""
    return sum(m.cpu_packed() is not None for m in model.modules() if isinstance(m, QuantLinear))
