"""The policy API: how one family of HF models maps onto hf_dsinfer's fused layers, and the policy registry.

A policy answers, for each HF decoder layer, two questions (see docs/policies.md):

* :meth:`Policy.layer_spec` - what the layer computes (heads, scale, rotary, window, softcap, norm kind and eps,
  activation, residual style), as a :class:`~hf_dsinfer.modules.LayerSpec`;
* :meth:`Policy.weight_map` - where each fused parameter comes from in the HF layer, as :class:`Source` objects
  (:class:`Param` shares an HF tensor, :class:`Cat` packs several along rows, :class:`Transposed` flips a Conv1D).

Sources are invertible, so the same map re-packs weights at injection and writes plain HF tensors back at save.
Everything else (the top-level forward, the cache, the rotary table) has generic defaults a policy may override.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..modules import LayerSpec, NormSpec, RotaryTable

if TYPE_CHECKING:
    from .runtime import Runtime

GetParam = Callable[[str], torch.Tensor]


# ---------------------------------------------------------------------------------------------------------------------
# Sources: where a fused tensor comes from
# ---------------------------------------------------------------------------------------------------------------------


class Source(ABC):
    """Where one fused tensor comes from in an HF layer (names are relative to the layer), and the way back."""

    #: True when :meth:`pack` / :meth:`unpack` only select, reorder or concatenate whole rows (dim 0): they then apply
    #: as they are to row-wise quantized tensors (integer weights, scales, zeros; ``modules/quant_linear.py``).
    moves_rows_only: ClassVar[bool] = False

    @abstractmethod
    def names(self) -> tuple[str, ...]:
        """The HF parameter names this source reads."""

    @abstractmethod
    def pack(self, get: GetParam) -> torch.Tensor:
        """Build the fused tensor; ``get(name)`` returns the HF parameter (return that parameter itself to share it)."""

    @abstractmethod
    def unpack(self, fused: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split the fused tensor back into HF-named tensors (used by ``save_pretrained``)."""

    def shares(self) -> bool:
        """True when :meth:`pack` returns the HF parameter itself (nothing to free after packing)."""
        return False

    def pack_into(self, get: GetParam, out: torch.Tensor) -> None:
        """Write the fused tensor into the existing ``out`` in place (the Hybrid Engine's weight refresh).

        ``out`` keeps its storage, so anything that captured its address (a CUDA graph) stays valid; values are
        cast to ``out``'s dtype. The default packs a temporary and copies it; the built-in sources write straight
        into ``out`` (or its row slices). ``get`` may return new tensors (e.g. LoRA-fused weights), never written.
        """
        _copy_checked(self, self.pack(get), out)


class Param(Source):
    """One HF parameter used as is: the fused layer adopts the very same ``nn.Parameter`` (no copy)."""

    moves_rows_only = True

    def __init__(self, name: str):
        self.name = name

    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def pack(self, get: GetParam) -> torch.Tensor:
        return get(self.name)

    def unpack(self, fused: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.name: fused}

    def shares(self) -> bool:
        return True

    def pack_into(self, get: GetParam, out: torch.Tensor) -> None:
        _copy_checked(self, get(self.name), out)

    def __repr__(self) -> str:
        return f"Param({self.name!r})"


class Transposed(Source):
    """A ``[in, out]`` weight (GPT-2's ``Conv1D``) stored transposed as ``[out, in]`` (a copy)."""

    def __init__(self, name: str):
        self.name = name

    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def pack(self, get: GetParam) -> torch.Tensor:
        return get(self.name).detach().t().contiguous()

    def unpack(self, fused: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.name: fused.t().contiguous()}

    def pack_into(self, get: GetParam, out: torch.Tensor) -> None:
        _copy_checked(self, get(self.name).detach().t(), out)

    def __repr__(self) -> str:
        return f"Transposed({self.name!r})"


class Cat(Source):
    """Several parts concatenated along dim 0 (rows): ``Cat("q_proj.weight", "k_proj.weight", "v_proj.weight")``.

    Parts are names or other sources (``Cat(Transposed("a"), "b")``). The row count of each part is recorded at
    pack time so :meth:`unpack` can split the fused tensor again.
    """

    def __init__(self, *parts: str | Source):
        if len(parts) < 2:
            raise ValueError("Cat needs at least two parts; use Param for a single tensor")
        self.parts = [Param(p) if isinstance(p, str) else p for p in parts]
        self.rows: list[int] | None = None

    def names(self) -> tuple[str, ...]:
        return tuple(n for p in self.parts for n in p.names())

    @property
    def moves_rows_only(self) -> bool:  # type: ignore[override]
        return all(p.moves_rows_only for p in self.parts)

    def pack(self, get: GetParam) -> torch.Tensor:
        tensors = [p.pack(get).detach() for p in self.parts]
        self.rows = [t.shape[0] for t in tensors]
        return torch.cat(tensors, dim=0)

    def unpack(self, fused: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.rows is None:
            raise RuntimeError("Cat.unpack before pack: the row split is unknown")
        out: dict[str, torch.Tensor] = {}
        for part, chunk in zip(self.parts, torch.split(fused, self.rows, dim=0)):
            out.update(part.unpack(chunk.contiguous()))
        return out

    def pack_into(self, get: GetParam, out: torch.Tensor) -> None:
        # Each part writes into its own row slice of ``out``: no temporary of the whole packed tensor.
        rows = self.rows if self.rows is not None else [p.pack(get).shape[0] for p in self.parts]
        if sum(rows) != out.shape[0]:
            raise ValueError(f"{self!r}: parts have {sum(rows)} rows but the fused tensor has {out.shape[0]}")
        offset = 0
        for part, n in zip(self.parts, rows):
            part.pack_into(get, out.narrow(0, offset, n))
            offset += n

    def __repr__(self) -> str:
        return f"Cat({', '.join(map(repr, self.parts))})"


def _copy_checked(source: Source, value: torch.Tensor, out: torch.Tensor) -> None:
    """``out.copy_(value)`` after checking shapes: ``copy_`` would silently broadcast a wrong-shaped value."""
    if tuple(value.shape) != tuple(out.shape):
        raise ValueError(
            f"{source!r} gives shape {tuple(value.shape)} but the existing fused tensor has {tuple(out.shape)}: the "
            "source model does not match the architecture the fused layers were built for."
        )
    with torch.no_grad():
        out.copy_(value.detach())


def as_source(value: str | Source) -> Source:
    """A name means :class:`Param` (shared)."""
    return Param(value) if isinstance(value, str) else value


# ---------------------------------------------------------------------------------------------------------------------
# Small readers shared by policies
# ---------------------------------------------------------------------------------------------------------------------

# HF activation names (ACT2FN keys) -> kernel activation names. Only exact equivalents are listed.
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_new",
    "relu": "relu",
}


def activation_name(hf_name: str) -> str | None:
    """Kernel name of an HF activation, or None when hf_dsinfer has no exact equivalent."""
    return HF_ACTIVATIONS.get(hf_name)


def get_submodule_or_none(root: nn.Module, path: str | None) -> nn.Module | None:
    """``root.get_submodule(path)``, or None when ``path`` is None or absent."""
    if path is None:
        return None
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


# ---------------------------------------------------------------------------------------------------------------------
# The policy base class
# ---------------------------------------------------------------------------------------------------------------------


class Policy:
    """Base class of kernel-injection policies. Subclass it, fill in the class attributes and the two abstract
    methods, and decorate the class with :func:`register`.

    Paths are attribute names inside the model's base model (``model.base_model``, e.g. ``LlamaModel``), so one
    policy serves both the bare model and its ``*ForCausalLM``; dotted paths (``"decoder.layers"``) reach deeper.
    """

    #: ``config.model_type`` values this policy serves.
    model_types: ClassVar[tuple[str, ...]] = ()
    #: Top-level HF class names served (registered too); empty: any ``*ForCausalLM`` or bare base model.
    hf_classes: ClassVar[tuple[str, ...]] = ()
    #: The decoder-layer ``nn.ModuleList``, the token embedding, the final norm (None: none) and the rotary module.
    layers_attr: ClassVar[str] = "layers"
    embed_attr: ClassVar[str] = "embed_tokens"
    final_norm_attr: ClassVar[str | None] = "norm"
    rotary_attr: ClassVar[str | None] = "rotary_emb"
    #: Gemma-style ``(1 + w)`` norm weights: 1.0.
    norm_weight_offset: ClassVar[float] = 0.0
    #: Rotary pairing: False = rotate-half (llama, neox), True = interleaved pairs (gptj).
    rotary_interleaved: ClassVar[bool] = False

    # -- what every policy must say ------------------------------------------------------------------------------

    def layer_spec(self, model: nn.Module, idx: int, layer: nn.Module) -> LayerSpec:
        """What HF decoder layer ``idx`` computes, apart from its weights."""
        raise NotImplementedError(f"{type(self).__name__} must implement layer_spec")

    def weight_map(self, model: nn.Module, idx: int, layer: nn.Module) -> dict[str, Source | str | None]:
        """Fused parameter name (``hf_dsinfer.modules.PARAM_NAMES``) -> its :class:`Source` in ``layer``.

        A plain string is :class:`Param`; a ``None`` value means "absent" (e.g. a bias the checkpoint lacks).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement weight_map")

    # -- defaults a policy may override ---------------------------------------------------------------------------

    def serves(self, model: nn.Module) -> bool:
        """Whether the fused forward can stand in for ``model``'s (a causal LM or the bare base model)."""
        name = type(model).__name__
        if self.hf_classes:
            return name in self.hf_classes
        return name.endswith("ForCausalLM") or model is getattr(model, "base_model", None)

    def unsupported(self, model: nn.Module, max_out_tokens: int) -> str | None:
        """A reason the fused path cannot serve this model exactly (it then keeps HF's modules), or None."""
        rotary = get_submodule_or_none(model.base_model, self.rotary_attr)
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            # These switch frequencies once the sequence passes the original length; below it one table is exact.
            params = getattr(model.config, "rope_parameters", None) or {}
            limit = params.get("original_max_position_embeddings") or getattr(rotary, "original_max_seq_len", None)
            if limit is None or max_out_tokens > limit:
                return (
                    f"rope_type={rope_type!r} changes its frequencies past {limit} positions but max_out_tokens="
                    f"{max_out_tokens}; lower max_out_tokens to at most {limit} to use fused layers"
                )
        return None

    def norm_spec(self, module: nn.Module) -> NormSpec:
        """The :class:`NormSpec` of an HF norm module (LayerNorm or an RMSNorm with ``variance_epsilon``/``eps``)."""
        if isinstance(module, nn.LayerNorm):
            return NormSpec("layer", float(module.eps))
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None:
            raise ValueError(f"cannot read eps from {type(module).__name__}; override Policy.norm_spec")
        return NormSpec("rms", float(eps), self.norm_weight_offset)

    def rotary_table(self, model: nn.Module, max_positions: int, dtype: torch.dtype) -> RotaryTable | None:
        """cos/sin table from the HF rotary module's own frequencies and ``attention_scaling`` (None: no rotary)."""
        rotary = get_submodule_or_none(model.base_model, self.rotary_attr)
        if rotary is None:
            return None
        # original_inv_freq: the pristine frequencies (dynamic variants overwrite inv_freq during HF forwards).
        inv_freq = getattr(rotary, "original_inv_freq", None)
        if inv_freq is None:
            inv_freq = rotary.inv_freq
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        return RotaryTable.from_inv_freq(
            inv_freq, max_positions, scaling, round_to=dtype, interleaved=self.rotary_interleaved
        )

    def embed(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[B, T, C]`` (learned-position models add theirs here, from ``position_ids [B, T]``)."""
        return model.base_model.get_submodule(self.embed_attr)(input_ids)

    def embed_inputs(self, model: nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The first hidden state ``[B, T, C]`` when the caller passes ``inputs_embeds`` instead of ids: used as is by
        default; models that add learned positions (or project embeddings) to them in HF do the same here."""
        return inputs_embeds

    def finalize_hidden(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Last touch on the hidden states after the final norm, before the LM head (opt's ``project_out``)."""
        return hidden

    def default_position_ids(
        self, attention_mask: torch.Tensor | None, past: int, batch: int, width: int, device: torch.device
    ) -> torch.Tensor:
        """Positions ``[B, T]`` when the caller gives none: HF's decoder default, ``past + arange(T)``."""
        return (torch.arange(width, device=device) + past)[None].expand(batch, width)

    def finalize_logits(self, model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        """Last touch on the logits (gemma2's soft-capping)."""
        return logits

    def tp_plan(self, model: nn.Module, spec: LayerSpec) -> dict[str, Any]:
        """How the fused layer splits over tensor-parallel ranks (declared here, consumed by the TP work).

        ``column``: split along output rows; ``row``: split along input columns, all-reduce after (their biases are
        added once, after the reduce); ``qkv``: the packed rows are ``[q | k | v]`` and each rank takes whole KV-head
        groups (its kv heads and the ``num_heads // num_kv_heads`` q heads of each); kv heads fewer than ranks are
        replicated. ``gate_up``: ``[gate | up]`` rows, each half split alike. Names are fused parameter names.
        """
        a = spec.attention  # spec: layer 0's (the plan is per model; layers share their shapes)
        plan: dict[str, Any] = {
            "column": ["attn.qkv.weight", "attn.qkv.bias", "mlp.up.weight", "mlp.up.bias"],
            "row": ["attn.o.weight", "mlp.down.weight"],
            "row_bias": ["attn.o.bias", "mlp.down.bias"],
            "replicated": ["*_norm.weight", "*_norm.bias", "attn.q_norm.weight", "attn.k_norm.weight"],
            "qkv": {
                "param": "attn.qkv",
                "sections": ("q", "k", "v"),
                "sizes": (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim),
                "shard_by": "kv_head_group",
                "num_heads": a.num_heads,
                "num_kv_heads": a.num_kv_heads,
                "head_dim": a.head_dim,
            },
            "embedding": "vocab",
            "lm_head": "column_gather",
        }
        if spec.mlp.gated:
            plan["gate_up"] = {"param": "mlp.up", "sections": ("gate", "up")}
        return plan

    def install_forward(self, model: nn.Module, runtime: Runtime) -> None:
        """Replace the model's forward (instance-level) with the fused one. Encoders override this."""
        from .runtime import install_causal_lm_forward

        install_causal_lm_forward(model, runtime)

    def pack_into(
        self,
        model: nn.Module,
        idx: int,
        fused_layer: nn.Module,
        get: GetParam,
        weight_map: dict[str, Source | str | None],
    ) -> None:
        """Re-pack HF weights of decoder layer ``idx`` into the *existing* parameters of ``fused_layer``, in place.

        Used by the Hybrid Engine to refresh an injected inference copy from training weights without moving its
        buffers (CUDA graphs keep valid addresses). ``get(name)`` returns the HF tensor for a name relative to the
        layer (it may be computed, e.g. LoRA-fused; it is only read); ``weight_map`` is the map recorded at injection
        (``get_injection(model).weight_maps[idx]``). The default covers every :class:`Source`, custom ones included
        (through :meth:`Source.pack_into`); override only when re-packing needs more than the weight map.
        """
        for fused_name, src in weight_map.items():
            if src is not None:
                as_source(src).pack_into(get, fused_layer.get_parameter(fused_name).data)


# ---------------------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------------------

#: model_type -> policy (read by ``hf-dsinfer info``).
POLICIES: dict[str, Policy] = {}
#: HF class name -> policy.
POLICIES_BY_CLASS: dict[str, Policy] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: register one instance of ``cls`` under its model types and HF class names."""
    policy = cls()
    for key, table in [(t, POLICIES) for t in cls.model_types] + [(c, POLICIES_BY_CLASS) for c in cls.hf_classes]:
        other = table.get(key)
        if other is not None and type(other) is not cls:
            raise ValueError(f"{key!r} is already served by {type(other).__name__}; cannot register {cls.__name__}")
        table[key] = policy
    return cls


def find_policy(model: nn.Module) -> Policy | None:
    """The policy for ``model``: by class name first, then by ``config.model_type``."""
    policy = POLICIES_BY_CLASS.get(type(model).__name__)
    if policy is None:
        policy = POLICIES.get(getattr(getattr(model, "config", None), "model_type", None))
    return policy
