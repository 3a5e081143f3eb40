"""The runner: one ragged step of the fused layers over the paged KV cache, then the next token of each request.

A step packs the scheduled tokens of all its requests into one row ``[1, T, C]`` (no padding): the policy embeds
them, :meth:`Runtime.run_layers` runs the fused layers with a :class:`PagedStepContext` (each attention stores its
keys/values into the paged cache through the slot mapping and attends through the block tables), and the LM head
runs only on the last token of each request that has now computed all its tokens (and on the prompt positions of
requests asking for prompt log-probs). Each request's next token comes from its own settings
(:func:`~.sampling.select_tokens`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..modules.attention import PagedStepContext
from ..modules.kv_cache import PagedKVCache, _device_free_bytes
from ..policies.injection import get_injection
from .blocks import BlockManager
from .requests import SamplingParams
from .sampling import prompt_logprob_rows, record_prompt_logprobs, select_tokens
from .scheduler import StepPlan
from .speculation import verify_greedy


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the paged engine cannot serve ``model`` exactly (the caller falls back), or None when it can."""
    record = get_injection(model)
    if record is None:
        return "the model has no fused layers (no kernel injection)"
    if model.get_output_embeddings() is None:
        return "the model has no LM head"
    for layer in record.runtime.layers:
        attn = getattr(layer, "attn", None)
        spec = getattr(attn, "spec", None)
        if spec is None:
            return f"layer {type(layer).__name__} has no fused attention"
        if spec.alibi_slopes is not None and _triton_paged(model):
            return "ALiBi attention (bloom) over the paged cache: its Triton kernels have no ALiBi (the torch path has)"
        if not spec.causal:
            return "non-causal attention"
        if attn.o.reduce is not None:
            return "tensor parallelism (the engine runs one rank)"
    return None


def _triton_paged(model: nn.Module) -> bool:
    """Whether the paged attention kernels would take their Triton path for ``model`` (on its device)."""
    from hf_dsinfer.kernels.backend import use_triton

    return use_triton(model.get_output_embeddings().weight)


class PagedRunner:
    """Owns the paged cache and block manager of one model and runs :class:`StepPlan` s on its fused layers."""

    def __init__(self, model: nn.Module, *, block_size: int, num_blocks: int | None, max_num_seqs: int = 64):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"continuous batching on fused layers cannot serve this model: {reason}")
        self.model = model
        self.runtime = get_injection(model).runtime
        static = self.runtime.cache
        #: Longest request (prompt + new tokens): the rotary / position tables are built for max_out_tokens.
        self.max_positions = int(static.max_tokens)
        specs = [layer.attn.spec for layer in self.runtime.layers]
        if num_blocks is None:
            num_blocks = self._default_blocks(model, specs, block_size, max_num_seqs)
        self.cache = PagedKVCache([s.num_kv_heads for s in specs], [s.head_dim for s in specs], num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size, self.cache.copy_block)
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.lora = None  # a serving.lora.LoRARegistry when adapters are enabled (the engine sets it)

    def _default_blocks(self, model: nn.Module, specs: list, block_size: int, max_num_seqs: int) -> int:
        """Room for ``max_num_seqs`` requests of ``max_out_tokens``, within half the free GPU memory (a quarter of the
        RAM on CPU), and at least the static cache's ``max_out_tokens x max_batch_size`` tokens."""
        static = self.runtime.cache
        weight = model.get_output_embeddings().weight
        per_token = 2 * weight.element_size() * sum(s.num_kv_heads * s.head_dim for s in specs)  # K and V, all layers
        tokens = self.max_positions * max_num_seqs
        free = _device_free_bytes(weight.device)  # CUDA: free memory; CPU: physical RAM (not what is free)
        if free is not None:
            tokens = min(tokens, free // (2 if weight.device.type == "cuda" else 4) // per_token)
        tokens = max(tokens, self.max_positions * max(1, int(static.max_batch_size)))
        return -(-tokens // block_size)

    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Refuse a prompt no step could run (empty, ids outside the vocabulary) and token ids in the settings that
        the model cannot produce."""
        if not prompt:
            raise ValueError("input_ids is empty: a prompt needs at least one token (e.g. the tokenizer's BOS)")
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= self.vocab:
            raise ValueError(f"input_ids hold ids outside the vocabulary [0, {self.vocab}) (min {lo}, max {hi})")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            outside = sorted(t for t in ids if t >= self.vocab)
            if outside:
                raise ValueError(f"{name} holds token ids outside the vocabulary [0, {self.vocab}): {outside[:5]}")

    def _context(self, plan: StepPlan, device: torch.device) -> tuple[torch.Tensor, PagedStepContext]:
        """The step's ``input_ids [1, T]`` and its paged context."""
        bs = self.blocks.block_size
        ids, positions, slots, cu, lens = [], [], [], [0], []
        width = max(len(seq.block_table) for seq, _ in plan.chunks)
        tables = torch.zeros(len(plan.chunks), width, dtype=torch.int32)  # [S, MB], unused entries 0
        for s, (seq, n) in enumerate(plan.chunks):
            start = seq.num_computed
            ids += seq.tokens[start : start + n] + plan.drafts.get(id(seq), [])  # speculative proposals after it
            pos = range(start, start + n)
            positions += pos
            slots += [seq.block_table[p // bs] * bs + p % bs for p in pos]
            cu.append(cu[-1] + n)
            lens.append(start + n)
            tables[s, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)

        def dev(values: Any, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        pos = dev(positions, torch.long)  # [T]
        empty = torch.empty(0, dtype=torch.int32, device=device)
        ctx = PagedStepContext(
            cache=self.cache, start=empty, cache_lens=empty, positions=pos, rotary=self.runtime.rotary,
            block_tables=tables.to(device), cu_seqlens_q=dev(cu, torch.int32), seq_lens_k=dev(lens, torch.int32),
            slot_mapping=dev(slots, torch.long),
        )  # fmt: skip
        return dev([ids], torch.long), ctx

    @torch.no_grad()
    def run(self, plan: StepPlan) -> dict[int, int]:
        """Run ``plan`` through the model; returns ``{id(sequence): next token}`` for each request whose tokens are all
        computed after this step (the others are mid-prefill)."""
        model, runtime = self.model, self.runtime
        device = model.get_output_embeddings().weight.device
        input_ids, ctx = self._context(plan, device)
        positions = ctx.positions[None]  # [1, T]
        hidden = runtime.policy.embed(model, input_ids, positions)  # [1, T, C]
        self.cache.allocate(hidden.device, hidden.dtype)
        if runtime.rotary is not None and runtime.rotary.cos.device != hidden.device:
            runtime.rotary.to(hidden.device)
        if self.lora is None:
            hidden = runtime.run_layers(model, hidden, ctx)  # [1, T, C]
        else:  # each token's adapter slot (-1: base) for the LoRA side paths, for this forward only
            slots = [-1 if s.lora is None else s.lora.slot for s, n in plan.chunks for _ in range(n)]  # [T]
            self.lora.set_step(slots, device)
            try:
                hidden = runtime.run_layers(model, hidden, ctx)  # [1, T, C]
            finally:
                self.lora.set_step(None, device)
        head = model.get_output_embeddings()
        where, owners = prompt_logprob_rows(plan.chunks, device)
        if where:  # prompt log-probs: the LM head over those requests' prompt positions only
            rows = hidden[0, torch.tensor(where, device=hidden.device)]  # [N, C]
            logits = runtime.policy.finalize_logits(model, head(rows)[:, None])[:, 0].float()  # [N, V]
            record_prompt_logprobs(logits, owners)
        last, ready = [], []
        spec, spec_rows = [], []  # speculating requests: logits at every position they ran
        end = 0
        for seq, n in plan.chunks:
            end += n
            draft = plan.drafts.get(id(seq))
            if draft:
                spec.append((seq, draft))
                spec_rows += range(end - n, end)
            elif seq.num_computed + n == len(seq.tokens):
                last.append(end - 1)
                ready.append(seq)
        if not ready and not spec:
            return {}
        rows = hidden[0, torch.tensor(last + spec_rows, device=hidden.device)]  # [R + D, C]
        logits = runtime.policy.finalize_logits(model, head(rows)[:, None])[:, 0].float()  # [R + D, V] fp32
        out = {id(seq): tok for seq, tok in zip(ready, select_tokens(logits[: len(last)], ready))} if ready else {}
        if spec:
            out.update(verify_greedy(logits[len(last) :], spec, plan.accepted))
        return out
