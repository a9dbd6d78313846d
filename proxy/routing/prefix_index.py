"""Which prompt prefixes each replica has recently served: chained block hashes with LRU eviction.

vLLM caches a prompt's KV in fixed blocks and names each full block by a hash chained over the
block's tokens and its parent's hash, so two prompts share a cached block only when they share
everything before it too. The gateway has no token ids for most requests (it would need the
model's tokenizer), so it cuts the rendered prompt text into blocks of a fixed number of
characters (tokens per block x the policy's characters per token) and chains them the same way.
A text block is not a vLLM block, but "the first k text blocks match" implies "about the first
k x block_tokens tokens match", which is all routing needs.

The index of one replica is an insertion-ordered dict used as an LRU: touching a prompt moves
its blocks to the recent end, head last, so that under pressure a prefix's tail goes before its
head, as vLLM frees a finished request's blocks tail first. Its size is bounded by the replica's
KV capacity in blocks: the index never claims more than the replica could hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

__all__ = ["ENTRY_BYTES", "PrefixIndex", "text_block_hashes"]

# Measured with tracemalloc (tests/test_cache_aware_index.py checks it): one entry of the
# OrderedDict with its 64-bit int key (key object, table slot, linked-list node), ~141 B.
# Used for the index-size metric.
ENTRY_BYTES = 144


def text_block_hashes(text: str, block_chars: int, max_blocks: int | None = None) -> list[int]:
    """Chained 64-bit hashes of the full ``block_chars``-sized blocks of ``text``.

    Only full blocks count (vLLM caches only full blocks). blake2b, never Python's salted
    ``hash()``: every process and every gateway instance computes the same chain.
    """
    if block_chars < 1:
        raise ValueError("block_chars must be positive")
    n = len(text) // block_chars
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[int] = []
    parent = b"\0" * 8
    data = text.encode("utf-8", "surrogatepass") if text.isascii() else None
    for i in range(n):
        if data is not None:
            chunk = data[i * block_chars : (i + 1) * block_chars]
        else:
            chunk = text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        parent = blake2b(chunk, digest_size=8, key=parent).digest()
        out.append(int.from_bytes(parent, "little"))
    return out


class PrefixIndex:
    """One replica's recently served blocks, at most ``capacity`` of them, least recent evicted."""

    __slots__ = ("_blocks", "capacity", "evictions")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least one block")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` this replica holds (the longest prefix)."""
        blocks = self._blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[int]) -> None:
        """Record that the replica now holds these blocks, most recently used; evict past capacity.

        Touched tail first so the head ends up most recent: a prefix shared by many prompts
        outlives their private tails.
        """
        blocks = self._blocks
        move = blocks.move_to_end
        for h in reversed(hashes):
            if h in blocks:
                move(h)
            else:
                blocks[h] = None
        self._evict()

    def resize(self, capacity: int) -> None:
        """A new capacity (the replica reported its KV size); shrinking evicts at once."""
        if capacity < 1:
            raise ValueError("capacity must be at least one block")
        self.capacity = capacity
        self._evict()

    def blocks(self) -> list[int]:
        """Every block, least recently used first."""
        return list(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()

    def _evict(self) -> None:
        blocks = self._blocks
        extra = len(blocks) - self.capacity
        if extra > 0:
            self.evictions += extra
            pop = blocks.popitem
            for _ in range(extra):
                pop(last=False)

    @property
    def nbytes(self) -> int:
        """Approximate memory held: one measured entry per block."""
        return ENTRY_BYTES * len(self._blocks)
