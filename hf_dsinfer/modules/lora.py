"""Several LoRA adapters per batch on the fused linears: a side path chosen per token (serving, docs/serving.md).

A :class:`MultiLoRALinear` is a fused :class:`~.linear.Linear` (the same base weight, adopted) plus adapter slots:
``y = x W^T + b`` and, for each token ``n`` whose slot ``s = slots[n] >= 0``, ``y[n] += (x[n] A_s^T) B_s^T``
(:func:`hf_dsinfer.kernels.lora.lora_add`: the torch path on CPU, the gathered Triton kernel on CUDA).

A fused linear stacks several HF projections (q/k/v in ``attn.qkv``, gate/up in ``mlp.up``): each of its ``parts``
owns a rank block ``[p * R, (p + 1) * R)`` of ``A [L, parts * R, in]`` and its own output rows of
``B [L, out, parts * R]`` (block-diagonal), so one pair of launches covers every part and every adapter. The scaling
is folded into ``B``. An adapter of rank ``r < R`` leaves zeros in its block (exact: zeros add nothing).

Under tensor parallelism each rank holds its shard of every adapter (:mod:`hf_dsinfer.serving.lora` slices it): a
column-parallel linear (qkv, gate/up: output rows split) keeps ``A`` whole and the base weight's rows of ``B``; a
row-parallel one (o, down: input columns split, ``reduce`` set) keeps the base weight's columns of ``A`` and ``B``
whole, and its delta is added to this rank's partial product *before* the all-reduce, so base and delta are summed
over the ranks by the one reduce the base linear does anyway.

The per-token slots are set per step on a :class:`LoRASlots` shared by every side path of the model (the serving
runner sets them around its forward; ``None``: no adapter in this step, the side path costs nothing). The Hybrid
Engine's ``LoRALinear`` (hybrid/shared_base.py) is the single-adapter training-time sibling of this class.
"""

from __future__ import annotations

import torch

from hf_dsinfer.kernels.lora import lora_add, slot_groups

from .linear import Linear


class LoRASlots:
    """The current step's adapter slot of each token, read by every :class:`MultiLoRALinear` of one model.

    ``slots [T]`` int32 on the model's device (-1: base), or None when no token of the step uses an adapter;
    ``groups``: the same as ``[(slot, token rows)]`` for the torch path (built once per step, not once per layer).
    """

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None
        self.groups: list[tuple[int, torch.Tensor]] | None = None

    def set(self, slots: list[int] | None, device: torch.device) -> None:
        """This step's slot per token (None or all -1: no adapter runs)."""
        if slots is None or max(slots, default=-1) < 0:
            self.slots = self.groups = None
            return
        self.slots = torch.tensor(slots, dtype=torch.int32).to(device, non_blocking=True)  # [T]
        # The torch path's groups; the CUDA kernel gathers per token and needs none (a torch path there rebuilds them).
        self.groups = None if device.type == "cuda" else slot_groups(slots, device)


class MultiLoRALinear(Linear):
    """A fused linear with ``max_loras`` adapter slots of per-part rank ``max_rank`` (see the module docstring).

    ``lora_a [L, parts * R, in]`` and ``lora_b [L, out, parts * R]`` are non-persistent buffers in the weight's dtype
    and device (not in the state dict: adapters are loaded into slots, never saved with the model).
    """

    def __init__(self, base: Linear, state: LoRASlots, max_loras: int, max_rank: int, parts: list[int]):
        super().__init__(base.weight, base.bias, base.reduce)
        w = base.weight
        if sum(parts) != w.shape[0]:
            raise ValueError(f"the parts' rows {parts} do not add up to the fused linear's {w.shape[0]} outputs")
        self.state = state
        self.parts = list(parts)  # output rows of each stacked projection, in order
        self.max_rank = max_rank
        self.slot_ranks = [0] * max_loras  # per slot, the largest rank written into a part's block (the rest is 0)
        total = len(parts) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, total, w.shape[1], dtype=w.dtype, device=w.device),
                             persistent=False)  # fmt: skip
        self.register_buffer("lora_b", torch.zeros(max_loras, w.shape[0], total, dtype=w.dtype, device=w.device),
                             persistent=False)  # fmt: skip

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Write one projection's adapter into ``slot``: ``a [r, in]``, ``b [rows of part, r]`` (r <= max_rank),
        ``scale`` (peft's ``lora_alpha / r``) folded into ``b`` in fp32."""
        r = a.shape[0]
        rows = self.parts[part]
        if r > self.max_rank:
            raise ValueError(f"adapter rank {r} exceeds max_lora_rank={self.max_rank}; raise --max-lora-rank")
        if a.shape != (r, self.lora_a.shape[2]) or b.shape != (rows, r):
            raise ValueError(f"adapter weights A {tuple(a.shape)} / B {tuple(b.shape)} do not fit this projection "
                             f"(in {self.lora_a.shape[2]}, out {rows})")  # fmt: skip
        lo, row0 = part * self.max_rank, sum(self.parts[:part])
        self.slot_ranks[slot] = max(self.slot_ranks[slot], r)
        self.lora_a[slot, lo : lo + r].copy_(a)
        self.lora_a[slot, lo + r : lo + self.max_rank].zero_()
        self.lora_b[slot, row0 : row0 + rows, lo : lo + r].copy_(b.float() * scale)
        self.lora_b[slot, row0 : row0 + rows, lo + r : lo + self.max_rank].zero_()

    def clear_slot(self, slot: int) -> None:
        """Zero ``slot`` (a projection the next adapter does not adapt must add nothing)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slot_ranks[slot] = 0

    def forward(self, x: torch.Tensor, defer_reduce: bool = False) -> torch.Tensor:
        """``x [..., in] -> [..., out]``: the base product, then each adapted token's delta added in place.

        Row-parallel (``reduce`` set): the delta joins this rank's partial sums, then one reduce and the bias (or, with
        ``defer_reduce``, the partial sums come back unreduced and without the bias, as :class:`~.linear.Linear`'s)."""
        slots = self.state.slots
        if slots is None:
            return super().forward(x, defer_reduce)
        partial = self.reduce is not None
        y = super().forward(x, defer_reduce or partial)  # [..., out], a new tensor (row-parallel: partial, no bias)
        y = y if y.is_contiguous() else y.contiguous()
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])  # [N, in], [N, out] (N = T of the step)
        if slots.shape[0] != x2.shape[0]:
            raise RuntimeError(f"LoRA slots for {slots.shape[0]} tokens, but the step has {x2.shape[0]}")
        lora_add(y2, x2, self.lora_a, self.lora_b, slots, self.state.groups, self.parts, self.slot_ranks)
        if not partial or defer_reduce:
            return y
        y = self.reduce(y)  # base + delta summed over the ranks at once
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, loras={self.lora_a.shape[0]}, max_rank={self.max_rank}, parts={self.parts}"
