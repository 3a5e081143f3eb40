"""The scheduler: which tokens of which requests run in the next step (ragged: decode tokens and prefill chunks).

Each step has a token budget (``max_batch_tokens``). Running requests come first, oldest first: a decoding request
takes one token, a request still prefilling takes the next chunk of its prompt that fits the budget (chunked
prefill). What budget is left admits waiting requests, first come first served, while they fit in ``max_num_seqs``
and in the free blocks (admission control: a request is admitted only if the blocks its whole prompt needs are
available). A decode that finds no free block preempts the newest running request (its blocks are freed; it waits
again at the head of the queue and recomputes its prompt and generated tokens when readmitted, mostly from cached
prompt blocks).

Prefix sharing at admission: the request takes the registered blocks matching its leading tokens and computes only
the rest (always at least its last token, whose logits give the next token). A request whose next block is being
computed by another running request (same prompt, submitted together) waits for it instead of computing it twice.
A request asking for prompt log-probs computes its whole prompt (it neither takes nor offers shared blocks).

A request finishes (vLLM's order): a sampling failure of its own settings ("error"); once ``min_tokens`` are
generated, one of its ``stop_token_ids`` ("stop", ``stop_reason`` the id) or EOS unless ``ignore_eos`` ("stop"); its
constraint terminated or a transformers criterion fired ("stop"); ``max_new_tokens`` reached ("length").
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .blocks import BlockManager, OutOfBlocks, prefix_keys
from .requests import Sequence


@dataclass
class StepPlan:
    """One step: ``chunks[i] = (sequence, number of tokens to run)`` starting at its ``num_computed``."""

    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # cancelled / failed while scheduling
    prompt_tokens: int = 0  # requested prompt tokens of the requests admitted this step
    prefix_hit_tokens: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    copies: int = 0
    sampled: int = 0  # filled in by Scheduler.update
    # speculative decoding (serving.speculation): id(seq) -> tokens proposed after its last token (its chunk runs
    # 1 + len of them), and id(seq) -> how many of them the runner's verification accepted
    drafts: dict[int, list[int]] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.chunks

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


class Scheduler:
    """Queues and block bookkeeping of the running requests; stepped by one thread (the engine's)."""

    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_batch_tokens: int,
        max_num_seqs: int,
        prefix_sharing: bool = True,
        max_positions: int | None = None,
    ):
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.prefix_sharing = prefix_sharing
        self.max_positions = max_positions
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.pending: dict[bytes, Sequence] = {}  # block key -> the running request computing that block
        self.speculator = None  # serving.speculation's NgramSpeculator or serving.draft's DraftSpeculator

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check_fits(self, total_tokens: int) -> None:
        """Raise ``ValueError`` when a request of ``total_tokens`` (prompt + max_new_tokens) could never run."""
        need = self.blocks.blocks_for(total_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"a request of {total_tokens} tokens (prompt + max_new_tokens) needs {need} KV blocks of "
                f"{self.blocks.block_size} tokens but the paged cache has num_blocks={self.blocks.num_blocks}: raise "
                "num_blocks (or max_out_tokens / max_batch_size, which size it by default) or shorten the request."
            )
        if self.max_positions is not None and total_tokens > self.max_positions:
            raise ValueError(
                f"a request of {total_tokens} tokens (prompt + max_new_tokens) is longer than the model's position "
                f"table ({self.max_positions}, max_out_tokens of the inference config): raise max_out_tokens or "
                "shorten the request."
            )

    # -- queue changes (between steps) -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def cancel(self, request_id: str) -> None:
        for seq in [s for s in (*self.waiting, *self.running) if s.request_id == request_id]:
            self._retire(seq)
            seq.handle._finish("cancelled")

    def cancel_all(self) -> None:
        for seq in (*self.waiting, *self.running):
            self._retire(seq)
            seq.handle._finish("cancelled")

    def fail_all(self, error: str) -> None:
        for seq in (*self.waiting, *self.running):
            self._retire(seq)
            seq.handle._finish("error", error)

    def _retire(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._drop_pending(seq)
        self.blocks.release_all(seq.block_table)

    def _drop_pending(self, seq: Sequence) -> None:
        for key in [k for k, s in self.pending.items() if s is seq]:
            del self.pending[key]

    # -- the step ----------------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Pick this step's tokens (see the module docstring); allocates their blocks."""
        plan = StepPlan()
        budget = self.max_batch_tokens
        copies_before = self.blocks.copies
        if self.speculator is not None:  # a draft model drops finished requests' state and drafts for the others
            self.speculator.begin_step(self.running)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted by an older request's decode this step
                continue
            n = self._reserve_proposal(seq, budget, plan) if self.speculator is not None else 0
            n = n or self._reserve(seq, min(seq.remaining, budget), plan, preempt=True)
            if n:
                plan.chunks.append((seq, n))
                budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self._admissible()
            if seq is None:
                break
            self.waiting.remove(seq)
            self._admit(seq, plan)
            self.running.append(seq)
            n = self._reserve(seq, min(seq.remaining, budget), plan, preempt=False)
            if n:
                plan.chunks.append((seq, n))
                budget -= n
        plan.copies = self.blocks.copies - copies_before
        # Prefill: positions below the tokens known at admission (prompt, or prompt + generated after a preemption).
        plan.prefill_tokens = sum(
            max(0, min(s.num_computed + n, s.cacheable_len) - s.num_computed) for s, n in plan.chunks
        )
        return plan

    def _admissible(self) -> Sequence | None:
        """The first waiting request that may start now, or None (FIFO: a request that lacks blocks stops the line;
        one waiting for another's prefill of its prefix lets the next one pass)."""
        for seq in self.waiting:
            keys = self._keys(seq)
            shared = self.blocks.lookup(keys)
            if len(shared) < len(keys) and keys[len(shared)] in self.pending:
                continue  # another running request is computing this block: wait for it, then share it
            need = self.blocks.blocks_for(len(seq.tokens)) - len(shared)
            if need + 1 > self.blocks.num_available and self.running:  # +1: a copy-on-write or the first new token
                return None
            return seq
        return None

    def _keys(self, seq: Sequence) -> list[bytes]:
        """Block keys of all of ``seq``'s tokens, computed once per token count (a waiting request is looked at
        every step)."""
        if not self.prefix_sharing or seq.params.prompt_logprobs is not None:
            seq.cacheable_len = len(seq.tokens)
            return []
        if seq.cacheable_len != len(seq.tokens) or not seq.block_keys:
            root = b"" if seq.lora is None else seq.lora.key  # another adapter's KV differs for the same tokens
            seq.block_keys = prefix_keys(seq.tokens, self.blocks.block_size, root)
            seq.cacheable_len = len(seq.tokens)
        return seq.block_keys

    def _admit(self, seq: Sequence, plan: StepPlan) -> None:
        """Take the request's shared prefix blocks and record the blocks it will compute as pending."""
        bs = self.blocks.block_size
        seq.block_keys = self._keys(seq)
        shared = self.blocks.lookup(seq.block_keys)
        for block in shared:
            self.blocks.share(block)
        seq.block_table = list(shared)
        seq.registered = len(shared)
        hit = min(len(shared) * bs, len(seq.tokens))
        seq.num_computed = min(hit, len(seq.tokens) - 1)  # the last token always runs: its logits are needed
        for key in seq.block_keys[len(shared) :]:
            self.pending.setdefault(key, seq)
        seq.admissions += 1
        if seq.admissions == 1:  # a preempted request's readmission does not ask for its prompt again
            seq.handle.scheduled_time = time.perf_counter()
            plan.prompt_tokens += len(seq.prompt)
            plan.prefix_hit_tokens += seq.num_computed

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan, preempt: bool) -> int:
        """Make the blocks for ``seq``'s next ``n`` tokens writable; returns how many tokens got room (0: none).

        ``preempt``: a decode that finds no block preempts the newest running request (possibly ``seq`` itself).
        """
        bs = self.blocks.block_size
        start = seq.num_computed
        end = start + n
        first = start // bs
        try_again = True
        while try_again:
            try_again = False
            try:
                if first < len(seq.block_table):  # the block holding `start` may be shared: copy-on-write
                    seq.block_table[first] = self.blocks.writable(seq.block_table[first])
                while len(seq.block_table) * bs < end:
                    seq.block_table.append(self.blocks.allocate())
            except OutOfBlocks:
                have = len(seq.block_table) * bs
                if have > start and self._is_private(seq, first):
                    return min(n, have - start)  # a shorter prefill chunk fits in the blocks it has
                if preempt and self.running:
                    victim = self.running[-1]
                    self._preempt(victim, plan)
                    if victim is seq:
                        return 0
                    try_again = True
                else:
                    return 0
        return n

    def _reserve_proposal(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Room for a decoding ``seq``'s last token and its speculative proposal (recorded in ``plan.drafts``);
        0: no proposal, or its blocks are not free with one left per running request (speculation never preempts
        nor evicts cached prefix blocks)."""
        draft = self.speculator.proposal(seq, budget, self.max_positions)
        if not draft:
            return 0
        extra = self.blocks.blocks_for(seq.num_computed + 1 + len(draft)) - len(seq.block_table) + 1  # +1: a copy
        if extra + len(self.running) > len(self.blocks.free):
            return 0
        n = self._reserve(seq, 1 + len(draft), plan, preempt=False)
        if n > 1:
            plan.drafts[id(seq)] = draft[: n - 1]
        return n

    def _is_private(self, seq: Sequence, index: int) -> bool:
        block = seq.block_table[index]
        return self.blocks.refs[block] == 1 and block not in self.blocks.key_of

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free ``seq``'s blocks and put it back at the head of the queue; it recomputes when readmitted."""
        self.running.remove(seq)
        self._drop_pending(seq)
        self.blocks.release_all(seq.block_table)
        seq.num_computed = 0
        seq.registered = 0
        plan.chunks = [(s, n) for s, n in plan.chunks if s is not seq]
        plan.drafts.pop(id(seq), None)
        self.waiting.appendleft(seq)
        plan.preemptions += 1

    def update(self, plan: StepPlan, sampled: dict[int, int]) -> list[Sequence]:
        """After the model ran ``plan``: advance each request, append sampled tokens (``sampled[id(seq)]``), register
        newly computed prompt blocks, retire finished requests; returns the finished ones."""
        finished = []
        bs = self.blocks.block_size
        for seq, n in plan.chunks:
            draft, kept = plan.drafts.get(id(seq), []), plan.accepted.get(id(seq), 0)
            seq.num_computed += n - len(draft) + kept  # a rejected proposal's KV lies beyond: overwritten later
            # Register the blocks whose tokens are now all computed (a partial last one once the prompt is done).
            while seq.registered < len(seq.block_keys):
                i = seq.registered
                end = min((i + 1) * bs, seq.cacheable_len)
                if seq.num_computed < end:
                    break
                self.blocks.register(seq.block_table[i], seq.block_keys[i])
                self.pending.pop(seq.block_keys[i], None)
                seq.registered += 1
            token = sampled.get(id(seq))
            if token is None:
                continue
            plan.sampled += 1
            sampler = seq.sampler
            if sampler is not None and sampler.error is not None:
                self._retire(seq)
                seq.handle._finish("error", sampler.error)
                finished.append(seq)
                continue
            if sampler is not None and seq.params.prompt_logprobs is not None and seq.handle.prompt_logprobs is None:
                seq.handle.prompt_logprobs = [None, *sampler.prompt_entries]
            logprobs = None
            if sampler is not None and sampler.pending_logprobs is not None:
                logprobs, sampler.pending_logprobs = [sampler.pending_logprobs], None
            new, reason = [], None
            for tok in [*draft[:kept], token]:  # accepted proposals (speculation), then the sampled token
                seq.tokens.append(tok)
                seq.generated += 1
                new.append(tok)
                reason = self._finish_reason(seq, tok)
                if reason is not None:
                    break
            plan.sampled += len(new) - 1
            seq.handle._push(new, logprobs)
            if reason is not None:
                self._retire(seq)
                seq.handle._finish(reason)
                finished.append(seq)
        return finished

    @staticmethod
    def _finish_reason(seq: Sequence, token: int) -> str | None:
        """Why ``seq`` finishes after appending ``token`` (see the module docstring), or None."""
        params = seq.params
        if seq.generated >= params.min_tokens:
            if token in params.stop_token_ids:
                seq.handle.stop_reason = token
                return "stop"
            if token in params.eos_token_ids and not params.ignore_eos:
                return "stop"
        if seq.sampler is not None and seq.sampler.stopped:
            return "stop"
        if seq.generated >= params.max_new_tokens:
            return "length"
        return None
