"""A replica's real prefix cache, from vLLM's KV cache events: the blocks it holds, keyed so
that a request's token ids can be matched against them. Pure: no sockets, no clock.

vLLM (``--kv-events-config``) publishes, per scheduler step, a batch of events over ZMQ
(``proxy.fleet.kv_events`` subscribes): ``BlockStored`` when full blocks enter its prefix
cache (their engine hashes, the parent block's hash, the blocks' token ids, the block size),
``BlockRemoved`` when cached blocks are evicted, ``AllBlocksCleared`` on a cache reset.

An engine hash cannot be computed here: vLLM seeds it at random per process unless
``PYTHONHASHSEED`` is set, and its algorithm is configurable. So each stored block is keyed
again, by the gateway, from its token ids chained to its parent's key (``token_block_keys``),
and a map from engine hash to key serves ``BlockRemoved``, which carries only engine hashes. A
request's token ids, cut into the same blocks and keyed the same way, then match exactly the
blocks the replica holds, whatever its hash seed or algorithm.

Both encodings vLLM has used are read (``decode_batch``): the batch is a positional array
``[ts, events, data_parallel_rank]``; each event is either a tagged positional array
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, ...]``, vLLM before
0.26) or a map with a ``type`` key (since). Block hashes are ints (the default) or bytes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvBlockSet",
    "decode_batch",
    "token_block_keys",
]

EngineHash = int | bytes
_ROOT = b"\0" * 8


def token_block_keys(
    token_ids: Sequence[int], block_size: int, parent: bytes = _ROOT, max_blocks: int | None = None
) -> list[bytes]:
    """Chained keys of the full ``block_size`` blocks of ``token_ids`` (vLLM caches full blocks
    only). The same function keys a replica's stored blocks and a request's prompt."""
    if block_size < 1:
        raise ValueError("block_size must be positive")
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    keys = []
    for i in range(n):
        block = array("Q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        parent = blake2b(block, digest_size=8, key=parent).digest()
        keys.append(parent)
    return keys


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[EngineHash]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared

# Positional fields of each event after its tag, in vLLM's declaration order (the ones read).
_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _event(raw: Any) -> Event | None:
    """One decoded event, or None for a kind this gateway does not use (a connector's own)."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, (list, tuple)) and raw:
        kind = raw[0]
        names = _FIELDS.get(kind, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise ValueError(f"an event is neither a map nor a tagged array: {raw!r:.80}")
    if kind == "BlockStored":
        return BlockStored(
            list(fields["block_hashes"]),
            fields.get("parent_block_hash"),
            list(fields["token_ids"]),
            int(fields["block_size"]),
            fields.get("lora_id"),
            fields.get("medium"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(list(fields["block_hashes"]), fields.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(batch: Any) -> list[Event]:
    """The events of one decoded msgpack batch (``[ts, events, dp_rank]``), either encoding.
    ``ValueError`` (or ``KeyError``/``TypeError``, which the caller treats alike) for junk."""
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        raise ValueError(f"a batch is [ts, events, ...]: {batch!r:.80}")
    return [e for e in (_event(raw) for raw in batch[1]) if e is not None]


GPU_MEDIA = (None, "GPU")  # what the engine's own prefix cache holds (not an offload tier)


class KvBlockSet:
    """One replica's cached blocks as its events describe them.

    Only the GPU prefix cache counts (a connector's CPU or disk tier reports its own medium),
    and only base-model blocks (a LoRA adapter's blocks never serve a base-model prompt, and a
    request's adapter is not part of its key here). vLLM may hold several physical copies of one
    block hash (computed at the same time by two requests) and removes each copy with its own
    event, so copies are counted per hash."""

    __slots__ = ("_by_engine", "_copies", "_keys", "block_size", "orphans", "speculative")

    def __init__(self) -> None:
        self._by_engine: dict[EngineHash, bytes] = {}
        self._copies: dict[EngineHash, int] = {}  # only hashes held more than once
        self._keys: dict[bytes, int] = {}  # key -> engine hashes holding it (duplicates: >1)
        self.block_size = 0  # learnt from the first BlockStored
        self.orphans = 0  # stored blocks whose parent was never seen (missed events)
        # key -> until (the caller's clock): blocks a pick just sent there, before their
        # BlockStored arrives (the prefill takes a while; a burst must see its own placements).
        self.speculative: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            if event.medium not in GPU_MEDIA:
                return
            for h in event.block_hashes:
                copies = self._copies.get(h)
                if copies is not None:  # one copy of several goes; the hash stays held
                    if copies > 2:
                        self._copies[h] = copies - 1
                    else:
                        del self._copies[h]
                    continue
                key = self._by_engine.pop(h, None)
                if key is not None:
                    left = self._keys[key] - 1
                    if left:
                        self._keys[key] = left
                    else:
                        del self._keys[key]
        else:
            self.clear()

    def _stored(self, event: BlockStored) -> None:
        if event.medium not in GPU_MEDIA or event.lora_id is not None:
            return
        bs = event.block_size
        if bs < 1:
            raise ValueError(f"block_size {bs}")
        self.block_size = bs
        parent = _ROOT
        if event.parent_block_hash is not None:
            known = self._by_engine.get(event.parent_block_hash)
            if known is None:  # joined late or lost a batch: these blocks cannot be chained
                self.orphans += len(event.block_hashes)
                return
            parent = known
        keys = token_block_keys(event.token_ids, bs, parent, len(event.block_hashes))
        for h, key in zip(event.block_hashes, keys, strict=False):
            if h in self._by_engine:
                self._copies[h] = self._copies.get(h, 1) + 1
                continue
            self._by_engine[h] = key
            self._keys[key] = self._keys.get(key, 0) + 1

    def clear(self) -> None:
        self._by_engine.clear()
        self._copies.clear()
        self._keys.clear()
        self.speculative.clear()

    def match(self, keys: Sequence[bytes], now: float) -> int:
        """How many leading blocks of ``keys`` the replica holds (or was just sent)."""
        held, spec = self._keys, self.speculative
        n = 0
        for key in keys:
            if key in held:
                n += 1
                continue
            until = spec.get(key)
            if until is None or until < now:
                break
            n += 1
        return n

    def speculate(self, keys: Sequence[bytes], now: float, ttl_s: float) -> None:
        """Count ``keys`` as held until ``now + ttl_s`` (or their BlockStored)."""
        spec = self.speculative
        if len(spec) > 4096:  # bounded: expired entries go first
            for k in [k for k, t in spec.items() if t < now]:
                del spec[k]
        until = now + ttl_s
        for key in keys:
            spec[key] = until
