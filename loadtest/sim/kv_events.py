"""vLLM's KV cache events, published from the simulator's block pool as vLLM publishes them.

Enabled with vLLM's own flag, ``--kv-events-config '{"enable_kv_cache_events": true,
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}'``
(``vllm/config/kv_events.py``: ``publisher`` "zmq", ``buffer_steps`` 10,000). One extra key,
``"encoding"``, picks the events' msgpack shape: ``"map"`` (each event a map with a ``type``
tag, vLLM since 0.26) or ``"array"`` (a tagged positional array, vLLM before); the batch is a
positional array ``[ts, events, data_parallel_rank]`` in both.

Wire (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): every engine step that changed
the cache sends one 3-frame message ``[topic, seq (8 bytes, big-endian), payload]`` on a PUB
socket; the last ``buffer_steps`` batches are kept. A client that sends a start seq (8 bytes,
big-endian) to the ROUTER replay socket gets ``[b"", seq, payload]`` for every kept batch from
that seq on, then ``[b"", END_SEQ, b""]`` with ``END_SEQ = -1``.

Engine block hashes are ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default: the last 8
bytes of the digest). vLLM seeds its hashes at random per process unless ``PYTHONHASHSEED`` is
set, so equal prefixes on two replicas, or on one replica across a restart, get different
hashes; the simulator does the same (a random salt per engine), so a consumer that relied on
hashes agreeing across replicas would fail here as it would against vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from .settings import KvEventsOptions

log = logging.getLogger("sim.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MASK64 = 2**64 - 1


def encode_batch(
    events: Sequence[tuple[Any, ...]], block_size: int, salt: int, encoding: str, ts: float
) -> bytes:
    """One step's pool events as vLLM's msgpack ``KVEventBatch``."""

    def engine(h: int) -> int:
        return hash((salt, h)) & MASK64

    out: list[Any] = []
    for ev in events:
        if ev[0] == "stored":
            _, hashes, parent, tokens = ev
            fields = {
                "block_hashes": [engine(h) for h in hashes],
                "parent_block_hash": None if parent is None else engine(parent),
                "token_ids": tokens,
                "block_size": block_size,
                "lora_id": None,
                "medium": "GPU",
            }
            tag = "BlockStored"
        elif ev[0] == "removed":
            fields = {"block_hashes": [engine(h) for h in ev[1]], "medium": "GPU"}
            tag = "BlockRemoved"
        else:
            fields, tag = {}, "AllBlocksCleared"
        if encoding == "map":
            out.append({"type": tag, **fields})
        else:  # positional, trailing defaults (None) omitted as msgspec's omit_defaults does
            values = list(fields.values())
            while values and values[-1] is None:
                values.pop()
            out.append([tag, *values])
    return msgspec.msgpack.encode([ts, out, 0])


class KvEventPublisher:
    """The PUB socket, the replay ROUTER and the kept batches of one simulated replica."""

    def __init__(self, options: KvEventsOptions, block_size: int) -> None:
        self.options = options
        self.block_size = block_size
        self.salt = secrets.randbits(64)  # a new engine's hashes differ, as vLLM's do
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(options.endpoint)
        self.replay: zmq.asyncio.Socket | None = None
        if options.replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.bind(options.replay_endpoint)
        self.topic = options.topic.encode()
        self.seq = 0
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=options.buffer_steps)
        self.published = 0
        self.drop_next = 0  # tests: lose this many batches (a gap the subscriber must see)
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        """Where the PUB socket listens (a port 0 resolved)."""
        return str(self.pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def replay_address(self) -> str | None:
        if self.replay is None:
            return None
        return str(self.replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def start(self) -> None:
        if self.replay is not None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def new_engine(self, restarted: bool = False) -> None:
        """A new engine core hashes with a new seed; a restarted one (a crash) also numbers
        its batches from 0 again and has kept nothing, as a restarted vLLM does."""
        self.salt = secrets.randbits(64)
        if restarted:
            self.seq = 0
            self.kept.clear()

    def publish(self, events: Sequence[tuple[Any, ...]]) -> None:
        payload = encode_batch(
            events, self.block_size, self.salt, self.options.encoding, time.time()
        )
        seq = self.seq
        self.seq += 1
        self.kept.append((seq, payload))
        if self.drop_next:
            self.drop_next -= 1
            return
        with contextlib.suppress(zmq.Again):
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        self.published += 1

    async def _serve_replay(self) -> None:
        assert self.replay is not None
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request: %r", frames)
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.kept):
                if seq >= first:
                    await self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            await self.replay.send_multipart([client, b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        self.ctx.term()
