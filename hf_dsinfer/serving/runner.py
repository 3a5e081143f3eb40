"""The runner: one ragged step of the fused layers over the paged KV cache, then the next token of each request.

A step packs the scheduled tokens of all its requests into one row ``[1, T, C]`` (no padding): the policy embeds
them, :meth:`Runtime.run_layers` runs the fused layers with a :class:`PagedStepContext` (each attention stores its
keys/values into the paged cache through the slot mapping and attends through the block tables), and the LM head
runs only on the last token of each request that has now computed all its tokens (and on the prompt positions of
requests asking for prompt log-probs). Each request's next token comes from its own settings
(:func:`~.sampling.select_tokens`).

The step splits in two: :meth:`PagedRunner.step_inputs` turns a :class:`StepPlan` into plain tensors
(:class:`StepInputs`: token ids, positions, slot mapping, block tables, the rows that need logits, copy-on-write block
copies) and :meth:`PagedRunner.forward` runs them. Under tensor parallelism rank 0 schedules, sends the
:class:`StepInputs` to the other ranks (:mod:`.tp_worker`, one broadcast) and every rank runs ``forward`` on its shard
and its own paged cache (its local KV heads, the same block ids); only rank 0 samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..modules import cpu_packed
from ..modules.attention import PagedStepContext
from ..modules.kv_cache import PagedKVCache, _device_free_bytes
from ..policies.injection import get_injection
from .blocks import BlockManager
from .requests import SamplingParams
from .sampling import prompt_logprob_rows, record_prompt_logprobs, select_tokens
from .scheduler import StepPlan
from .speculation import verify


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
    return None


def _triton_paged(model: nn.Module) -> bool:
    """Whether the paged attention kernels would take their Triton path for ``model`` (on its device)."""
    from hf_dsinfer.kernels.backend import use_triton

    return use_triton(model.get_output_embeddings().weight)


def tp_group_of(model: nn.Module) -> Any:
    """The model's tensor-parallel :class:`~hf_dsinfer.parallel.TPGroup` (the trivial group when not split)."""
    from ..parallel import SINGLE
    from ..parallel.apply import GROUP_ATTR

    return getattr(model, GROUP_ATTR, SINGLE)


def vocab_size(model: nn.Module) -> int:
    """Rows of the LM head's logits: the whole vocabulary, also when the head is split over TP ranks."""
    from ..parallel.layers import TP_ATTR

    head = model.get_output_embeddings()
    split = getattr(head, TP_ATTR, None)
    if isinstance(split, dict) and split.get("kind") == "vocab_head":
        return int(sum(split["sizes"]))
    return int(head.weight.shape[0])


@dataclass
class StepInputs:
    """Everything a rank needs to run one step, as CPU tensors (rank 0 builds it; under TP it is broadcast).

    ``T`` tokens of ``S`` sequences; ``prompt_rows`` and ``sample_rows`` index the packed tokens whose logits are
    needed (prompt log-probs; next tokens and speculative verification), each read by one LM-head call, which under
    TP gathers the vocab over the ranks (so every rank calls it with the same rows). ``copies``: the copy-on-write
    block copies the scheduler decided since the last step, done before the step on every rank.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, MB] int32, unused entries 0
    prompt_rows: torch.Tensor  # [N] int64
    sample_rows: torch.Tensor  # [R] int64
    copies: torch.Tensor  # [K, 2] int64: (source block, destination block)
    lora_slots: torch.Tensor | None = None  # [T] int64: each token's adapter slot (-1: base); None: no adapters


class PagedRunner:
    """Owns the paged cache and block manager of one model and runs :class:`StepPlan` s on its fused layers.

    ``channel``: under tensor parallelism on rank 0, the :class:`~.tp_worker.StepChannel` that sends each step's
    :class:`StepInputs` to the other ranks before running it here (None: one process).
    """

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
        # Copy-on-write copies are recorded when the scheduler decides them and done at the start of the next step
        # (every TP rank does them then); nothing reads the cache in between.
        self._copies: list[tuple[int, int]] = []
        self.blocks = BlockManager(num_blocks, block_size, lambda src, dst: self._copies.append((src, dst)))
        self.vocab = vocab_size(model)
        self.lora = None  # a serving.lora.LoRARegistry when adapters are enabled (the engine sets it)
        self.channel = None  # a tp_worker.StepChannel on rank 0 of a tensor-parallel model (the engine sets it)

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

    def step_inputs(self, plan: StepPlan, prompt_rows: list[int], sample_rows: list[int]) -> StepInputs:
        """The :class:`StepInputs` of ``plan`` (rank 0); takes the copy-on-write copies recorded since the last step."""
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
        lora = None
        if self.lora is not None:  # each token's adapter slot (-1: base) for the LoRA side paths
            lora = torch.tensor([-1 if s.lora is None else s.lora.slot for s, n in plan.chunks for _ in range(n)])
        copies, self._copies = self._copies, []
        long = torch.long
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=long), positions=torch.tensor(positions, dtype=long),
            slot_mapping=torch.tensor(slots, dtype=long), cu_seqlens=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
            prompt_rows=torch.tensor(prompt_rows, dtype=long), sample_rows=torch.tensor(sample_rows, dtype=long),
            copies=torch.tensor(copies, dtype=long).reshape(-1, 2), lora_slots=lora,
        )  # fmt: skip

    @torch.no_grad()
    def forward(self, step: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run one step on this rank's layers and paged cache: ``(prompt_logits [N, V], logits [R, V])`` (fp32; None
        where no row is asked for). Every rank of a tensor-parallel group calls it with the same ``step``."""
        model, runtime = self.model, self.runtime
        device = model.get_output_embeddings().weight.device

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        positions = dev(step.positions)  # [T]
        hidden = runtime.policy.embed(model, dev(step.input_ids)[None], positions[None])  # [1, T, C]
        self.cache.allocate(hidden.device, hidden.dtype)
        for src, dst in step.copies.tolist():  # copy-on-write decided by the scheduler, before this step writes
            self.cache.copy_block(src, dst)
        if runtime.rotary is not None and runtime.rotary.cos.device != hidden.device:
            runtime.rotary.to(hidden.device)
        empty = torch.empty(0, dtype=torch.int32, device=device)
        ctx = PagedStepContext(
            cache=self.cache, start=empty, cache_lens=empty, positions=positions, rotary=runtime.rotary,
            block_tables=dev(step.block_tables), cu_seqlens_q=dev(step.cu_seqlens), seq_lens_k=dev(step.seq_lens),
            slot_mapping=dev(step.slot_mapping),
        )  # fmt: skip
        with cpu_packed.ragged_rows():  # fp32 CPU: 4-32 tokens (decoding requests) take the prepacked GEMM
            if step.lora_slots is None or self.lora is None:
                hidden = runtime.run_layers(model, hidden, ctx)  # [1, T, C]
            else:  # each token's adapter slot for the LoRA side paths, for this forward only
                self.lora.set_step(step.lora_slots.tolist(), device)
                try:
                    hidden = runtime.run_layers(model, hidden, ctx)  # [1, T, C]
                finally:
                    self.lora.set_step(None, device)
        head = model.get_output_embeddings()

        def logits_at(rows: torch.Tensor) -> torch.Tensor | None:
            if not rows.numel():
                return None
            picked = hidden[0, dev(rows)]  # [N, C]
            logits = cpu_packed.module_forward(head, picked)  # [N, V] (packed on CPU in fp32 for 4-32 rows)
            return runtime.policy.finalize_logits(model, logits[:, None])[:, 0].float()  # [N, V] fp32

        return logits_at(step.prompt_rows), logits_at(step.sample_rows)

    @torch.no_grad()
    def run(self, plan: StepPlan) -> dict[int, int]:
        """Run ``plan`` through the model; returns ``{id(sequence): next token}`` for each request whose tokens are all
        computed after this step (the others are mid-prefill)."""
        device = self.model.get_output_embeddings().weight.device
        where, owners = prompt_logprob_rows(plan.chunks, device)  # prompt log-probs: those prompt positions only
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
        step = self.step_inputs(plan, where, last + spec_rows)
        if self.channel is not None:
            self.channel.attach(self.blocks.num_blocks, self.blocks.block_size)
            self.channel.send_step(step)  # the other TP ranks run the same step on their shards
        prompt_logits, logits = self.forward(step)  # [N, V], [R + D, V] fp32
        if prompt_logits is not None:
            record_prompt_logprobs(prompt_logits, owners)
        if logits is None:
            return {}
        out = {id(seq): tok for seq, tok in zip(ready, select_tokens(logits[: len(last)], ready))} if ready else {}
        if spec:
            out.update(verify(logits[len(last) :], spec, plan.accepted))  # greedy and sampled (.speculation)
        return out
