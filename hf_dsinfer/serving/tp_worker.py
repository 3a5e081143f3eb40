"""Tensor-parallel continuous batching: rank 0 schedules, every rank runs the step on its shard.

Rank 0 owns the :class:`~.engine.ServingEngine` (scheduler, block manager, sampling). Before running a step it sends
the step's :class:`~.runner.StepInputs` (token ids, positions, slot mapping, block tables, sequence bounds, the rows
that need logits, copy-on-write block copies) to the other ranks of the model's TP group with **one broadcast** of an
int64 tensor; each rank then runs :meth:`~.runner.PagedRunner.forward` on its slices of the fused layers over its own
paged cache (its local KV heads, the same ``num_blocks`` / ``block_size``, so rank 0's block tables are valid on every
rank). The model's own all-reduces (row-parallel ``o`` / ``down``, the vocab-parallel embedding) and the LM head's
vocab gather are the only other collectives. Only rank 0 samples.

The messages (:class:`StepChannel`): ``SETUP`` (the cache's ``num_blocks``, ``block_size``: a worker builds or reuses
its runner), ``STEP``, ``STOP`` (ends :func:`run_worker`, carrying a picklable result, e.g. ``generate_batch``'s
outputs) ``GROW`` (a message longer than the buffer: both sides enlarge it first; rare), ``NOOP`` (an idle engine's
keep-alive, every :data:`KEEPALIVE_S` seconds) and ``LORA`` (LoRA adapters: rank 0's engine enables them, then
loads or unloads an adapter folder into the slot it chose; each worker does the same on its shard, see
:mod:`.lora`; only then, never inside an ordinary step, so a step stays one broadcast). Everything goes through
torch.distributed (gloo on CPU, NCCL on GPU); there is no transport of our own.

Use::

    # every rank loads the model with tensor_parallel={"tp_size": N} (torchrun), then
    if rank == 0:
        engine = ServingEngine(model).start()      # submit(...) as usual; each step reaches the workers
        ...
        engine.stop(); engine.stop_workers()
    else:
        run_worker(model)                          # returns when rank 0 calls stop_workers()

``model.generate_batch(...)`` does this by itself on every rank (:func:`tp_generate_batch`), and ``hf-dsinfer serve
--tensor-parallel-size N`` starts its workers itself (:mod:`.tp_launch`). A worker stays in :func:`run_worker` while
rank 0's engine lives; errors there are not reported back to rank 0 (rank 0 runs the same code on the same shapes
first, so a step that fails fails there too; a worker that dies ends its process, which the server watches).
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..log import logger
from .runner import PagedRunner, StepInputs, tp_group_of

__all__ = ["StepChannel", "channel_for", "run_worker", "tp_generate_batch"]

SETUP, STEP, STOP, GROW, NOOP, LORA = 1, 2, 3, 4, 5, 6
#: An idle engine's stepping thread sends a ``NOOP`` this often, so that idle workers' waits stay under the process
#: group's timeout (a broadcast to a dead worker fails then, too).
KEEPALIVE_S = 60.0
_CAPACITY = 1 << 12  # int64 entries of the first buffer (32 KiB): a step of 256 tokens and 64 short requests fits
_CHANNEL_ATTR = "_dsinfer_step_channel"
_WORKER_ATTR = "_dsinfer_worker_runner"
_LORA_ATTR = "_dsinfer_worker_lora"


class StepChannel:
    """Rank 0 -> the other ranks of a TP group: each message is one broadcast of a fixed-size int64 tensor.

    The buffer is ``[kind, length, payload...]``; both sides keep the same capacity (a ``GROW`` message enlarges it
    before a longer message). One channel per model (:func:`channel_for`), so rank 0 and the workers stay in step
    across engines and ``generate_batch`` calls.
    """

    def __init__(self, tp: Any):
        self.tp = tp
        nccl = dist.get_backend(tp.group) == "nccl"  # NCCL moves CUDA tensors only, gloo CPU tensors
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.buffer = torch.zeros(_CAPACITY, dtype=torch.long, device=self.device)
        self.attached: tuple[int, int] | None = None  # (num_blocks, block_size) the workers were set up with
        self.messages = 0  # broadcasts made (tests count one per step)
        self.last_sent = time.monotonic()

    # -- rank 0 ------------------------------------------------------------------------------------------------------

    def _send(self, kind: int, payload: torch.Tensor, keep: bool = True) -> None:
        """One message; a longer one than the buffer first announces a larger buffer (``keep``: for the messages
        after it too; else for this one only, e.g. a stop carrying ``generate_batch``'s outputs)."""
        n = int(payload.numel())
        standing = self.buffer
        if n + 2 > self.buffer.numel():
            size = 1 << (n + 2 - 1).bit_length()
            self._broadcast(torch.tensor([GROW, 2, size, int(keep)], dtype=torch.long))
            self.buffer = torch.zeros(size, dtype=torch.long, device=self.device)
        self._broadcast(torch.cat([torch.tensor([kind, n], dtype=torch.long), payload.to(torch.long)]))
        if not keep:
            self.buffer = standing

    def _broadcast(self, message: torch.Tensor) -> None:
        self.buffer[: message.numel()].copy_(message)
        dist.broadcast(self.buffer, src=self.tp.first_global_rank, group=self.tp.group)
        self.messages += 1
        self.last_sent = time.monotonic()

    @property
    def keepalive_due(self) -> bool:
        return time.monotonic() - self.last_sent > KEEPALIVE_S

    def keepalive(self) -> None:
        """A message the workers skip (keeps their wait short of the process group's timeout)."""
        self._send(NOOP, torch.empty(0, dtype=torch.long))

    def attach(self, num_blocks: int, block_size: int) -> None:
        """Make sure the workers run a cache of ``num_blocks`` x ``block_size`` (a ``SETUP`` when that changed or after
        a ``STOP``)."""
        if self.attached != (num_blocks, block_size):
            self._send(SETUP, torch.tensor([num_blocks, block_size]))
            self.attached = (num_blocks, block_size)

    def send_step(self, step: StepInputs) -> None:
        """Send one step's inputs (rank 0, right before running it)."""
        self._send(STEP, encode_step(step))

    def send_stop(self, result: Any = None) -> None:
        """End the workers' :func:`run_worker`, which returns ``result`` (pickled)."""
        self._send(STOP, _pickled(result), keep=False)
        self.attached = None

    def send_lora(self, op: tuple) -> None:
        """A LoRA operation every worker repeats on its shard: ``("enable", max_loras, max_lora_rank)``, ``("load",
        name, path, slot)`` or ``("unload", name)`` (rank 0, between two steps, after doing it itself)."""
        self._send(LORA, _pickled(op), keep=False)

    # -- the other ranks ---------------------------------------------------------------------------------------------

    def receive(self) -> tuple[int, Any]:
        """The next message: ``(SETUP, (num_blocks, block_size))``, ``(STEP, StepInputs)``, ``(LORA, op)`` or
        ``(STOP, result)``."""
        standing = None  # the buffer to go back to after a one-off larger message
        while True:
            dist.broadcast(self.buffer, src=self.tp.first_global_rank, group=self.tp.group)
            self.messages += 1
            kind, n = self.buffer[:2].tolist()
            payload = self.buffer[2 : 2 + n].cpu()
            if standing is not None:
                self.buffer, standing = standing, None
            if kind == GROW:
                size, keep = payload.tolist()
                standing = None if keep else self.buffer
                self.buffer = torch.zeros(size, dtype=torch.long, device=self.device)
                continue
            if kind == NOOP:
                continue
            if kind == SETUP:
                return kind, tuple(payload.tolist())
            if kind == STEP:
                return kind, decode_step(payload)
            if kind in (STOP, LORA):  # pickled by rank 0 of our own process group (as broadcast_object_list does)
                size = int(payload[0])
                return kind, pickle.loads(payload[1:].numpy().tobytes()[:size])
            raise RuntimeError(f"tensor-parallel worker: unknown message kind {kind} from rank 0 (internal error)")


def _pickled(value: Any) -> torch.Tensor:
    """``[byte length, int64 words...]`` of ``pickle.dumps(value)``."""
    data = pickle.dumps(value)
    padded = data + b"\0" * (-len(data) % 8)
    words = torch.frombuffer(bytearray(padded), dtype=torch.int64) if padded else torch.empty(0, dtype=torch.long)
    return torch.cat([torch.tensor([len(data)]), words])


def encode_step(step: StepInputs) -> torch.Tensor:
    """``step`` as one int64 vector: ``[T, S, MB, N, R, K, lora?]`` then the tensors in field order."""
    T, (S, MB) = step.input_ids.numel(), step.block_tables.shape
    head = [T, S, MB, step.prompt_rows.numel(), step.sample_rows.numel(), step.copies.shape[0]]
    head.append(int(step.lora_slots is not None))
    parts = [torch.tensor(head), step.input_ids, step.positions, step.slot_mapping, step.cu_seqlens, step.seq_lens,
             step.block_tables.reshape(-1), step.prompt_rows, step.sample_rows, step.copies.reshape(-1)]  # fmt: skip
    if step.lora_slots is not None:
        parts.append(step.lora_slots)
    return torch.cat([p.to(torch.long) for p in parts])


def decode_step(data: torch.Tensor) -> StepInputs:
    """The inverse of :func:`encode_step`."""
    T, S, MB, N, R, K, lora = data[:7].tolist()
    sizes = [T, T, T, S + 1, S, S * MB, N, R, 2 * K] + ([T] if lora else [])
    parts = list(torch.split(data[7 : 7 + sum(sizes)], sizes))
    i32 = torch.int32
    return StepInputs(
        input_ids=parts[0], positions=parts[1], slot_mapping=parts[2], cu_seqlens=parts[3].to(i32),
        seq_lens=parts[4].to(i32), block_tables=parts[5].to(i32).reshape(S, MB), prompt_rows=parts[6],
        sample_rows=parts[7], copies=parts[8].reshape(K, 2), lora_slots=parts[9] if lora else None,
    )  # fmt: skip


def channel_for(model: nn.Module) -> StepChannel:
    """The model's :class:`StepChannel` (made once; the same object serves every engine and call on this rank)."""
    channel = getattr(model, _CHANNEL_ATTR, None)
    if channel is None:
        tp = tp_group_of(model)
        if tp.size == 1:
            raise ValueError("this model is not split over tensor-parallel ranks: no workers to talk to")
        channel = StepChannel(tp)
        object.__setattr__(model, _CHANNEL_ATTR, channel)  # a plain attribute, not a submodule
    return channel


def _worker_runner(model: nn.Module, num_blocks: int, block_size: int) -> PagedRunner:
    """This rank's runner for a cache of ``num_blocks`` x ``block_size`` (kept on the model: its cache is reused)."""
    runner = getattr(model, _WORKER_ATTR, None)
    if runner is None or (runner.blocks.num_blocks, runner.blocks.block_size) != (num_blocks, block_size):
        if runner is not None:
            runner.cache.release()
        runner = PagedRunner(model, block_size=block_size, num_blocks=num_blocks)
        object.__setattr__(model, _WORKER_ATTR, runner)
    return runner


def _worker_lora(model: nn.Module, op: tuple) -> Any:
    """Repeat rank 0's LoRA operation ``op`` (:meth:`StepChannel.send_lora`) on this rank's shard; returns the
    rank's registry (kept on the model: it outlives one engine's workers loop, as rank 0's engine does)."""
    from .lora import LoRARegistry

    what, *args = op
    if what == "enable":  # a new engine with adapters: fresh slots over the fused linears, as rank 0's
        registry = LoRARegistry(model, *args)
        object.__setattr__(model, _LORA_ATTR, registry)
        return registry
    registry = getattr(model, _LORA_ATTR, None)
    if registry is None:
        raise RuntimeError(f"tensor-parallel worker: LoRA {what!r} before adapters were enabled (internal error)")
    if what == "load":
        name, path, slot = args
        registry.load(name, path, slot=slot)
    elif what == "unload":
        registry.unload(args[0])
    else:
        raise RuntimeError(f"tensor-parallel worker: unknown LoRA operation {what!r} (internal error)")
    return registry


@torch.no_grad()
def run_worker(model: nn.Module) -> Any:
    """Run the steps rank 0's engine sends, on this rank's shard, until rank 0 stops the workers; returns what rank 0
    sent with the stop (:meth:`~.engine.ServingEngine.stop_workers`). Call it on every rank but 0."""
    tp = tp_group_of(model)
    if tp.size == 1 or tp.rank == 0:
        raise ValueError(f"run_worker runs on the ranks other than 0 of a tensor-parallel model (this is rank "
                         f"{tp.rank} of {tp.size}); rank 0 runs the ServingEngine")  # fmt: skip
    channel = channel_for(model)
    runner = None
    while True:
        kind, value = channel.receive()
        if kind == STOP:
            return value
        if kind == LORA:
            lora = _worker_lora(model, value)
            if runner is not None:
                runner.lora = lora
        elif kind == SETUP:
            runner = _worker_runner(model, *value)
            runner.lora = getattr(model, _LORA_ATTR, None)
        elif runner is None:
            raise RuntimeError("tensor-parallel worker: a step came before the cache setup (internal error)")
        else:
            runner.forward(value)


# -- generate_batch on every rank -------------------------------------------------------------------------------------


def _rename(out: Any, offset: int) -> tuple[str, Any]:
    """``out`` of the merged batch's ``req_<offset + i>...`` as this rank's ``req_<i>...``."""
    head, sep, tail = out.request_id.partition("__")
    name = f"req_{int(head.removeprefix('req_')) - offset}{sep}{tail}"
    return name, dataclasses.replace(out, request_id=name)


def tp_generate_batch(model: nn.Module, inputs: list[list[int]], run: Any) -> dict[str, Any]:
    """``generate_batch`` of a tensor-parallel model, called on every rank (as ``generate`` is).

    The ranks' prompt lists are gathered first (one ``all_gather_object``): when they are equal (the usual
    ``torchrun`` script) rank 0 serves them once, else it serves all of them and each rank gets the results of its
    own prompts, named as if it had run alone. ``run(prompts)`` is the single-process body
    (:func:`~.hf_api.run_generate_batch` with the call's settings); rank 0's generation settings apply. The outputs
    come back to every rank with the workers' stop message.
    """
    tp = tp_group_of(model)
    lists: list[Any] = [None] * tp.size
    dist.all_gather_object(lists, [list(map(int, p)) for p in inputs], group=tp.group)
    same = all(p == lists[0] for p in lists)
    if tp.rank != 0:
        status, payload = run_worker(model)
        if status == "error":
            raise RuntimeError(f"generate_batch failed on rank 0 of the tensor-parallel group: {payload}")
        return payload if same else payload[tp.rank]
    channel = channel_for(model)
    merged = lists[0] if same else [p for ps in lists for p in ps]
    try:
        results = run(merged) if merged else {}
    except BaseException as e:
        channel.send_stop(("error", repr(e)))
        raise
    if same:
        channel.send_stop(("ok", results))
        return results
    per_rank, offset = [], 0
    for ps in lists:
        mine = [name for name, out in results.items() if offset <= int(name.partition("__")[0][4:]) < offset + len(ps)]
        per_rank.append(dict(_rename(results[name], offset) for name in mine))
        offset += len(ps)
    channel.send_stop(("ok", per_rank))
    logger.info("hf_dsinfer generate_batch: the %d ranks passed different prompts; each got its own", tp.size)
    return per_rank[0]
