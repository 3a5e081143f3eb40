"""transformers' continuous-batching API on injected models, run by :class:`~hf_dsinfer.serving.ServingEngine`.

``model.generate_batch(inputs, generation_config=...)`` and ``model.init_continuous_batching()`` keep transformers'
signatures, request ids (``req_<i>``, children ``req_<i>__child#<j>`` for ``num_return_sequences``), output type
(``GenerationOutput``) and order; only the engine underneath is ours: the fused layers over a paged KV cache.
transformers' own manager would call the fused forward with its paged cache, which the fused layers cannot read.

``ContinuousBatchingConfig`` fields that mean something here: ``num_blocks``, ``max_batch_tokens``,
``max_requests_per_batch`` (requests running at once), ``allow_block_sharing`` (prefix sharing) and ``page_size``
(block size, when set to something else than transformers' default of 256 tokens, which is tuned for its GPU kernels;
the default here is 16). The others (CUDA graphs, compile levels, offloading) are ignored.

Generation settings are honoured per request as ``generate`` honours them (min_new_tokens, no_repeat_ngram_size,
bad_words_ids, stop_strings with ``tokenizer=`` as ``generate(tokenizer=...)``, ...: see
:meth:`~.requests.SamplingParams.from_generation_config`); beam search and contrastive search are refused by name.

Models the paged engine cannot serve exactly (:func:`~.runner.unsupported_reason`) get the padded fallback
(:mod:`.padded`) for ``generate_batch``, with one warning. A tensor-parallel model runs the paged engine on every rank
(:func:`~.tp_worker.tp_generate_batch`: every rank calls ``generate_batch``, rank 0 schedules and samples).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from types import MethodType
from typing import Any

import torch
from torch import nn

from ..log import logger, warn_once
from ..policies.injection import get_injection
from .engine import ServingEngine, ServingStats
from .handle import RequestHandle
from .padded import padded_generate_batch
from .requests import SamplingParams
from .runner import tp_group_of, unsupported_reason

ENGINE_ATTR = "_dsinfer_batch_engine"  # the engine generate_batch keeps on the model between calls
STATS_ATTR = "_dsinfer_batch_stats"
MAX_GROWTH = 8  # generate_batch's cache grows to at most this many times the static cache's memory
_DEFAULT_PAGE_SIZE = 256  # transformers' ContinuousBatchingConfig default (ignored: see the module docstring)


def install_generate_batch(model: nn.Module, runtime: Any) -> None:
    """Bind ``generate_batch``, ``init_continuous_batching`` and ``continuous_batching_context_manager`` on ``model``
    (this instance) when it has fused layers (``runtime`` not None); models on HF's modules keep transformers' own."""
    if runtime is None:
        return
    model.generate_batch = MethodType(generate_batch, model)
    model.init_continuous_batching = MethodType(init_continuous_batching, model)
    model.continuous_batching_context_manager = MethodType(continuous_batching_context_manager, model)


def last_batch_stats(model: nn.Module) -> ServingStats | None:
    """The :class:`ServingStats` of ``model``'s last ``generate_batch`` call (None before the first)."""
    return getattr(model, STATS_ATTR, None)


def engine_options(cb_config: Any) -> dict[str, Any]:
    """:class:`ServingEngine` keyword arguments from a transformers ``ContinuousBatchingConfig`` (or None)."""
    if cb_config is None:
        return {}
    out: dict[str, Any] = {}
    page = getattr(cb_config, "page_size", None)
    if page is not None and page != _DEFAULT_PAGE_SIZE:
        out["block_size"] = int(page)
    for ours, theirs in (("num_blocks", "num_blocks"), ("max_batch_tokens", "max_batch_tokens"),
                         ("max_num_seqs", "max_requests_per_batch")):  # fmt: skip
        value = getattr(cb_config, theirs, None)
        if value is not None:
            out[ours] = int(value)
    if getattr(cb_config, "allow_block_sharing", True) is False:
        out["prefix_sharing"] = False
    return out


def lookup_config(config: Any, assistant_model: Any = None) -> dict | None:
    """The engine's speculation for ``generate_batch``: the draft ``assistant_model`` (``num_assistant_tokens``
    proposals a step, as ``generate``), else n-grams for a ``generation_config`` with ``prompt_lookup_num_tokens`` (as
    ``generate``'s prompt lookup: n-grams of ``max_matching_ngram_size``, default 2, down to 1), else None. Greedy and
    sampled requests alike (:mod:`.speculation`)."""
    if assistant_model is not None:
        k = int(getattr(config, "num_assistant_tokens", None) or 5)
        return {"method": "draft_model", "model": assistant_model, "num_speculative_tokens": k}
    k = getattr(config, "prompt_lookup_num_tokens", None)
    if not k:
        return None
    longest = int(getattr(config, "max_matching_ngram_size", None) or 2)
    return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": longest, "prompt_lookup_min": 1}


def _output(handle: RequestHandle, status: Any = None) -> Any:
    """transformers' ``GenerationOutput`` of ``handle`` (finished unless ``status`` is given)."""
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

    if status is None:
        status = RequestStatus.FAILED if handle.finish_reason == "error" else RequestStatus.FINISHED
    return GenerationOutput(
        request_id=handle.request_id,
        prompt_ids=list(handle.prompt_ids),
        generated_tokens=list(handle.tokens),
        error=handle.error,
        status=status,
        created_time=handle.created_time,
        lifespan=(handle.first_token_time or -1, handle.finished_time or -1),
        timestamps=list(handle.timestamps) if handle.record_timestamps else None,
    )


def _failed(request_id: str, prompt: list[int], error: Exception) -> Any:
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

    return GenerationOutput(
        request_id=request_id, prompt_ids=list(prompt), error=str(error), status=RequestStatus.FAILED
    )


def batch_engine(
    model: nn.Module, cb_config: Any = None, want_tokens: int = 0, speculative_config: dict | None = None
) -> ServingEngine:
    """The engine ``generate_batch`` uses on ``model``, kept between calls while the settings stay the same.

    ``want_tokens``: KV slots the call's requests need all together. Unless ``cb_config`` sets ``num_blocks``, the
    cache grows from the engine's default (the static cache's memory) up to :data:`MAX_GROWTH` times it to hold
    them, so a batch of many requests (GRPO's rollouts) runs without preemptions; it never shrinks.
    """
    options = engine_options(cb_config)
    if speculative_config is not None:
        options["speculative_config"] = speculative_config
    if "num_blocks" not in options and want_tokens:
        static = get_injection(model).runtime.cache
        block = options.get("block_size", 16)
        default = -(-int(static.max_tokens) * max(1, int(static.max_batch_size)) // block)
        options["num_blocks"] = max(default, min(-(-want_tokens // block), MAX_GROWTH * default))
    engine = getattr(model, ENGINE_ATTR, None)
    if engine is not None:
        same = {k: v for k, v in engine.options.items() if k != "num_blocks"} == {
            k: v for k, v in options.items() if k != "num_blocks"
        }
        if same and engine.runner.blocks.num_blocks >= options.get("num_blocks", 0):
            return engine
    engine = ServingEngine(model, **options)
    engine.options = options
    object.__setattr__(model, ENGINE_ATTR, engine)  # a plain attribute, not a submodule
    return engine


def run_generate_batch(
    model: nn.Module,
    inputs: list[list[int]],
    generation_config: Any = None,
    continuous_batching_config: Any = None,
    record_timestamps: bool = False,
    max_new_tokens: int | None = None,
    tokenizer: Any = None,
    assistant_model: Any = None,
) -> dict[str, Any]:
    """The body of ``generate_batch`` on the paged engine (synchronous: this thread steps the engine)."""
    config = generation_config if generation_config is not None else model.generation_config
    copies = int(getattr(config, "num_return_sequences", None) or 1)
    want = copies * sum(len(p) + (max_new_tokens or config.max_new_tokens or 0) for p in inputs)
    engine = batch_engine(model, continuous_batching_config, want, lookup_config(config, assistant_model))
    # The weights may have changed since the last call (a Hybrid Engine refresh, a training step): KV blocks
    # cached by earlier calls are stale. Sharing within this call stays on.
    engine.clear_prefix_cache()
    engine.reset_stats()
    handles: dict[str, RequestHandle | Any] = {}
    order: list[str] = []
    for i, prompt in enumerate(inputs):
        parent = f"req_{i}"
        names = [f"{parent}__child#{j}" for j in range(copies - 1)] + [parent]
        order += names
        # The parent first: the children wait for its prompt blocks and share them (prefilled once).
        for name in [parent, *names[:-1]]:
            try:
                handles[name] = engine.submit(
                    prompt, config, request_id=name, max_new_tokens=max_new_tokens,
                    record_timestamps=record_timestamps, tokenizer=tokenizer,
                )  # fmt: skip
            except ValueError as e:
                handles[name] = _failed(name, prompt, e)
    engine.run_until_idle()
    results = {
        name: (_output(h) if isinstance(h, RequestHandle) else h) for name, h in ((n, handles[n]) for n in order)
    }
    failed = [name for name, out in results.items() if out.error is not None]
    if failed:
        first = results[failed[0]].error
        logger.error("hf_dsinfer generate_batch: requests %s failed (first error: %s)", failed, first)
    object.__setattr__(model, STATS_ATTR, engine.stats)
    return results


@torch.no_grad()
def generate_batch(
    self: nn.Module,
    inputs: list[list[int]],
    generation_config: Any = None,
    continuous_batching_config: Any = None,
    record_timestamps: bool = False,
    progress_bar: bool = False,
    persistent_manager: bool = False,
    warmup: bool = True,
    **kwargs: Any,
) -> dict[str, Any]:
    """transformers' ``generate_batch`` on the fused layers (continuous batching over a paged KV cache).

    Same arguments and result as transformers': ``{request_id: GenerationOutput}`` in input order, children of
    ``num_return_sequences`` before their parent. ``progress_bar``, ``persistent_manager`` and ``warmup`` have no
    effect here (no CUDA graphs to warm up; the engine is kept on the model between calls anyway). ``tokenizer=``:
    as ``generate(tokenizer=...)``, needed for ``stop_strings``. ``assistant_model=``: a draft model (sharing the
    model's tokenizer) whose proposals each step verifies, as ``generate(assistant_model=...)``; the engine's
    speculation keeps greedy tokens and the sampling distribution exactly (:mod:`.speculation`).

    Tensor-parallel model: call it on every rank, as ``generate``; rank 0 schedules and samples with its settings,
    every rank runs its shard, and every rank gets the results of the prompts it passed
    (:func:`~.tp_worker.tp_generate_batch`).
    """
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    tokenizer = kwargs.pop("tokenizer", None)
    assistant_model = kwargs.pop("assistant_model", None)  # padded fallback: not used (the same distribution)
    if kwargs:
        logger.warning("hf_dsinfer generate_batch: ignoring unknown arguments %s", sorted(kwargs))
    reason = unsupported_reason(self)
    if reason is None and tp_group_of(self).size > 1:  # every rank calls it; rank 0 schedules (.tp_worker)
        from .tp_worker import tp_generate_batch

        def run(prompts: list[list[int]]) -> dict[str, Any]:
            return run_generate_batch(self, prompts, generation_config, continuous_batching_config, record_timestamps,
                                      max_new_tokens, tokenizer, assistant_model)  # fmt: skip

        return tp_generate_batch(self, inputs, run)
    if not inputs:
        return {}
    if reason is not None:
        warn_once(f"hf_dsinfer: generate_batch runs padded static batches through generate (not continuous "
                  f"batching): {reason}.")
        config = generation_config if generation_config is not None else self.generation_config
        copies = int(getattr(config, "num_return_sequences", None) or 1)
        from ..generation.api import GEN_ATTR  # here: generation.api installs this module's functions

        state = getattr(self, GEN_ATTR, None)
        rows = max(1, int(getattr(state.cfg, "max_batch_size", 8) if state is not None else 8) // copies)
        device = self.get_output_embeddings().weight.device
        return padded_generate_batch(self.generate, inputs, config, rows=rows, device=device,
                                     max_new_tokens=max_new_tokens, tokenizer=tokenizer)  # fmt: skip
    return run_generate_batch(self, inputs, generation_config, continuous_batching_config, record_timestamps,
                              max_new_tokens, tokenizer, assistant_model)  # fmt: skip


class _ThreadStatus:
    """The part of transformers' ``BackgroundThreadStatus`` its serving code reads: ``fatal_error``."""

    def __init__(self, engine: ServingEngine):
        self._engine = engine

    @property
    def fatal_error(self) -> BaseException | None:
        return self._engine.fatal_error


class FusedContinuousBatchingManager:
    """transformers' ``ContinuousBatchingManager`` API (start / add_request / get_result / stop ...) on a
    :class:`ServingEngine` with its background thread. Made by ``model.init_continuous_batching()``."""

    def __init__(self, model: nn.Module, generation_config: Any, engine: ServingEngine):
        self.model = model
        self.generation_config = generation_config
        self.engine = engine
        self.num_return_sequences = int(getattr(generation_config, "num_return_sequences", None) or 1)
        self.output_queue: queue.Queue = queue.Queue()
        self._counter = 0
        self.warmed_up = False
        self._handles: dict[str, RequestHandle] = {}
        self._result_handlers: dict[str, tuple[Callable[[Any], None], asyncio.AbstractEventLoop]] = {}
        self._lock = threading.Lock()
        # transformers' serving code reads ``background_thread_status.fatal_error`` to tell a dead worker apart
        self.background_thread_status = _ThreadStatus(engine)

    # -- control -------------------------------------------------------------------------------------------------

    def is_running(self) -> bool:
        return self.engine.is_running

    def warmup(self) -> None:
        """Nothing to capture ahead (kept for transformers' API)."""
        self.warmed_up = True

    def start(self) -> None:
        self.engine.start()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:  # fmt: skip
        """Stop the stepping thread; without ``hard_stop`` the queued requests finish first (transformers' default)."""
        if not hard_stop and block:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.engine.has_work and self.engine.is_running:
                if deadline is not None and time.monotonic() > deadline:
                    break
                time.sleep(0.005)
        self.engine.stop(cancel_pending=hard_stop or not keep_for_next_session, timeout=timeout if block else 0)

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        self.engine.join(timeout)

    def destroy(self) -> None:
        if self.is_running():
            self.stop(block=True)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Hold the engine between steps (e.g. to update weights in place); requests resume on exit."""
        with self.engine.paused():
            yield

    # -- requests ------------------------------------------------------------------------------------------------

    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> str:
        """Queue one prompt (and its ``num_return_sequences - 1`` children); returns its request id.

        ``logit_processor_kwargs``: per-request settings, as transformers' (``temperature``, ``top_k``, ``top_p``)
        and any other :class:`~.requests.SamplingParams` field (``seed``, ``logprobs``, ...); others are ignored
        with a warning, as transformers does.
        """
        from transformers.generation.continuous_batching.requests import RequestStatus

        known = {f.name for f in dataclasses.fields(SamplingParams)}
        overrides = {k: v for k, v in logit_processor_kwargs.items() if k in known}
        ignored = sorted(set(logit_processor_kwargs) - known)
        if ignored:
            logger.warning("hf_dsinfer: per-request logits processor arguments %s are ignored", ignored)
        if request_id is None:
            request_id = f"req_{self._counter}"
            self._counter += 1
        config = self.generation_config
        if eos_token_id is not None:
            config = copy.deepcopy(config)
            config.eos_token_id = eos_token_id

        def on_update(handle: RequestHandle, new: list[int], finished: bool) -> None:
            if finished:
                self._deliver(_output(handle))
                self._handles.pop(handle.request_id, None)
            elif streaming and new:
                self._deliver(_output(handle, RequestStatus.DECODING))

        names = [request_id] + [f"{request_id}__child#{j}" for j in range(self.num_return_sequences - 1)]
        for name in names:
            try:
                self._handles[name] = self.engine.submit(
                    input_ids, config, request_id=name, max_new_tokens=max_new_tokens, on_update=on_update,
                    record_timestamps=record_timestamps, **overrides,
                )  # fmt: skip
            except ValueError as e:
                logger.error("hf_dsinfer: request %s refused: %s", name, e)
                self.output_queue.put(_failed(name, input_ids, e))
        return request_id

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **logit_processor_kwargs: Any) -> list[str]:  # fmt: skip
        return [
            self.add_request(ids, None, max_new_tokens, streaming, record_timestamps, **logit_processor_kwargs)
            for ids in inputs
        ]

    def register_result_handler(self, request_id: str, callback: Callable[[Any], None]) -> None:
        """Call ``callback(output)`` on the calling thread's running asyncio loop for each output of ``request_id``
        (every token when streaming, else once), instead of queueing it; dropped once the request finishes.
        (transformers' ``serve --continuous-batching`` uses this.)"""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._result_handlers[request_id] = (callback, loop)

    def _deliver(self, output: Any) -> None:
        """To the request's registered handler (on its event loop), else to the output queue."""
        with self._lock:
            entry = self._result_handlers.get(output.request_id)
            if entry is not None and output.is_finished():
                del self._result_handlers[output.request_id]
        if entry is None:
            self.output_queue.put(output)
        else:
            callback, loop = entry
            loop.call_soon_threadsafe(callback, output)

    def cancel_request(self, request_id: str) -> None:
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.cancel()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> Any:
        """The next output (of ``request_id`` if given, else of any request), or None after ``timeout`` seconds."""
        if self.output_queue.empty() and not self.is_running():
            return None
        try:
            result = self.output_queue.get(block=True, timeout=timeout)
        except queue.Empty:
            return None
        if request_id is not None and result.request_id != request_id:
            self.output_queue.put(result)
            return None
        return result

    def __iter__(self) -> Iterator[Any]:
        while self.is_running():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str) -> Generator[Any]:
        while self.is_running():
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return


def init_continuous_batching(
    self: nn.Module,
    generation_config: Any = None,
    continuous_batching_config: Any = None,
    workload_hints: Any = None,
) -> FusedContinuousBatchingManager:
    """transformers' ``init_continuous_batching`` on the fused layers: a manager over a new :class:`ServingEngine`."""
    config = generation_config if generation_config is not None else self.generation_config
    if tp_group_of(self).size > 1:
        raise ValueError(
            "init_continuous_batching with tensor parallelism: the other ranks must run the steps too. Use "
            "generate_batch on every rank, `hf-dsinfer serve --tensor-parallel-size N`, or a ServingEngine on rank 0 "
            "with hf_dsinfer.serving.tp_worker.run_worker(model) on the others (docs/tensor_parallel.md)."
        )
    if unsupported_reason(self) is not None:
        raise ValueError(
            f"init_continuous_batching on fused layers cannot serve this model: {unsupported_reason(self)}; load it "
            "without replace_with_kernel_inject to use transformers' continuous batching, or use generate."
        )
    engine = ServingEngine(self, generation_config=config, **engine_options(continuous_batching_config))
    return FusedContinuousBatchingManager(self, config, engine)


@contextlib.contextmanager
def continuous_batching_context_manager(
    self: nn.Module,
    generation_config: Any = None,
    block: bool = True,
    timeout: float | None = None,
    continuous_batching_config: Any = None,
    persistent_manager: bool = False,
    warmup: bool = True,
    workload_hints: Any = None,
) -> Iterator[FusedContinuousBatchingManager]:
    """transformers' context manager: a started manager, stopped (after finishing its requests) on exit."""
    manager = init_continuous_batching(self, generation_config, continuous_batching_config, workload_hints)
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=block, timeout=timeout)
