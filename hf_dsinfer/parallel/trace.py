"""Dataflow trace of one forward pass: which linears feed which, so AutoTP can tell row- from column-parallel ones.

The model runs once on the meta device (no memory, no compute) under a ``TorchFunctionMode`` that propagates a
*taint* (the set of linears a tensor was computed from) through every torch op. A linear's output carries only its
own name; a full-width norm's output carries nothing (it reads the already reduced residual stream), a per-head norm
(qk-norm) passes its input's taint on. So:

* a linear whose input carries no linear of its own block reads the residual stream: **column**-parallel;
* a linear whose input carries linears of its block (``o_proj`` after q/k/v, ``down_proj`` after gate/up) is an
  output projection: **row**-parallel, followed by one all-reduce;
* an input that went through attention (``scaled_dot_product_attention`` or a matmul of two linears' outputs) is
  marked ``@attn``: that group is split by heads.

Data-dependent Python checks in HF code (``if mask.all()``, ``.item()``) cannot run on meta tensors; during the
trace they answer False / 0, which only selects among mask fast paths.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .. import hf_compat

ATTN = "@attn"
_SCALAR_ANSWERS = {"item": 0, "__bool__": False, "tolist": [], "__contains__": False, "__int__": 0, "__index__": 0,
                   "__float__": 0.0}
_ATTENTION_FUNCS = {"scaled_dot_product_attention", "matmul", "bmm", "baddbmm", "einsum", "__matmul__"}
EMPTY: frozenset[str] = frozenset()


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` (and subclasses such as Falcon's) or transformers' ``Conv1D`` (GPT-2's ``[in, out]`` linear)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def is_norm(module: nn.Module) -> bool:
    """LayerNorm / RMSNorm / GroupNorm modules, recognised by type or by HF's ``*Norm`` class names."""
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "Norm" in type(module).__name__


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a linear-like module."""
    w = module.weight
    return (w.shape[0], w.shape[1]) if type(module).__name__ == "Conv1D" else (w.shape[1], w.shape[0])


def norm_width(module: nn.Module) -> int | None:
    """Number of features a norm normalizes over (its weight length), when it has a weight."""
    w = getattr(module, "weight", None)
    return int(w.numel()) if isinstance(w, torch.Tensor) else None


@dataclass
class Trace:
    """What the trace saw: the input taint of every called linear and norm (module name -> linear names)."""

    linear_inputs: dict[str, frozenset[str]] = field(default_factory=dict)
    norm_inputs: dict[str, frozenset[str]] = field(default_factory=dict)


class _TaintMode(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.taint: dict[int, frozenset[str]] = {}
        self.alive: list[torch.Tensor] = []  # keeps traced tensors alive so their ids are not reused

    def of(self, value: object) -> frozenset[str]:
        out: set[str] = set()
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                out |= self.taint.get(id(t), EMPTY)
        return frozenset(out)

    def set(self, value: object, taint: frozenset[str]) -> None:
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                self.taint[id(t)] = taint
                self.alive.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _SCALAR_ANSWERS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return _SCALAR_ANSWERS[name]
        out = func(*args, **kwargs)
        tainted = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and self.taint.get(id(t))]
        if tainted:
            taint = frozenset().union(*(self.taint[id(t)] for t in tainted))
            if name in _ATTENTION_FUNCS and len(tainted) >= 2:
                taint = taint | {ATTN}
            self.set(out, taint)
        return out


def _meta_twin(model: nn.Module) -> nn.Module:
    """The same architecture on the meta device (structure and names identical; no memory)."""
    if all(p.is_meta for p in model.parameters()):
        return model
    if not hasattr(model, "config") or not hf_compat.can_build_from_config(type(model)):
        raise ValueError(
            f"AutoTP traces transformers models (PreTrainedModel); {type(model).__name__} is not one. Pass "
            "injection_policy={LayerClass: ('attn.out_proj', 'mlp.down_proj')} or use a transformers model."
        )
    with torch.device("meta"):
        return hf_compat.model_from_config(type(model), copy.deepcopy(model.config))


def _normalizes_sibling_projection(norm: str, taint: frozenset[str], result: Trace) -> bool:
    """True when the norm's input is only the output of linears in its own module (``self_attn.q_proj`` for
    ``self_attn.q_norm``) that read the residual stream (no linear in their own input): a q/k norm, not a residual one.
    """
    parent = norm.rpartition(".")[0]
    linears = [n for n in taint if n != ATTN]
    return bool(linears) and all(
        n.rpartition(".")[0] == parent and not result.linear_inputs.get(n, EMPTY) for n in linears
    ) and len(linears) == len(taint)


@torch.no_grad()
def trace_model(model: nn.Module) -> Trace:
    """Run ``model`` (or its meta twin) once on 4 tokens and record the linears each linear and norm reads from."""
    twin = _meta_twin(model)
    result = Trace()
    mode = _TaintMode()
    handles = []
    out_width = {n: linear_dims(m)[1] for n, m in twin.named_modules() if is_linear(m)}
    for name, module in twin.named_modules():
        if is_linear(module):

            def pre(mod, args, name=name):
                result.linear_inputs[name] = mode.of(args)

            def post(mod, args, out, name=name):
                mode.set(out, frozenset({name}))

        elif is_norm(module):

            def pre(mod, args, name=name):
                result.norm_inputs[name] = mode.of(args)

            width = norm_width(module)

            def post(mod, args, out, name=name, width=width):
                # A norm over the full width reads the reduced residual stream: its output depends on no linear. A
                # norm narrower than a linear feeding it (qk-norm per head), or one over the whole output of a sibling
                # projection that reads the residual stream (OLMo-2's q/k norm), passes that linear's taint through.
                taint = result.norm_inputs[name]
                narrow = width is not None and any(out_width.get(n, 0) > width for n in taint)
                mode.set(out, taint if narrow or _normalizes_sibling_projection(name, taint, result) else EMPTY)

        else:
            continue
        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
    kwargs = {"input_ids": ids}
    config = getattr(twin, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = ids
    if config is not None and getattr(config, "use_cache", None) is not None:
        kwargs["use_cache"] = False
    try:
        with mode:
            twin(**kwargs)
    except Exception as e:  # noqa: BLE001 - any failure means the structure is unknown; say so with the cause
        raise ValueError(
            f"AutoTP could not trace {type(model).__name__} on the meta device ({type(e).__name__}: {e}); pass "
            "injection_policy={LayerClass: ('attn.out_proj', 'mlp.down_proj')} naming each layer's output projections."
        ) from e
    finally:
        for h in handles:
            h.remove()
    return result
