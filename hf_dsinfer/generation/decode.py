"""The decode step over an injected model's static KV cache, and its CUDA-graph runner.

:class:`DecodeStep` computes one token for every row: ``(input_ids [B, 1], positions [B, 1]) -> logits [B, V]``.
It reads the runtime that kernel injection attaches to a model (its policy, fused layers, final norm, rotary table
and :class:`~hf_dsinfer.modules.StaticKVCache`), keeps every changing value in device tensors and advances the
per-row cache lengths in place, so it is graph-safe. The host-side ``padded_len`` of the cache is the caller's to
advance (a replayed graph cannot run Python).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..log import logger
from ..modules import StepContext, cpu_packed
from .compiled_cpu import CompiledCPUDecode
from .graph_runner import GraphRunner, StaticInput, batch_buckets


class DecodeStep:
    """One decode step of an injected causal LM, graph-safe (see the module docstring).

    Args:
        model: the top-level model (``*ForCausalLM``); its policy hooks receive it.
        runtime: the injection runtime (``policy``, ``layers``, ``final_norm``, ``rotary``, ``cache``).
        compile_cpu: run CPU steps through :class:`CompiledCPUDecode` (``torch.compile``, one graph per batch bucket):
            True, or ``"auto"`` (compiled once eager steps have cost about a compile, see ``AUTO_AFTER_S``).
        batch_sizes, max_batch_size: the batch buckets (see :func:`~.graph_runner.batch_buckets`).
    """

    def __init__(
        self,
        model: nn.Module,
        runtime: Any,
        compile_cpu: bool | str = False,
        batch_sizes: list[int] | None = None,
        max_batch_size: int = 8,
    ):
        self.model = model
        self.runtime = runtime
        self.policy = runtime.policy
        self.cache = runtime.cache
        self.lm_head = model.get_output_embeddings()
        self._start: torch.Tensor | None = None
        self.compiled: CompiledCPUDecode | None = None
        self._verifiers: dict[int, CompiledCPUDecode] = {}  # tokens -> the compiled one-row verification step
        self._loop: contextlib.ExitStack | None = None  # inside loop(): the scopes of the compiled steps
        if compile_cpu:
            buckets = batch_buckets(batch_sizes, max_batch_size)
            self.compiled = CompiledCPUDecode(self, buckets, auto=compile_cpu == "auto")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, 1]``, ``positions [B, 1]`` (int64, device) -> fp32 logits ``[B, V]``.

        On CPU with ``compile_cpu`` the step runs compiled (see :class:`CompiledCPUDecode`); otherwise eagerly.
        """
        if self.compiled is not None and self.compiled.applies(input_ids):
            return self.compiled(input_ids=input_ids, positions=positions)
        return self.eager(input_ids, positions)

    @contextlib.contextmanager
    def loop(self) -> Iterator[None]:
        """The scope of one decoding loop over this step and its verification steps (see
        :meth:`CompiledCPUDecode.loop`; a verifier created inside the loop joins it; nothing without the compiled CPU
        step)."""
        if self.compiled is None or self._loop is not None:
            yield
            return
        with contextlib.ExitStack() as stack:
            for compiled in (self.compiled, *self._verifiers.values()):
                stack.enter_context(compiled.loop())
            self._loop = stack
            try:
                yield
            finally:
                self._loop = None

    def verifier(self, tokens: int, input_ids: torch.Tensor) -> CompiledCPUDecode | None:
        """The compiled step over ``tokens`` new tokens of one row (a speculative verification: ``1 + k`` tokens),
        or None where the compiled CPU path does not apply (then the caller runs the model's forward).

        Called with ``input_ids [1, tokens]`` and ``positions [1, tokens]``, it returns fp32 logits
        ``[1, tokens, V]`` and advances the row's cache length by ``tokens`` (the caller advances ``padded_len`` and
        rolls back what it rejects with ``InjectedCache.crop``). One graph per ``tokens``, compiled on first use.
        """
        if self.compiled is None or self.compiled.failed or not self.compiled.applies(input_ids):
            return None
        verifier = self._verifiers.get(tokens)
        if verifier is None:
            verifier = self._verifiers[tokens] = CompiledCPUDecode(self, [1], tokens=tokens, auto=self.compiled.auto)
            if self._loop is not None:
                self._loop.enter_context(verifier.loop())
        return None if verifier.failed else verifier

    def start_offsets(self, batch: int, device: torch.device) -> torch.Tensor:
        """Zero left-padding offsets ``[batch]`` int32, from a buffer allocated once (graph-safe: no allocation)."""
        if self._start is None or self._start.shape[0] < batch or self._start.device != device:
            self._start = torch.zeros(max(batch, self.cache.allocated_rows), dtype=torch.int32, device=device)
        return self._start[:batch]

    def eager(self, input_ids: torch.Tensor, positions: torch.Tensor, attend_len: int | None = None) -> torch.Tensor:
        """The step in eager torch (also what :class:`CompiledCPUDecode` traces, with ``attend_len`` set).

        ``input_ids``/``positions [B, T]``: one token per row (decode, logits ``[B, V]``) or ``T`` tokens per row
        (a speculative verification, logits ``[B, T, V]``, every token's). ``attend_len``: a host-side bound on the
        cached lengths after this step; set, the attention layers store and attend without host syncs over that many
        slots (see ``StepContext.attend_len``).
        """
        rt, cache = self.runtime, self.cache
        batch, tokens = input_ids.shape
        hidden = self.policy.embed(self.model, input_ids, positions)  # [B, T, C]
        start = self.start_offsets(batch, input_ids.device)  # [B]: a step's tokens are never padding
        cache_lens = cache.lengths[:batch]  # [B] int32: tokens stored before this step
        seq_lens = cache_lens + 1 if tokens == 1 else None  # None: the prefill-style attention (causal within T)
        ctx = StepContext(cache, start, cache_lens, positions.reshape(-1), rt.rotary, seq_lens)
        ctx.attend_len = attend_len
        hidden = rt.run_layers(self.model, hidden, ctx)
        cache.lengths[:batch] += tokens  # in place: a replayed graph advances the same tensor
        rows = hidden[:, -1] if tokens == 1 else hidden.reshape(batch * tokens, -1)  # [B, C] or [B * T, C]
        logits = cpu_packed.module_forward(self.lm_head, rows)  # CPU fp32 with >= 4 rows: prepacked
        logits = self.policy.finalize_logits(self.model, logits).float()
        return logits if tokens == 1 else logits.view(batch, tokens, -1)  # [B, V] or [B, T, V]


class DecodeGraphs:
    """Decode-step CUDA graphs of one model: captured lazily, re-captured when the cache buffers move."""

    def __init__(self, step: DecodeStep, cuda_graph_batch_sizes: list[int] | None, max_batch_size: int):
        self.step = step
        self.buckets = batch_buckets(cuda_graph_batch_sizes, max_batch_size)
        self.runner: GraphRunner | None = None
        self._signature: tuple | None = None

    def _buffers_signature(self) -> tuple:
        cache, rotary = self.step.cache, self.step.runtime.rotary
        ptrs = [t.data_ptr() for t in (*cache.keys, *cache.values, cache.lengths)]
        if rotary is not None:
            ptrs += [rotary.cos.data_ptr(), rotary.sin.data_ptr()]
        return tuple(ptrs)

    def prepare(self, batch: int, device: torch.device, dtype: torch.dtype) -> GraphRunner:
        """Make sure graphs exist for the cache as it is allocated for ``batch`` rows; call before the prefill.

        Capturing runs the step on pad inputs, so it happens here, while no sequence is in the cache; the cache is
        reset afterwards.
        """
        cache = self.step.cache
        rotary = self.step.runtime.rotary
        if rotary is not None and rotary.cos.device != device:
            rotary.to(device)  # before capture: graphs read the table where it lives
        cache.start(max(batch, self.buckets[-1]), device, dtype)  # allocates (or grows) the buffers
        signature = self._buffers_signature()
        if self.runner is None or self.runner.device != device:
            inputs = {"input_ids": StaticInput((1,), torch.long, 0), "positions": StaticInput((1,), torch.long, 0)}
            self.runner = GraphRunner(
                self.step, inputs, self.buckets, device, use_graphs=True, reset_state=cache.lengths.zero_
            )
        elif signature != self._signature:
            logger.info("hf_dsinfer: the static KV cache was re-allocated; capturing the decode graphs again")
            self.runner.reset()
        if not self.runner.captured:
            self.runner.reset_state = cache.lengths.zero_
            self.runner.capture()
            self._signature = signature
        cache.reset()
        return self.runner
