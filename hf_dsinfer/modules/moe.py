"""Mixture-of-experts feed-forward block: top-k router, experts as two grouped GEMMs, optional gated shared expert.

The block stands where a dense MLP stands in :class:`~hf_dsinfer.modules.FusedDecoderLayer` (``layer.mlp``) and has
the same call (``x [B, T, C] -> [B, T, C]``, ``defer_reduce``). Per token it computes

    probs = softmax(x @ router.T) (fp32);  w, e = top_k(probs);  w /= sum(w) when ``renormalize``
    out   = sum_j w_j * down_e_j(act(gate_e_j(x)) * up_e_j(x))  [+ sigmoid(x @ shared_gate.T) * shared_mlp(x)]

The token-expert pairs are sorted by expert on the device and each expert's rows go through one grouped GEMM
(``kernels.moe_gemm``: Triton on CUDA with a device-side block map, so decoding has no host sync and can be captured
in a CUDA graph; one ``mm`` per non-empty expert on CPU, where the host reads the counts for free).

Rounding follows transformers' MoE blocks, which differ by family: ``fp32_routing_weights=True`` (Mixtral) keeps the
renormalised weights in fp32, so the weighted expert outputs and their sum over k are fp32; otherwise (Qwen2-MoE,
Qwen3-MoE) the weights are rounded to the model dtype first and the products stay in it.

Parallelism: under tensor parallelism each rank holds ``1/tp`` of every expert's intermediate features (``gate_up``
rows ``[gate_r; up_r]``, ``down`` columns) and of the shared expert; under expert parallelism a rank holds the experts
``[expert_begin, expert_begin + local experts)``, whole (``ep_size == tp_size``) or ``1/t`` of their features when an
expert group spans ``t`` ranks (the local feature count is read from the weights' shapes). Either way the block
produces this rank's partial sums and ``reduce`` (an in-place sum over all the ranks, given by the caller) completes
them once, after the shared expert's partials are added. The router is replicated, so every rank routes every token
the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hf_dsinfer.kernels import act_and_mul, use_triton
from hf_dsinfer.kernels.moe_gemm import moe_gemm, moe_sort

from .linear import Linear, gemm_layout, wants_k_major
from .mlp import GATED_ACTIVATIONS, FusedMLP, MLPSpec

#: Fused parameter names of an MoE block inside a decoder layer (relative to the layer).
MOE_PARAM_NAMES = (
    "mlp.router.weight",  # [E, C]
    "mlp.experts.gate_up",  # [E_local, 2I, C]: rows [gate; up] per expert
    "mlp.experts.down",  # [E_local, C, I]
    "mlp.shared.up.weight",  # [2Is, C] rows [gate; up] (shared expert)
    "mlp.shared.down.weight",  # [C, Is]
    "mlp.shared_gate.weight",  # [1, C]
)


@dataclass(frozen=True)
class MoESpec:
    """What an MoE block computes, apart from its weights.

    ``num_experts``: experts the router scores (all of them, also under expert parallelism); ``top_k``: experts per
    token; ``renormalize``: divide the top-k probabilities by their sum (Mixtral always, Qwen's ``norm_topk_prob``);
    ``fp32_routing_weights``: see the module docstring; ``activation``: the experts' gated activation;
    ``shared_expert`` / ``shared_expert_gate``: Qwen2-MoE's dense expert and its sigmoid gate; ``expert_begin``:
    see :class:`FusedMoE` (expert parallelism).
    """

    num_experts: int
    top_k: int
    renormalize: bool = True
    fp32_routing_weights: bool = False
    activation: str = "silu"
    shared_expert: bool = False
    shared_expert_gate: bool = False
    #: Expert parallelism: the first of this rank's experts (the block holds experts [expert_begin, + local count)).
    expert_begin: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoESpec: top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")
        if self.activation not in GATED_ACTIVATIONS:
            raise ValueError(f"MoESpec: activation {self.activation!r} is not one of {GATED_ACTIVATIONS}")
        if self.shared_expert_gate and not self.shared_expert:
            raise ValueError("MoESpec: shared_expert_gate needs shared_expert=True")


def expert_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight [E, N, K]`` in the layout the device's GEMM reads fastest (same shape and values).

    On CPU each expert is stored K-major (``[E, K, N]`` storage seen through ``transpose(1, 2)``), for the reason
    :func:`~hf_dsinfer.modules.gemm_layout` gives for 2-d weights (fp32 only); elsewhere the tensor is returned as is.
    """
    if not wants_k_major(weight) or weight.ndim != 3 or weight.stride()[1:] == (1, weight.shape[1]):
        return weight
    out = torch.empty(weight.shape[0], weight.shape[2], weight.shape[1], dtype=weight.dtype).transpose(1, 2)
    out.copy_(weight.detach())
    return out


class ExpertWeights(nn.Module):
    """The stacked expert weights: ``gate_up [E_local, 2I, C]`` and ``down [E_local, C, I]``."""

    def __init__(self, gate_up: nn.Parameter, down: nn.Parameter):
        super().__init__()
        if gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[0] != down.shape[0]:
            raise ValueError(
                f"expert weights must be gate_up [E, 2I, C] and down [E, C, I], got {tuple(gate_up.shape)} and "
                f"{tuple(down.shape)}"
            )
        if gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
            raise ValueError(
                f"expert gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} disagree: need [E, 2I, C] and "
                "[E, C, I]"
            )
        self.gate_up = gate_up
        self.down = down

    def extra_repr(self) -> str:
        e, two_i, c = self.gate_up.shape
        return f"experts={e}, hidden={c}, intermediate={two_i // 2}"


def _host_loop_ok(x: torch.Tensor) -> bool:
    """Whether expert ids may be read on the host: torch kernels on CPU (free there; under torch.compile through the
    opaque op below), never on a GPU (a sync that would break CUDA graphs)."""
    return x.device.type == "cpu" and not use_triton(x)


def _experts_per_pair_eager(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    expert_begin: int, activation: str,
) -> torch.Tensor:
    """``x [N, C]``, ``weights``/``ids [N, k]``, ``gate_up [E, 2I, C]``, ``down [E, C, I]`` -> ``[N, C]``: each
    (token, expert) pair on its own, reading only the chosen experts' weights (experts outside ``[expert_begin,
    expert_begin + E)`` add zeros)."""
    n, k = ids.shape
    y = x.new_zeros(n * k, x.shape[1])  # [S, C] in (token, slot) order
    for pair, e in enumerate((ids - expert_begin).reshape(-1).tolist()):
        if 0 <= e < gate_up.shape[0]:
            row = x[pair // k : pair // k + 1]  # [1, C]
            h = act_and_mul(row @ gate_up[e].t(), activation)  # [1, I]
            torch.mm(h, down[e].t(), out=y[pair : pair + 1])
    y = y * weights.reshape(-1, 1)
    return y.view(n, k, -1).sum(dim=1).to(x.dtype)


# Inside the compiled CPU decode step the per-pair loop (which reads the expert ids on the host) runs as one opaque
# op per MoE layer, defined with torch.library directly: ~15 us of dispatch per call, where a torch.library.custom_op
# costs ~80 us and the sorted grouped-GEMM path two such ops plus the sort (measured on the moe-tiny preset).
_LIB = torch.library.Library("hf_dsinfer", "FRAGMENT")
try:
    _LIB.define(
        "moe_experts_per_pair(Tensor x, Tensor weights, Tensor ids, Tensor gate_up, Tensor down, int expert_begin, "
        "str activation) -> Tensor"
    )
except RuntimeError:  # pragma: no cover - defined already (the module imported twice under two names)
    pass
else:
    _LIB.impl("moe_experts_per_pair", _experts_per_pair_eager, "CPU")
    torch.library.register_fake(
        "hf_dsinfer::moe_experts_per_pair", lambda x, weights, ids, *rest: x.new_empty(x.shape), lib=_LIB
    )


def _adopt(tensor: torch.Tensor, layout: Callable[[torch.Tensor], torch.Tensor]) -> nn.Parameter:
    laid = layout(tensor)
    if laid is tensor and isinstance(tensor, nn.Parameter):
        return tensor
    return nn.Parameter(laid, requires_grad=False)


class FusedMoE(nn.Module):
    """Router + grouped-GEMM experts (+ gated shared expert). Build it with :meth:`from_params`."""

    def __init__(
        self,
        spec: MoESpec,
        router: Linear,
        experts: ExpertWeights,
        shared: FusedMLP | None = None,
        shared_gate: Linear | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        expert_begin: int | None = None,
    ):
        super().__init__()
        expert_begin = spec.expert_begin if expert_begin is None else expert_begin
        num_local = experts.gate_up.shape[0]
        if router.out_features != spec.num_experts:
            raise ValueError(f"router has {router.out_features} outputs but MoESpec.num_experts={spec.num_experts}")
        if not 0 <= expert_begin <= spec.num_experts - num_local:
            raise ValueError(f"experts [{expert_begin}, {expert_begin + num_local}) exceed {spec.num_experts}")
        if spec.shared_expert != (shared is not None) or spec.shared_expert_gate != (shared_gate is not None):
            raise ValueError("MoESpec.shared_expert / shared_expert_gate disagree with the given modules")
        self.spec = spec
        self.router = router
        self.experts = experts
        self.shared = shared
        self.shared_gate = shared_gate
        self.reduce = reduce
        self.expert_begin = expert_begin
        self.num_local_experts = num_local

    @classmethod
    def from_params(
        cls,
        spec: MoESpec,
        params: dict[str, nn.Parameter],
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        expert_begin: int | None = None,
    ) -> FusedMoE:
        """Build the block from fused parameters named as in :data:`MOE_PARAM_NAMES` (``mlp.`` prefix included).

        Expert and shared-expert weights are given the device's GEMM layout (a K-major copy on CPU); the router keeps
        the checkpoint's layout, so its logits round exactly as HF's and every token picks HF's experts.
        """
        required = ["mlp.router.weight", "mlp.experts.gate_up", "mlp.experts.down"]
        if spec.shared_expert:
            required += ["mlp.shared.up.weight", "mlp.shared.down.weight"]
        if spec.shared_expert_gate:
            required.append("mlp.shared_gate.weight")
        missing = [n for n in required if n not in params]
        if missing:
            raise ValueError(f"MoE block is missing fused parameters {missing}")
        experts = ExpertWeights(
            _adopt(params["mlp.experts.gate_up"], expert_layout), _adopt(params["mlp.experts.down"], expert_layout)
        )
        shared = shared_gate = None
        if spec.shared_expert:
            shared = FusedMLP(
                MLPSpec(gated=True, activation=spec.activation),
                Linear(_adopt(params["mlp.shared.up.weight"], gemm_layout)),
                Linear(_adopt(params["mlp.shared.down.weight"], gemm_layout), reduce=reduce),
            )
        if spec.shared_expert_gate:
            shared_gate = Linear(params["mlp.shared_gate.weight"])
        return cls(spec, Linear(params["mlp.router.weight"]), experts, shared, shared_gate, reduce, expert_begin)

    # -- forward ------------------------------------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, C]`` -> (routing weights ``[N, k]``, expert ids ``[N, k]``), as HF's top-k routers compute them."""
        logits = self.router(x)  # [N, E] in the model dtype, like HF's F.linear
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.spec.fp32_routing_weights:
            weights = weights.to(x.dtype)
        return weights, ids

    def experts_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [N, C]``, ``weights``/``ids [N, k]`` -> this rank's expert outputs summed over k, ``[N, C]``."""
        n, k = ids.shape
        if n * k <= self.num_local_experts and _host_loop_ok(x):
            return self._experts_per_pair(x, weights, ids)
        local = ids - self.expert_begin
        num_local = self.num_local_experts
        sharded = num_local != self.spec.num_experts
        if sharded:
            # Expert parallelism: pairs routed to another rank's experts get the extra id num_local, which sorts
            # them last; they are never multiplied and contribute zeros.
            valid = (local >= 0) & (local < num_local)
            local = torch.where(valid, local, num_local)
        order, counts = moe_sort(local, num_local + 1 if sharded else num_local)
        if sharded:
            counts = counts[:num_local]
        rows = order // k  # [S] the token of each sorted pair
        h = moe_gemm(x, self.experts.gate_up, counts, rows)  # [S, 2I]
        h = act_and_mul(h, self.spec.activation)  # [S, I]
        y = moe_gemm(h, self.experts.down, counts)  # [S, C]
        if sharded:
            y = y.masked_fill(~valid.reshape(-1)[order, None], 0.0)  # rows past the local experts are not written
        y = y * weights.reshape(-1)[order, None]  # fp32 for Mixtral, the model dtype for Qwen
        out = torch.empty_like(y)
        out[order] = y  # back to (token, slot) order
        return out.view(n, k, -1).sum(dim=1).to(x.dtype)

    def _experts_per_pair(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Few pairs (decoding a small batch) on CPU: each (token, expert) pair on its own, reading only the chosen
        experts' weights and skipping the sort; the same roundings as :meth:`experts_forward`."""
        args = (x, weights, ids, self.experts.gate_up, self.experts.down, self.expert_begin, self.spec.activation)
        if torch.compiler.is_compiling():
            return torch.ops.hf_dsinfer.moe_experts_per_pair(*args)
        return _experts_per_pair_eager(*args)

    def forward(self, x: torch.Tensor, defer_reduce: bool = False) -> torch.Tensor:
        """``x [B, T, C] -> [B, T, C]``. ``defer_reduce`` (parallel): return this rank's partial sums unreduced."""
        shape = x.shape
        xt = x.reshape(-1, shape[-1])  # [N, C]
        weights, ids = self.route(xt)
        out = self.experts_forward(xt, weights, ids)
        if self.shared is not None:
            s = self.shared(xt, defer_reduce=True)  # [N, C] partial under parallelism
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(xt)) * s
            out = out + s
        if self.reduce is not None and not defer_reduce:
            out = self.reduce(out)
        return out.view(shape)

    def extra_repr(self) -> str:
        s = self.spec
        local = f", local experts [{self.expert_begin}, {self.expert_begin + self.num_local_experts})"
        return (
            f"experts={s.num_experts}, top_k={s.top_k}, renormalize={s.renormalize}, activation={s.activation}"
            + (local if self.num_local_experts != s.num_experts else "")
            + (", parallel=True" if self.reduce is not None else "")
        )


__all__ = ["MOE_PARAM_NAMES", "ExpertWeights", "FusedMoE", "MoESpec", "expert_layout"]
