"""The block manager of the paged KV cache: free list, reference counts, prefix sharing, copy-on-write.

The cache is a pool of ``num_blocks`` blocks of ``block_size`` token slots (every layer has its own pool with the
same block ids, :class:`~hf_dsinfer.modules.kv_cache.PagedKVCache`). A request holds a block table: its blocks in
order, token ``j`` in block ``table[j // block_size]`` at offset ``j % block_size``.

Prefix sharing. A block whose tokens are all computed gets a content key: a 128-bit digest of the key of the block
before it and its own token ids, so equal keys mean equal token prefixes, hence equal KV. Registered blocks are
immutable and found by key: a new request whose prompt starts with the same blocks takes them (reference count + 1)
instead of computing them. The last, partial block of a prompt is registered too (its key covers its tokens only),
so N requests with one prompt compute it once. Whoever writes into a block that is registered or held by someone
else gets a private copy first (copy-on-write): this happens at the first block a request computes, when it shares
the block that holds its first uncomputed position.

Freeing. A block whose count drops to zero goes back to the free list, unless it is registered: then it stays
cached (its KV is still valid) in least-recently-freed order, and is reclaimed only when the free list is empty, so
a prompt seen again later (the next ``generate_batch`` call, a server's system prompt) is found again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable

import torch


class OutOfBlocks(RuntimeError):
    """No free or reclaimable block is left (the scheduler preempts a request and retries)."""


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """Content key of a block holding ``tokens`` after the prefix whose last block has key ``parent`` (b"" first)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    h.update(len(tokens).to_bytes(4, "little"))  # a partial block never collides with a full one
    return h.digest()


def prefix_keys(tokens: list[int], block_size: int, root: bytes = b"") -> list[bytes]:
    """Keys of the blocks covering ``tokens`` (the last one partial if ``len(tokens)`` is not a multiple).

    ``root``: what else the KV depends on (a LoRA adapter's key): equal tokens under other roots never share."""
    keys, parent = [], root
    for start in range(0, len(tokens), block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


class BlockManager:
    """Allocation, reference counts and the prefix table of ``num_blocks`` blocks of ``block_size`` slots.

    ``copy_block(src, dst)`` copies one block's KV in every layer (the copy-on-write callback of the cache).
    """

    def __init__(self, num_blocks: int, block_size: int, copy_block: Callable[[int, int], None] | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.copy_block = copy_block
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()  # registered, count 0: reclaimable, oldest first
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.copies = 0  # copy-on-write events since the last read (the engine's stats take and reset it)

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now (free, or cached and reclaimable)."""
        return len(self.free) + len(self.cached)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- allocation ------------------------------------------------------------------------------------------------

    def allocate(self) -> int:
        """A block with count 1 (a free one, else the least recently freed cached one, forgotten)."""
        if self.free:
            block = self.free.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.by_key[self.key_of.pop(block)]
        else:
            raise OutOfBlocks("the paged KV cache has no free block")
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more holder of ``block`` (a cached block leaves the reclaimable set)."""
        if self.refs[block] == 0:
            self.cached.pop(block, None)
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; at zero the block is cached (registered) or free."""
        if self.refs[block] <= 0:
            raise RuntimeError(f"block {block} released more often than taken (internal error)")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.key_of:
                self.cached[block] = None
            else:
                self.free.append(block)

    def release_all(self, table: list[int]) -> None:
        # Last blocks first, so a reclaim takes a prompt's tail before its head (the head is the likelier shared part).
        for block in reversed(table):
            self.release(block)
        table.clear()

    def writable(self, block: int) -> int:
        """``block`` itself if its only holder may write it, else a private copy (the caller's hold moves to it)."""
        if self.refs[block] == 1 and block not in self.key_of:
            return block
        copy = self.allocate()
        if self.copy_block is not None:
            self.copy_block(block, copy)
        self.release(block)
        self.copies += 1
        return copy

    # -- prefix sharing --------------------------------------------------------------------------------------------

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The registered blocks matching the leading ``keys`` (stops at the first miss)."""
        found = []
        for key in keys:
            block = self.by_key.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def register(self, block: int, key: bytes) -> None:
        """Make ``block`` (fully computed for ``key``'s tokens) findable; a key registered already keeps its block."""
        if key in self.by_key or block in self.key_of:
            return
        self.by_key[key] = block
        self.key_of[block] = key

    def forget_cached(self) -> None:
        """Free every cached (unheld) block and forget its key; blocks still held keep theirs."""
        while self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.by_key[self.key_of.pop(block)]
            self.free.append(block)

    def check(self) -> None:
        """Internal consistency (tests): every block is exactly one of held, cached or free."""
        held = {b for b, r in enumerate(self.refs) if r > 0}
        free, cached = set(self.free), set(self.cached)
        assert len(free) == len(self.free), "a block is twice in the free list"
        assert not (held & free) and not (held & cached) and not (free & cached), "a block is in two states"
        assert len(held) + len(free) + len(cached) == self.num_blocks, "a block is lost"
        assert all(b in self.key_of for b in cached), "a cached block is not registered"
