"""Replay a step function as CUDA graphs, one per batch bucket, over static input buffers.

A *step* is a callable over tensors whose first dimension is the batch (e.g. ``step(input_ids [B, 1],
positions [B, 1]) -> logits [B, V]``). :class:`GraphRunner` owns one static buffer per input, sized for the largest
bucket. A call copies the inputs into the first ``B`` rows, fills the rows up to the bucket with each input's pad
value, runs (or replays) the step on the bucket-sized views and returns the first ``B`` rows of the output.

On CUDA (``use_graphs=True``) every bucket is captured once, largest first, into one shared memory pool, after
warm-up runs on a side stream (Triton autotuning and lazy allocations must happen before capture, never inside a
graph). Without CUDA the very same buffer logic runs the step eagerly, so tests on CPU cover bucket choice, padding
and buffer reuse. A batch above the largest bucket always runs eagerly on the caller's tensors (logged once per size).

The step must be graph-safe: no host syncs, no Python-side state that has to change between replays (keep
positions, lengths and tokens in device tensors updated in place). Warm-up and capture *run* the step on pad inputs,
so state it mutates (a KV cache) must be reset by the caller after :meth:`GraphRunner.capture`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..log import logger

StepOutput = torch.Tensor | tuple[torch.Tensor, ...]


def default_batch_buckets(max_batch_size: int) -> list[int]:
    """The default buckets: 1, 2, 4, 8, then every multiple of 8, up to and including ``max_batch_size``."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 8))
    sizes.add(max_batch_size)  # so that no batch the cache can hold runs eagerly
    return sorted(sizes)


def batch_buckets(cuda_graph_batch_sizes: Sequence[int] | None, max_batch_size: int) -> list[int]:
    """The buckets of an inference config: ``cuda_graph_batch_sizes`` when set, else the defaults."""
    if cuda_graph_batch_sizes:
        return sorted(set(int(s) for s in cuda_graph_batch_sizes))
    return default_batch_buckets(max_batch_size)


@dataclass(frozen=True)
class StaticInput:
    """One batched input of a step: its shape after the batch dim, dtype, and the value padded rows get."""

    tail: tuple[int, ...]
    dtype: torch.dtype
    pad_value: float | int = 0


@dataclass
class RunnerStats:
    """Counters of a :class:`GraphRunner` (tests and logs read them)."""

    captured: tuple[int, ...] = ()
    capture_s: float = 0.0
    graph_bytes: int = 0
    replays: int = 0  # calls served by a bucket (graph replays on CUDA, bucketed eager runs elsewhere)
    eager_calls: int = 0  # calls above the largest bucket


def _as_tuple(out: StepOutput) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


class GraphRunner:
    """Run ``step`` on static buffers padded to batch buckets; capture and replay CUDA graphs when enabled.

    Args:
        step: the step function; called with keyword tensors named like ``inputs``, all with the same batch.
        inputs: name -> :class:`StaticInput` for every argument of ``step``.
        batch_sizes: the buckets (see :func:`batch_buckets`).
        device: where the buffers live.
        use_graphs: capture CUDA graphs (default: when ``device`` is CUDA).
        warmup_iters: eager runs per bucket on a side stream before capture.
        generators: ``torch.Generator`` objects the step draws from; registered with each graph so that replays
            advance them (needs a torch with ``CUDAGraph.register_generator_state``).
        reset_state: called before every warm-up run and every capture (never inside a graph), e.g. to zero the
            cache lengths a step advances, so repeated warm-ups cannot walk past the end of a buffer.
        name: used in logs and the progress bar.
    """

    def __init__(
        self,
        step: Callable[..., StepOutput],
        inputs: Mapping[str, StaticInput],
        batch_sizes: Sequence[int],
        device: torch.device | str,
        use_graphs: bool | None = None,
        warmup_iters: int = 2,
        generators: Sequence[torch.Generator] = (),
        reset_state: Callable[[], object] | None = None,
        name: str = "decode",
    ):
        if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
            raise ValueError(f"batch_sizes must be a non-empty list of integers >= 1, got {list(batch_sizes)}")
        self.step = step
        self.specs = dict(inputs)
        self.buckets = sorted(set(int(b) for b in batch_sizes))
        self.device = torch.device(device)
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        self.warmup_iters = warmup_iters
        self.generators = list(generators)
        self.reset_state = reset_state
        self.name = name
        self.stats = RunnerStats()
        largest = self.buckets[-1]
        # One buffer per input for the largest bucket; smaller buckets use views of its first rows, so every graph
        # reads the same addresses.
        self.buffers: dict[str, torch.Tensor] = {
            k: torch.full((largest, *s.tail), s.pad_value, dtype=s.dtype, device=self.device)
            for k, s in self.specs.items()
        }
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._single: dict[int, bool] = {}  # bucket -> the step returned a bare tensor
        self._pool = None
        self._eager_logged: set[int] = set()

    # -- bucket logic ----------------------------------------------------------------------------------------------

    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` rows, or None when ``batch`` is above the largest one."""
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def _views(self, bucket: int) -> dict[str, torch.Tensor]:
        return {k: buf[:bucket] for k, buf in self.buffers.items()}

    def _fill(self, inputs: Mapping[str, torch.Tensor], bucket: int) -> int:
        """Copy ``inputs`` into the static buffers and pad rows up to ``bucket``; returns the batch."""
        if set(inputs) != set(self.specs):
            missing, extra = sorted(set(self.specs) - set(inputs)), sorted(set(inputs) - set(self.specs))
            raise TypeError(f"{self.name} step inputs mismatch: missing {missing}, unexpected {extra}")
        batch = None
        for k, x in inputs.items():
            spec = self.specs[k]
            if tuple(x.shape[1:]) != spec.tail:
                want = ", ".join(["batch", *map(str, spec.tail)])
                raise ValueError(f"input {k!r} has shape {tuple(x.shape)}, expected [{want}]")
            if batch is None:
                batch = x.shape[0]
            elif x.shape[0] != batch:
                raise ValueError(f"input {k!r} has batch {x.shape[0]}, the others {batch}")
        assert batch is not None
        for k, x in inputs.items():
            buf = self.buffers[k]
            buf[:batch].copy_(x, non_blocking=True)
            if batch < bucket:
                buf[batch:bucket].fill_(self.specs[k].pad_value)
        return batch

    # -- capture ---------------------------------------------------------------------------------------------------

    def capture(self) -> None:
        """Capture every bucket (largest first) into one memory pool. A no-op without graphs or when captured.

        Runs the step ``warmup_iters`` times per bucket on a side stream first, then once more per bucket under
        capture, on the buffers' pad values: reset any state the step mutates afterwards.
        """
        if not self.use_graphs or self._graphs:
            return
        from tqdm.auto import tqdm

        for k, s in self.specs.items():
            self.buffers[k].fill_(s.pad_value)
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        mem0 = torch.cuda.memory_reserved(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: autotuning, lazy init and allocator growth happen here
            for bucket in reversed(self.buckets):
                for _ in range(self.warmup_iters):
                    self._reset_state()
                    self.step(**self._views(bucket))
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self._pool = torch.cuda.graph_pool_handle()
        bar = tqdm(list(reversed(self.buckets)), desc=f"capturing {self.name} CUDA graphs", unit="graph", leave=False)
        try:
            for bucket in bar:  # largest first: smaller graphs reuse the pool blocks the largest one freed
                bar.set_postfix(batch=bucket)
                self._reset_state()
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                for gen in self.generators:
                    register = getattr(graph, "register_generator_state", None)
                    if register is None:
                        raise RuntimeError("this torch cannot register a generator with a CUDA graph (needs >= 2.6)")
                    register(gen)
                with torch.cuda.graph(graph, pool=self._pool):
                    out = self.step(**self._views(bucket))
                self._single[bucket] = not isinstance(out, tuple)
                self._outputs[bucket] = _as_tuple(out)
                self._graphs[bucket] = graph
        except Exception:
            self.reset()
            raise
        finally:
            bar.close()
        torch.cuda.synchronize(self.device)
        self.stats.captured = tuple(self.buckets)
        self.stats.capture_s = time.perf_counter() - t0
        self.stats.graph_bytes = torch.cuda.memory_reserved(self.device) - mem0
        logger.info(
            "hf_dsinfer: captured %d %s CUDA graphs (batch %s) in %.2f s, %.1f MiB of graph memory",
            len(self._graphs), self.name, ", ".join(map(str, self.buckets)), self.stats.capture_s,
            self.stats.graph_bytes / 2**20,
        )

    def _reset_state(self) -> None:
        if self.reset_state is not None:
            self.reset_state()

    def reset(self) -> None:
        """Drop every captured graph (e.g. after the buffers a graph reads were re-allocated)."""
        self._graphs.clear()
        self._outputs.clear()
        self._single.clear()
        self._pool = None
        self.stats.captured = ()

    # -- running ---------------------------------------------------------------------------------------------------

    def __call__(self, **inputs: torch.Tensor) -> StepOutput:
        """Run the step for ``inputs`` (all ``[B, ...]``); returns the output's first ``B`` rows.

        With graphs the result is a view of the graph's static output: consume (or clone) it before the next call.
        """
        first = next(iter(inputs.values()))
        batch = first.shape[0]
        bucket = self.bucket_for(batch)
        if bucket is None:
            if batch not in self._eager_logged:
                self._eager_logged.add(batch)
                logger.info(
                    "hf_dsinfer: batch %d is above the largest %s bucket (%d); running it eagerly "
                    "(raise max_batch_size / cuda_graph_batch_sizes to cover it).", batch, self.name, self.max_bucket,
                )
            self.stats.eager_calls += 1
            return self.step(**inputs)
        self._fill(inputs, bucket)
        self.stats.replays += 1
        if self.use_graphs:
            if not self._graphs:
                raise RuntimeError(f"{self.name} graphs are not captured; call capture() first")
            self._graphs[bucket].replay()
            outs, single = self._outputs[bucket], self._single[bucket]
        else:
            out = self.step(**self._views(bucket))
            outs, single = _as_tuple(out), not isinstance(out, tuple)
        sliced = tuple(o[:batch] for o in outs)
        return sliced[0] if single else sliced
