"""The static KV cache: per-layer key/value buffers allocated once, plus per-sequence lengths on the device.

Layout (see docs/kernels.md): each layer holds ``k``/``v`` of shape ``[max_batch, kv_heads, max_tokens, head_dim]``.
Sequences are stored compactly from slot 0 whatever their left padding, so ``lengths[b]`` (int32, on the device) is
the number of real tokens of row ``b``. Besides it the cache tracks ``padded_len`` on the host: the length of the
(left-padded) sequence as the caller sees it, which only grows by the width of each step and costs no device sync.

Batch policy: the buffers have ``max_batch_size`` rows. A fresh sequence with a larger batch re-allocates the
buffers to fit it (a warning once per size) rather than failing, because HF's ``generate`` decides the batch;
a continuing sequence never changes its batch.
"""

from __future__ import annotations

import os

import torch

from ..log import logger


def _device_free_bytes(device: torch.device) -> int | None:
    """Memory the device can still give (CUDA: free memory; CPU: physical RAM), or None when unknown."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        if device.type == "cpu":
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None
    return None


class StaticKVCache:
    """Fixed-size KV buffers for every layer and the lengths of the sequences they hold.

    Args:
        kv_heads: key/value heads of each layer (one entry per layer).
        head_dims: head dim of each layer.
        max_tokens: slots per sequence (``InferenceConfig.max_out_tokens``): prompt plus generated tokens.
        max_batch_size: rows allocated (``InferenceConfig.max_batch_size``); a larger fresh batch re-allocates.

    Buffers are allocated lazily on the first :meth:`prepare` (on the model's device and dtype), so a model that
    is only loaded or saved never pays for them.
    """

    def __init__(self, kv_heads: list[int], head_dims: list[int], max_tokens: int, max_batch_size: int):
        if len(kv_heads) != len(head_dims):
            raise ValueError("kv_heads and head_dims need one entry per layer")
        if max_tokens < 1 or max_batch_size < 1:
            raise ValueError(f"max_out_tokens ({max_tokens}) and max_batch_size ({max_batch_size}) must be >= 1")
        self.kv_heads = list(kv_heads)
        self.head_dims = list(head_dims)
        self.max_tokens = int(max_tokens)
        self.max_batch_size = int(max_batch_size)
        self.keys: list[torch.Tensor] = []  # per layer [Bmax, Hk, S, D]
        self.values: list[torch.Tensor] = []  # per layer [Bmax, Hk, S, D]
        self.lengths: torch.Tensor | None = None  # [Bmax] int32: real tokens stored per row
        self.padded_len = 0  # host-side: width of the left-padded sequence the caller sees
        self.batch = 0  # rows in use by the current sequence
        self.epoch = 0  # bumped on every reset: adapters of an older sequence become stale

    # -- allocation ----------------------------------------------------------------------------------------------

    @property
    def allocated_rows(self) -> int:
        return self.lengths.shape[0] if self.lengths is not None else 0

    def nbytes_for(self, rows: int, dtype: torch.dtype) -> int:
        """Bytes the buffers of ``rows`` rows take in ``dtype``."""
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(2 * rows * h * self.max_tokens * d * elem for h, d in zip(self.kv_heads, self.head_dims))

    def _allocate(self, rows: int, device: torch.device, dtype: torch.dtype) -> None:
        need = self.nbytes_for(rows, dtype)
        hint = (
            f"The static KV cache for max_out_tokens={self.max_tokens} and batch {rows} needs "
            f"{need / 2**30:.2f} GiB ({len(self.kv_heads)} layers, {dtype}) on {device}"
        )
        fix = "lower max_out_tokens or the batch size (max_batch_size) in the inference config."
        free = _device_free_bytes(device)
        if free is not None and need > free:
            raise MemoryError(f"{hint}, but only {free / 2**30:.2f} GiB are available; {fix}")
        self.keys, self.values, self.lengths = [], [], None  # drop old buffers before allocating new ones
        try:
            for h, d in zip(self.kv_heads, self.head_dims):
                # zeros, not empty: the reference kernels read (masked) slots past a row's length.
                self.keys.append(torch.zeros(rows, h, self.max_tokens, d, device=device, dtype=dtype))
                self.values.append(torch.zeros(rows, h, self.max_tokens, d, device=device, dtype=dtype))
        except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:
            self.keys, self.values = [], []
            raise MemoryError(f"{hint}, and allocating it failed ({type(e).__name__}); {fix}") from e
        self.lengths = torch.zeros(rows, dtype=torch.int32, device=device)

    def is_allocated_for(self, device: torch.device, dtype: torch.dtype) -> bool:
        return bool(self.keys) and self.keys[0].device == device and self.keys[0].dtype == dtype

    # -- sequence bookkeeping ------------------------------------------------------------------------------------

    def check_room(self, new_tokens: int, fresh: bool) -> None:
        """Raise ``ValueError`` naming max_out_tokens when ``new_tokens`` more would not fit. Changes nothing."""
        total = new_tokens + (0 if fresh else self.padded_len)
        if total > self.max_tokens:
            before = "" if fresh else f" after {self.padded_len} cached"
            raise ValueError(
                f"This call needs {total} cache slots ({new_tokens} new tokens{before}) but max_out_tokens="
                f"{self.max_tokens}: raise max_out_tokens in the inference config or shorten the request "
                "(max_out_tokens counts prompt plus generated tokens, padding included)."
            )

    def start(self, batch: int, device: torch.device, dtype: torch.dtype) -> None:
        """Begin a fresh sequence of ``batch`` rows: allocate (or grow) the buffers if needed and zero the lengths."""
        if batch > self.allocated_rows or not self.is_allocated_for(device, dtype):
            rows = max(batch, self.max_batch_size)
            if batch > self.max_batch_size:
                logger.warning(
                    "hf_dsinfer: batch %d is above max_batch_size=%d; re-allocating the static KV cache for %d rows "
                    "(set max_batch_size in the inference config to avoid this).",
                    batch,
                    self.max_batch_size,
                    rows,
                )
            self._allocate(rows, device, dtype)
        self.reset()
        self.batch = batch

    def reset(self) -> None:
        """Forget every sequence (buffers are kept): lengths to zero, adapters of the old sequence become stale."""
        if self.lengths is not None:
            self.lengths.zero_()
        self.padded_len = 0
        self.batch = 0
        self.epoch += 1

    def advance(self, new_real: torch.Tensor, width: int) -> None:
        """After a step: row ``b`` gained ``new_real[b]`` real tokens; the padded sequence grew by ``width``."""
        assert self.lengths is not None
        self.lengths[: new_real.shape[0]] += new_real.to(torch.int32)
        self.padded_len += width

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` buffers of layer ``idx``, each ``[Bmax, Hk, S, D]``."""
        return self.keys[idx], self.values[idx]

    def reorder(self, index: torch.Tensor) -> None:
        """Row ``b`` becomes old row ``index[b]`` (beam search); ``index`` has one entry per row in use."""
        assert self.lengths is not None
        n = index.shape[0]
        index = index.to(self.lengths.device)
        for buf in (*self.keys, *self.values):
            buf[:n] = buf.index_select(0, index)
        self.lengths[:n] = self.lengths.index_select(0, index)

    def release(self) -> None:
        """Free the buffers (they are allocated again on next use)."""
        self.keys, self.values, self.lengths = [], [], None
        self.reset()


class PagedKVCache:
    """The paged KV cache of continuous batching (``hf_dsinfer.serving``): per layer a pool of fixed-size blocks.

    Layer ``i`` holds ``k``/``v`` of shape ``[num_blocks, block_size, kv_heads[i], head_dims[i]]``; a block id means
    the same token slots in every layer. Which request owns which block is the serving block manager's business;
    this class only holds the buffers, allocated once (zeros) on first use.
    """

    def __init__(self, kv_heads: list[int], head_dims: list[int], num_blocks: int, block_size: int):
        self.kv_heads, self.head_dims = list(kv_heads), list(head_dims)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def nbytes_for(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(2 * self.num_blocks * self.block_size * h * d * elem for h, d in zip(self.kv_heads, self.head_dims))

    def allocate(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate the buffers on ``device`` in ``dtype`` unless they already are; raises ``MemoryError`` naming the
        settings to lower when they do not fit."""
        if self.keys and self.keys[0].device == device and self.keys[0].dtype == dtype:
            return
        need = self.nbytes_for(dtype)
        hint = (
            f"The paged KV cache of {self.num_blocks} blocks x {self.block_size} tokens needs {need / 2**30:.2f} GiB "
            f"({len(self.kv_heads)} layers, {dtype}) on {device}"
        )
        fix = "lower num_blocks (or max_out_tokens * max_batch_size, which size it by default)."
        free = _device_free_bytes(device)
        if free is not None and need > free:
            raise MemoryError(f"{hint}, but only {free / 2**30:.2f} GiB are available; {fix}")
        self.keys, self.values = [], []
        try:
            for h, d in zip(self.kv_heads, self.head_dims):
                self.keys.append(torch.zeros(self.num_blocks, self.block_size, h, d, device=device, dtype=dtype))
                self.values.append(torch.zeros(self.num_blocks, self.block_size, h, d, device=device, dtype=dtype))
        except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:
            self.keys, self.values = [], []
            raise MemoryError(f"{hint}, and allocating it failed ({type(e).__name__}); {fix}") from e

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` block pools of layer ``idx``, each ``[num_blocks, block_size, kv_heads, head_dim]``."""
        return self.keys[idx], self.values[idx]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into block ``dst`` in every layer (copy-on-write of a shared block)."""
        for buf in (*self.keys, *self.values):
            buf[dst].copy_(buf[src])

    def release(self) -> None:
        self.keys, self.values = [], []
