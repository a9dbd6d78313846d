"""The KV block pool with prefix caching, as vLLM V1's ``BlockPool`` keeps it.

A request holds one block per ``block_size`` tokens it has in the KV cache. A full block is
identified by a hash chained over the block's token ids and its parent's hash, so equal hashes
mean equal prefixes. Full blocks enter the cache when they are scheduled; when their last holder
lets go they stay cached but evictable, in least-recently-freed order, and count as free. A new
block comes from never-used blocks first, then by evicting the oldest evictable cached block.

Only the bookkeeping is modelled: blocks are counts and hashes, never memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

NO_HASH = 0  # parent of the first block


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    # Python hashes tuples of ints the same way in every process (no per-process salt).
    return hash((parent, tuple(tokens)))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.in_use = 0  # blocks held by at least one request
        self._refs: dict[int, int] = {}  # hash of a cached block -> number of holders
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, no holder; LRU first
        # What vLLM's KV events would say (``kv_events.py`` publishes them), when asked for:
        # ("stored", hashes, parent or None, token ids), ("removed", hashes), ("cleared",).
        self.events: list[tuple[Any, ...]] | None = None

    @property
    def free(self) -> int:
        """Blocks a request can get now: never used, or cached and evictable."""
        return self.num_blocks - self.in_use

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: 1 - free / total (evictable cached blocks are free)."""
        return self.in_use / self.num_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._refs)

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are in the cache."""
        if not self.caching:
            return 0
        n = 0
        for h in hashes:
            if h not in self._refs:
                break
            n += 1
        return n

    def cost_of_hits(self, hashes: Sequence[int]) -> int:
        """Free blocks that taking these cached blocks would use up (the evictable ones)."""
        return sum(1 for h in hashes if self._refs.get(h) == 0)

    def take_cached(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            refs = self._refs[h]
            if refs == 0:
                del self._evictable[h]
                self.in_use += 1
            self._refs[h] = refs + 1

    def allocate(self, n: int) -> bool:
        """Take ``n`` fresh blocks, evicting cached ones if needed; False if too few are free."""
        if n > self.free:
            return False
        never_used = self.num_blocks - self.in_use - len(self._evictable)
        evicted = []
        for _ in range(n - min(n, never_used)):
            h, _ = self._evictable.popitem(last=False)
            del self._refs[h]
            evicted.append(h)
        if evicted and self.events is not None:
            self.events.append(("removed", evicted))
        self.in_use += n
        return True

    def register(self, h: int) -> bool:
        """A held, freshly filled block becomes cached under ``h``; False if ``h`` already is
        (then this block stays a private duplicate, as in vLLM)."""
        if not self.caching or h in self._refs:
            return False
        self._refs[h] = 1
        return True

    def release(self, blocks: Sequence[int | None]) -> None:
        """Let go of a request's blocks (a hash for a cached block, None for a private one).

        Freed in reverse so that a prefix's tail is evicted before its head, as vLLM does.
        """
        for h in reversed(blocks):
            if h is None:
                self.in_use -= 1
                continue
            refs = self._refs[h] - 1
            self._refs[h] = refs
            if refs == 0:
                self._evictable[h] = None
                self.in_use -= 1

    def reset(self) -> None:
        """Drop every cached block (nothing may be held)."""
        self._refs.clear()
        self._evictable.clear()
        self.in_use = 0
        if self.events is not None:
            self.events.append(("cleared",))
