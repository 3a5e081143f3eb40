"""``ServingEngine``: continuous batching on a model's fused layers, for servers and ``generate_batch``.

Thread model: any thread may call :meth:`ServingEngine.submit` (and :meth:`RequestHandle.cancel`); one thread steps
the scheduler, either the engine's own background thread (:meth:`ServingEngine.start` / :meth:`~ServingEngine.stop`)
or the caller of :meth:`ServingEngine.step` / :meth:`ServingEngine.run_until_idle` (synchronous use, e.g.
``generate_batch``). New requests join between steps; finished ones leave between steps.

Example (what ``hf-dsinfer serve`` does)::

    engine = ServingEngine(model, block_size=16, max_batch_tokens=256)
    engine.start()
    handle = engine.submit(tok("Hello").input_ids, GenerationConfig(max_new_tokens=32, do_sample=False))
    for token_id in handle:          # new token ids as they are sampled; the loop ends when the request finishes
        print(tok.decode([token_id]), end="")
    print(handle.finish_reason)      # "stop" (an EOS token) or "length" (max_new_tokens)
    sampled = GenerationConfig(max_new_tokens=32, do_sample=True, temperature=0.8)
    seeded = engine.submit(tok("Hello").input_ids, sampled, seed=7, logprobs=5)  # SamplingParams fields on top
    seeded.result(timeout=60)
    print(seeded.logprobs[0].top)    # the 5 most likely (id, log-prob) at the first generated token
    engine.stop()
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..log import logger
from .handle import RequestHandle
from .lora import LoRAAdapter, LoRARegistry
from .omp import release_idle_openmp_workers
from .requests import SamplingParams, Sequence
from .runner import PagedRunner, tp_group_of
from .scheduler import Scheduler
from .speculation import SpeculativeConfig, count_speculation, make_speculator


@dataclass
class ServingStats:
    """Counters of one engine since it was built (:attr:`ServingEngine.stats` returns a snapshot copy).

    ``prompt_tokens``: prompt tokens the admitted requests asked for; ``prefill_tokens_computed``: the ones the model
    actually ran (fewer with prefix sharing; a preempted request's recomputation counts again);
    ``prefix_hit_tokens``: prompt tokens served from shared KV blocks. ``busy_s``: wall time spent in steps.
    """

    requests_submitted: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefix_hit_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    copy_on_write_blocks: int = 0
    busy_s: float = 0.0
    #: speculative decoding (vLLM's metric names; None when the engine does not speculate): requests x steps that
    #: ran a proposal, tokens proposed, proposed tokens accepted (the target's own next token not counted)
    spec_decode_num_drafts: int | None = None
    spec_decode_num_draft_tokens: int | None = None
    spec_decode_num_accepted_tokens: int | None = None

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of stepping (0.0 before the first step)."""
        return self.generated_tokens / self.busy_s if self.busy_s > 0 else 0.0

    @property
    def prefill_saving(self) -> float:
        """Fraction of requested prompt tokens not computed thanks to prefix sharing (0.0 with no requests)."""
        return 1.0 - self.prefill_tokens_computed / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "prefill_saving": self.prefill_saving}


def _check_tp(tp: Any) -> None:
    """Refuse what the tensor-parallel engine does not do: running on a rank other than 0."""
    if tp.rank != 0:
        raise ValueError(f"ServingEngine on rank {tp.rank} of a tensor-parallel model: rank 0 runs the engine; call "
                         "hf_dsinfer.serving.tp_worker.run_worker(model) on the other ranks")  # fmt: skip


class ServingEngine:
    """Continuous batching over a paged KV cache on ``model``'s fused layers (a model loaded with an inference
    config, injected). See docs/serving.md.

    Args:
        model: the injected ``*ForCausalLM``.
        block_size: tokens per KV block.
        num_blocks: blocks in the paged cache (shared by all layers' pools); None: room for ``max_num_seqs``
            requests of ``max_out_tokens`` tokens, within half the free GPU memory (a quarter of the RAM on CPU),
            and at least the static cache's ``max_out_tokens * max_batch_size`` tokens.
        max_batch_tokens: token budget of one step (decode tokens plus prefill chunks: longer prompts are prefilled
            in chunks of at most this many tokens).
        max_num_seqs: requests running at once (the rest wait).
        prefix_sharing: reuse the KV blocks of identical prompt prefixes (reference-counted, copy-on-write).
        generation_config: defaults for requests submitted without one (default: the model's).
        enable_lora: serve LoRA adapters per request (vLLM's ``--enable-lora``): :meth:`load_lora_adapter`, then
            ``submit(..., adapter=name)``; requests of different adapters and the base share each step.
        max_loras / max_lora_rank: adapter slots held at once, and the largest rank an adapter may have.
        speculative_config: vLLM's ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": m,
            "prompt_lookup_min": n}`` or ``{"model": DRAFT_PATH, "num_speculative_tokens": k}`` (dict or JSON):
            greedy and sampled requests verify n-gram or draft-model proposals (:mod:`.speculation`).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch_tokens: int = 256,
        max_num_seqs: int = 64,
        prefix_sharing: bool = True,
        generation_config: Any = None,
        enable_lora: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        speculative_config: Any = None,
    ):
        for name, value in (("block_size", block_size), ("max_batch_tokens", max_batch_tokens),
                            ("max_num_seqs", max_num_seqs)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ServingEngine({name}={value!r}): pass a positive integer")
        self.model = model
        tp = tp_group_of(model)
        if tp.size > 1:
            _check_tp(tp)
        self.runner = PagedRunner(model, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs)
        if tp.size > 1:  # rank 0 of a tensor-parallel model: each step goes to the other ranks first (.tp_worker)
            from .tp_worker import channel_for

            self.runner.channel = channel_for(model)
        self.scheduler = Scheduler(
            self.runner.blocks, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
            prefix_sharing=prefix_sharing, max_positions=self.runner.max_positions,
        )  # fmt: skip
        self.speculation = SpeculativeConfig.parse(speculative_config)  # None: no speculation
        self.scheduler.speculator = make_speculator(self.speculation, self.runner)  # None: no speculation
        self.generation_config = generation_config if generation_config is not None else model.generation_config
        self.options: dict[str, Any] = {}  # what a cache of engines keys this one by (generate_batch's)
        self._stats = ServingStats()
        self._lock = threading.Lock()  # guards _incoming, _cancelled, _stats
        self._wake = threading.Condition(self._lock)
        self._incoming: list[Sequence] = []
        self._cancelled: list[str] = []
        self._step_lock = threading.Lock()  # one stepping thread at a time
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ids = itertools.count()
        self._fatal: BaseException | None = None
        #: called as ``fn(handle)`` on the stepping thread when a request finishes (any reason); e.g. metrics.
        #: Keep them short; one that raises is logged and skipped.
        self.finish_listeners: list[Callable[[RequestHandle], None]] = []
        #: record every request's token times (``RequestHandle.timestamps``), as ``submit(record_timestamps=True)``.
        self.record_timestamps = False
        #: the LoRA adapters (None unless ``enable_lora``); a finished request stops holding its adapter.
        self.lora = LoRARegistry(model, max_loras, max_lora_rank) if enable_lora else None
        self.runner.lora = self.lora
        if self.lora is not None and self.runner.channel is not None:  # the workers build their slots too
            self.runner.channel.send_lora(("enable", max_loras, max_lora_rank))
        if self.lora is not None:
            self.finish_listeners.append(lambda handle: self.lora.release(getattr(handle, "adapter", None)))

    # -- requests ----------------------------------------------------------------------------------------------------

    def submit(
        self,
        input_ids: list[int],
        generation_config: Any = None,
        *,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        on_update: Callable[[RequestHandle, list[int], bool], None] | None = None,
        record_timestamps: bool = False,
        tokenizer: Any = None,
        adapter: str | None = None,
        **overrides: Any,
    ) -> RequestHandle:
        """Queue one request; returns its handle at once (the request joins at the next step).

        The request's settings: ``sampling_params`` as given (what the HTTP layer builds), or else
        ``SamplingParams.from_generation_config(generation_config or the engine's, prompt length, max_new_tokens,
        tokenizer=tokenizer)`` (greedy or sampling with temperature / top_k / top_p / min_p, repetition_penalty,
        min_new_tokens, eos_token_id, stop_strings with ``tokenizer``, and generate's other logits processors).
        ``overrides``: :class:`~.requests.SamplingParams` fields set on top of either (``seed=``, ``logprobs=``,
        ``stop_token_ids=``, ...). One submit is one sequence (``num_return_sequences`` is the caller's: submit the
        prompt again). ``on_update(handle, new_tokens, finished)`` is called from the stepping thread after each
        step that changes the request (keep it short; e.g. ``loop.call_soon_threadsafe`` for asyncio). Invalid
        settings or a request that can never fit raise ``ValueError`` here. ``adapter``: the name of a loaded LoRA
        adapter (engine built with ``enable_lora=True``) the request runs with; None: the base model.
        """
        prompt = [int(t) for t in input_ids]
        if sampling_params is not None:
            if generation_config is not None or max_new_tokens is not None:
                raise ValueError("submit: pass either sampling_params or generation_config / max_new_tokens, not both")
            params = sampling_params.with_overrides(overrides)
        else:
            config = generation_config if generation_config is not None else self.generation_config
            params = SamplingParams.from_generation_config(
                config, len(prompt), max_new_tokens, tokenizer=tokenizer, **overrides
            )
        self.runner.check_request(prompt, params)
        self.scheduler.check_fits(len(prompt) + params.max_new_tokens)
        if self._fatal is not None:
            raise RuntimeError(f"the serving engine stopped after an error: {self._fatal!r}")
        lora = self._lora_for(adapter)
        rid = request_id if request_id is not None else f"req_{next(self._ids)}"
        handle = RequestHandle(rid, prompt, on_update, params)
        handle.record_timestamps = record_timestamps or self.record_timestamps
        handle._cancel = self._request_cancel
        handle._listeners = self.finish_listeners
        handle.adapter = adapter  # the registry's finish listener releases it
        seq = Sequence(rid, prompt, params, handle, lora=lora)
        with self._wake:
            self._incoming.append(seq)
            self._stats.requests_submitted += 1
            self._wake.notify()
        return handle

    def _lora_for(self, adapter: str | None) -> LoRAAdapter | None:
        """The loaded adapter a request asks for (counted in use), or None for the base model."""
        if adapter is None:
            return None
        if self.lora is None:
            raise ValueError(f"adapter={adapter!r}: LoRA adapters are not enabled; build the engine with "
                             "enable_lora=True (hf-dsinfer serve --enable-lora)")  # fmt: skip
        return self.lora.acquire(adapter)

    def load_lora_adapter(self, name: str, path: str) -> LoRAAdapter:
        """Load the peft adapter folder ``path`` as ``name`` between two steps (see :class:`~.lora.LoRARegistry`)."""
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled; build the engine with enable_lora=True")
        with self.paused():
            adapter = self.lora.load(name, path)
            if self.runner.channel is not None:  # every worker loads its shard into the same slot
                self.runner.channel.send_lora(("load", name, os.path.abspath(adapter.path), adapter.slot))
            return adapter

    def unload_lora_adapter(self, name: str) -> None:
        """Unload adapter ``name`` (refused while unfinished requests use it)."""
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled; build the engine with enable_lora=True")
        with self.paused():
            self.lora.unload(name)
            if self.runner.channel is not None:
                self.runner.channel.send_lora(("unload", name))

    def _request_cancel(self, handle: RequestHandle) -> None:
        with self._wake:
            self._cancelled.append(handle.request_id)
            self._wake.notify()

    # -- stepping ----------------------------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._incoming or self._cancelled) or self.scheduler.has_work

    @torch.no_grad()
    def step(self) -> bool:
        """Run one scheduling step (admit, prefill chunks and decode tokens, sample, retire); False when idle."""
        with self._step_lock:
            with self._lock:
                incoming, self._incoming = self._incoming, []
                cancelled, self._cancelled = self._cancelled, []
            for seq in incoming:
                self.scheduler.add(seq)
            for rid in cancelled:
                self.scheduler.cancel(rid)
            t0 = time.perf_counter()
            plan = self.scheduler.schedule()
            if plan.empty:
                self._collect(plan.finished, 0.0)
                return self.scheduler.has_work
            sampled = self.runner.run(plan)
            finished = self.scheduler.update(plan, sampled)
            self._collect(plan.finished + finished, time.perf_counter() - t0, plan)
            return True

    def _collect(self, finished: list[Sequence], elapsed: float, plan: Any = None) -> None:
        with self._lock:
            s = self._stats
            s.requests_finished += len(finished)
            if plan is not None:
                s.steps += 1
                s.busy_s += elapsed
                s.prompt_tokens += plan.prompt_tokens
                s.prefix_hit_tokens += plan.prefix_hit_tokens
                s.prefill_tokens_computed += plan.prefill_tokens
                s.generated_tokens += plan.sampled
                s.preemptions += plan.preemptions
                s.copy_on_write_blocks += plan.copies
            if self.speculation is not None:
                count_speculation(s, plan)

    def run_until_idle(self) -> None:
        """Step until every submitted request has finished (synchronous use; not while :meth:`start` runs).

        If a step raises, every unfinished request ends with "error" (its blocks freed) and the error propagates.
        """
        if self.is_running:
            raise RuntimeError("run_until_idle() steps the engine itself: call it without start(), or wait on handles")
        try:
            while self.step():
                pass
        except BaseException as e:
            self._fail_everything(repr(e))
            raise

    def _fail_everything(self, error: str) -> None:
        with self._lock:
            incoming, self._incoming, self._cancelled = self._incoming, [], []
        for seq in incoming:
            seq.handle._finish("error", error)
        self.scheduler.fail_all(error)

    # -- the background thread -------------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> ServingEngine:
        """Start the background stepping thread (idempotent); returns the engine."""
        if self.is_running:
            if not self._stopping:
                return self
            self._thread.join()  # a stop() that did not wait for its thread: let that thread end first
        self._stopping = False
        # From now on the stepping thread runs the model; this thread's idle OpenMP team would make GNU OpenMP
        # stop spin-waiting in the stepping thread's team (more workers than CPUs): see .omp.
        release_idle_openmp_workers(self.model.get_output_embeddings().weight.device)
        self._thread = threading.Thread(target=self._loop, name="hf_dsinfer-serving", daemon=True)
        self._thread.start()
        return self

    def stop(self, cancel_pending: bool = True, timeout: float | None = None) -> None:
        """Stop the background thread. ``cancel_pending``: end the unfinished requests with "cancelled" (else they
        stay queued and resume on the next :meth:`start` or :meth:`step`)."""
        thread = self._thread
        if thread is not None:
            with self._wake:
                self._stopping = True
                self._wake.notify()
            thread.join(timeout)
            if not thread.is_alive():
                self._thread = None
        if cancel_pending:
            with self._step_lock:
                with self._lock:
                    incoming, self._incoming, self._cancelled = self._incoming, [], []
                for seq in incoming:
                    seq.handle._finish("cancelled")
                self.scheduler.cancel_all()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the background thread to end (after :meth:`stop` from another thread)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine between two steps (e.g. to update the weights in place); requests resume on exit."""
        with self._step_lock:
            yield

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopping and not (self._incoming or self._cancelled or self.scheduler.has_work):
                        if self._fatal is not None:  # fail() while idle (a tensor-parallel worker died)
                            raise self._fatal
                        if self.runner.channel is not None and self.runner.channel.keepalive_due:
                            break
                        self._wake.wait(timeout=0.5)
                    if self._stopping:
                        return
                if self._fatal is not None:
                    raise self._fatal
                if self.runner.channel is not None and self.runner.channel.keepalive_due:
                    with self._step_lock:  # idle tensor-parallel workers: keep their wait short of the timeout
                        self.runner.channel.keepalive()
                self.step()
        except BaseException as e:  # noqa: BLE001 - fail every request with the error rather than hang their readers
            self._fatal = e
            logger.error("hf_dsinfer serving: the stepping thread failed: %r; failing all requests", e)
            self._fail_everything(repr(e))

    def clear_prefix_cache(self) -> None:
        """Forget the KV blocks kept for prefix sharing by finished requests (call it after changing the weights:
        their KV was computed with the old ones). Blocks of running requests are unaffected."""
        with self._step_lock:
            self.scheduler.blocks.forget_cached()

    def fail(self, error: BaseException) -> None:
        """Mark the engine failed from another thread (e.g. a tensor-parallel worker process died): ``/health`` turns
        503, new requests are refused and the stepping thread fails every request at its next turn."""
        with self._wake:
            if self._fatal is None:
                self._fatal = error
            self._wake.notify()

    def stop_workers(self, result: Any = None) -> None:
        """Tensor parallelism, rank 0: end the other ranks' :func:`~.tp_worker.run_worker` (it returns ``result``).
        Call it after :meth:`stop` (no step may run meanwhile); a later step sets the workers up again."""
        if self.runner.channel is None:
            return
        with self._step_lock:
            self.runner.channel.send_stop(result)

    @property
    def fatal_error(self) -> BaseException | None:
        """The error that stopped the background thread (then every request failed), or None."""
        return self._fatal

    # -- stats -------------------------------------------------------------------------------------------------------

    @property
    def stats(self) -> ServingStats:
        """A snapshot of the engine's counters (:class:`ServingStats`)."""
        with self._lock:
            return ServingStats(**asdict(self._stats))

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = ServingStats()
