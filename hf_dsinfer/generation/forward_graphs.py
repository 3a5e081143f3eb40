"""CUDA graphs for the ``forward`` of encoder models (bert and friends) with ``enable_cuda_graph=True``.

Each call is padded to a (batch, sequence) bucket: the batch to the next batch bucket (see
:func:`~hf_dsinfer.generation.graph_runner.batch_buckets`), the sequence to the next multiple of
``SEQ_MULTIPLE``. Padded rows and positions get an attention mask of 0, so the real tokens' outputs do not depend on
them; outputs are sliced back to the caller's shape. One graph is captured per bucket on first use (after warm-up
runs on a side stream), all in one memory pool. Calls the graphs cannot serve exactly run the eager forward:
anything but ``input_ids`` / ``attention_mask`` / ``token_type_ids`` tensors, a batch above the largest bucket, a
sequence past ``max_position_embeddings``, or a model whose forward cannot be captured (one warning, then eager).

Without CUDA (``use_graphs=False``) the same padding and static buffers run eagerly, which is what the CPU tests
check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..log import logger
from .graph_runner import batch_buckets

SEQ_MULTIPLE = 32
MAX_GRAPHS = 32
_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class ForwardGraphs:
    """Bucketed static-buffer (and, on CUDA, graph-replayed) forward of an encoder model."""

    def __init__(
        self,
        model: nn.Module,
        forward: Callable[..., Any],
        buckets: list[int],
        use_graphs: bool | None = None,
        seq_multiple: int = SEQ_MULTIPLE,
        max_graphs: int = MAX_GRAPHS,
    ):
        self.forward = forward
        self.buckets = sorted(buckets)
        self.use_graphs = use_graphs
        self.seq_multiple = seq_multiple
        self.max_graphs = max_graphs
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.pad_id = getattr(model.config, "pad_token_id", None) or 0
        self.entries: dict[tuple, dict[str, Any]] = {}
        self.pool = None
        self.disabled: str | None = None  # why graphs are off for good (a failed capture)
        self.eager_calls = 0

    def _key(self, kwargs: dict[str, Any]) -> tuple | None:
        """The bucket for this call, or None when it must run eagerly."""
        if self.disabled or any(k not in _INPUTS for k, v in kwargs.items() if v is not None):
            return None
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return None
        if any(isinstance(kwargs.get(k), torch.Tensor) and kwargs[k].shape != ids.shape for k in _INPUTS[1:]):
            return None
        batch, seq = ids.shape
        b = next((x for x in self.buckets if x >= batch), None)
        t = -(-seq // self.seq_multiple) * self.seq_multiple
        if self.max_positions is not None:
            t = min(t, self.max_positions)
        if b is None or t < seq:
            return None
        names = tuple(k for k in _INPUTS if kwargs.get(k) is not None)
        return b, t, names, ids.device

    def _entry(self, key: tuple) -> dict[str, Any]:
        b, t, names, device = key
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= self.max_graphs:  # drop the oldest bucket
                self.entries.pop(next(iter(self.entries)))
            bufs = {"input_ids": torch.full((b, t), self.pad_id, dtype=torch.long, device=device),
                    "attention_mask": torch.zeros(b, t, dtype=torch.long, device=device)}  # fmt: skip
            if "token_type_ids" in names:
                bufs["token_type_ids"] = torch.zeros(b, t, dtype=torch.long, device=device)
            entry = {"buffers": bufs, "graph": None, "out": None}
            self.entries[key] = entry
        return entry

    def _capture(self, entry: dict[str, Any], device: torch.device) -> None:
        bufs = entry["buffers"]
        t0 = time.perf_counter()
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: autotuning and lazy allocations stay out of the graph
                self.forward(**bufs)
        torch.cuda.current_stream(device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            entry["out"] = self.forward(**bufs)
        entry["graph"] = graph
        shape = tuple(bufs["input_ids"].shape)
        logger.info("hf_dsinfer: captured a forward CUDA graph for (batch, sequence) %s in %.2f s", shape,
                    time.perf_counter() - t0)  # fmt: skip

    def __call__(self, **kwargs: Any) -> Any:
        key = self._key(kwargs)
        if key is None:
            self.eager_calls += 1
            return self.forward(**kwargs)
        b, t, names, device = key
        graphs = self.use_graphs if self.use_graphs is not None else device.type == "cuda"
        if not graphs and self.use_graphs is None:
            return self.forward(**kwargs)  # no CUDA: padding would only cost time
        entry = self._entry(key)
        ids = kwargs["input_ids"]
        batch, seq = ids.shape
        bufs = entry["buffers"]
        bufs["input_ids"].fill_(self.pad_id)
        bufs["attention_mask"].zero_()
        bufs["input_ids"][:batch, :seq].copy_(ids)
        mask = kwargs.get("attention_mask")
        bufs["attention_mask"][:batch, :seq].copy_(mask if mask is not None else torch.ones_like(ids))
        if "token_type_ids" in bufs:
            bufs["token_type_ids"].zero_()
            bufs["token_type_ids"][:batch, :seq].copy_(kwargs["token_type_ids"])
        if not graphs:
            out = self.forward(**bufs)
        else:
            if entry["graph"] is None:
                try:
                    self._capture(entry, device)
                except Exception as e:  # noqa: BLE001 - an uncapturable forward runs eagerly from now on
                    self.disabled = f"{type(e).__name__}: {e}"
                    self.entries.clear()
                    logger.warning("hf_dsinfer: enable_cuda_graph: this model's forward cannot be captured (%s); "
                                   "running it eagerly.", self.disabled)  # fmt: skip
                    self.eager_calls += 1
                    return self.forward(**kwargs)
            entry["graph"].replay()
            out = entry["out"]
        return _slice_output(out, b, t, batch, seq)


def _slice_output(out: Any, b: int, t: int, batch: int, seq: int) -> Any:
    """Cut padded rows and positions off every tensor of ``out`` (copies: graph outputs are reused)."""

    def cut(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != b:
            return x
        x = x[:batch]
        if x.dim() >= 2 and x.shape[1] == t:
            x = x[:, :seq]
        return x.clone()

    def cut_any(v: Any) -> Any:
        return tuple(cut(x) for x in v) if isinstance(v, tuple) else cut(v)

    if hasattr(out, "keys"):  # a transformers ModelOutput: a new one (the graph's own is reused by every replay)
        return type(out)(**{k: cut_any(v) for k, v in out.items()})
    return cut_any(out)


def install_forward_graphs(model: nn.Module, cfg: Any) -> ForwardGraphs:
    """Route ``model.forward`` (this instance) through :class:`ForwardGraphs`; graphs are used on CUDA only."""
    forward = model.forward
    graphs = ForwardGraphs(model, forward, batch_buckets(cfg.cuda_graph_batch_sizes, cfg.max_batch_size))

    def graphed_forward(*args: Any, **kwargs: Any) -> Any:
        if args:  # positional inputs: map the first one (input_ids) by name, leave anything else to eager
            if len(args) > 1 or "input_ids" in kwargs:
                return forward(*args, **kwargs)
            kwargs["input_ids"] = args[0]
        return graphs(**kwargs)

    model.forward = graphed_forward
    model._dsinfer_forward_graphs = graphs
    return graphs
