"""Precise ``cache_aware`` routing: each replica's KV cache events, subscribed to, and a prompt's
token ids, asked of a replica. The block sets themselves are ``proxy.routing.kv_blocks``.

A replica of a ``cache_aware`` pool with ``kv_events`` set (vLLM started with
``--kv-events-config``) gets one ``KvEventFeed``: a ZMQ SUB socket on its endpoint, applying
each batch to the replica's ``KvBlockSet`` (msgpack decoded with msgspec). Every worker of a
serve subscribes for itself, so each holds the replica's real block set; nothing needs sharing.

Sequence numbers are checked. A gap is filled from the replay socket when the replica has one
(``kv_events_replay``: a start seq sent to its ROUTER, the kept batches streamed back up to an
end marker); a gap that cannot be filled clears the set, since blocks stored in a lost batch
would otherwise be missing and those removed in it kept. A feed with a replay socket also asks
for everything kept when it starts, so a gateway that starts beside a warm replica knows its
cache at once.

When events stop (a request was sent to the replica ``events_stale_s`` ago and no batch came
since), the replica is routed on the approximate index instead (``tokenlane_kv_events_up`` 0)
until batches flow again; after a gap that could not be filled, for ``events_stale_s`` while the
set refills. The approximate index is kept up to date all along, so the fallback is warm.

A prompt's token ids come from a replica's render endpoint (vLLM's
``/v1/chat/completions/render`` and ``/v1/completions/render``, which tokenize with the model's
own chat template), asked once per request, bounded by ``render_timeout_s``; without them (a
timeout, an error, an API without a render route) the request is routed approximately.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from proxy.relay.upstream import UpstreamClient, fetch
from proxy.routing.kv_blocks import KvBlockSet, decode_batch
from proxy.tasks import end_if_cancelled

if TYPE_CHECKING:
    from proxy.fleet.fleet import Fleet, Replica
    from proxy.observe.metrics import Metrics
    from proxy.relay.call import Call

log = logging.getLogger("tokenlane.kv_events")

END_SEQ = -1
REPLAY_TIMEOUT_S = 2.0
RENDER_PATHS = {"chat": "/v1/chat/completions/render", "completion": "/v1/completions/render"}
_decode = msgspec.msgpack.Decoder().decode


class KvEventFeed:
    """One replica's events: the subscription, the sequence, the block set."""

    def __init__(
        self,
        pool: str,
        name: str,
        endpoint: str,
        replay: str | None,
        topic: str,
        ctx: zmq.asyncio.Context,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool, self.name = pool, name
        self.endpoint, self.replay, self.topic = endpoint, replay, topic
        self.ctx = ctx
        self.metrics = metrics
        self.clock = clock
        self.blocks = KvBlockSet()
        self.last_seq: int | None = None
        self.batches = 0
        self.gaps_replayed = 0
        self.gaps_lost = 0
        self.lost_at: float | None = None  # when a gap could not be filled (the set restarted)
        self.orphans_at: float | None = None  # when stored blocks last came with unknown parents
        self.restarts = 0  # the replica's sequence started over (a restarted engine)
        self.replay_max: int | None = None  # last seq a replay applied, until the stream passes
        self.stopped = False
        self.waiting_since: float | None = None  # first request sent with no batch since
        self._task: asyncio.Task[None] | None = None
        self._applied = asyncio.Event()  # tests: set after every batch applied

    def key(self) -> tuple[str, str, str, str | None, str]:
        return (self.pool, self.name, self.endpoint, self.replay, self.topic)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kv events {self.name}"
        )

    def cancel(self) -> asyncio.Task[None] | None:
        """Stop applying at once; the task to await for the sockets to close."""
        self.stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        return task

    async def stop(self) -> None:
        task = self.cancel()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- what routing asks ---------------------------------------------------------------------

    def live(self, now: float, stale_s: float) -> bool:
        """Whether the block set can be trusted now."""
        if self.lost_at is not None and now - self.lost_at < stale_s:
            return False  # refilling after a lost gap: the approximate index knows more
        if self.orphans_at is not None and now - self.orphans_at < stale_s:
            # Blocks extend prefixes stored before this feed saw them (joined late, a lost
            # batch): the set lacks those prefixes, which may be the hottest ones.
            return False
        return self.waiting_since is None or now - self.waiting_since < stale_s

    def sent(self, now: float) -> None:
        """A request went to the replica: its events should follow."""
        if self.waiting_since is None:
            self.waiting_since = now

    # -- the subscription ----------------------------------------------------------------------

    async def _run(self) -> None:
        """The subscription, restarted after any failure (a bug or a broken socket must not
        leave the replica without events for good)."""
        backoff = 0.1
        while not self.stopped:
            try:
                await self._subscribe()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception(
                    "kv events %s: subscription failed; again in %.1fs", self.name, backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    async def _subscribe(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.setsockopt(zmq.LINGER, 0)
        try:
            sub.connect(self.endpoint)
            if self.replay is not None:
                await self._replay_from(0, None)  # what the replica kept before we came
            while True:
                # A cancel lost in a replay (``proxy/tasks.py``: its timeout's TimeoutError,
                # caught there) ends the subscription here, not in a wait for the next batch.
                end_if_cancelled()
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    log.warning("kv events %s: a message of %d frames", self.name, len(frames))
                    continue
                await self._received(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)

    async def _received(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if self.replay_max is not None and seq > self.replay_max:
            self.replay_max = None  # past what the replay gave: no duplicate can follow
        if last is not None and seq <= last:
            if self.replay_max is not None:
                return  # the stream catching up with batches the replay already applied
            # The sequence started over: a restarted engine, whose cache is empty and whose
            # block hashes are new. Forget the old set and take what it kept from the start.
            self.restarts += 1
            self.blocks.clear()
            self.last_seq = last = None
            log.info("kv events %s: the replica's sequence restarted", self.name)
            if self.replay is not None:
                await self._replay_from(0, None)
                if self.last_seq is not None:
                    return
        if last is not None and seq > last + 1:
            filled = self.replay is not None and await self._replay_from(last + 1, seq)
            if filled:
                self.gaps_replayed += 1
            else:
                self.gaps_lost += 1
                self.blocks.clear()  # what the lost batches stored or removed is unknown
                self.lost_at = self.clock()
                log.warning("kv events %s: batches %d-%d lost", self.name, last + 1, seq - 1)
            self._count_gap("replayed" if filled else "lost")
        self._apply(seq, payload)

    async def _replay_from(self, start: int, until: int | None) -> bool:
        """Apply the replica's kept batches from ``start`` (below ``until``); True when every
        batch from ``start`` to ``until`` came back."""
        assert self.replay is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        got: list[int] = []
        try:
            dealer.connect(self.replay)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await dealer.recv_multipart()
                    # [b"", seq, payload] (vLLM), or [b"", topic, seq, payload] (newer senders)
                    if len(frames) < 3:
                        log.warning(
                            "kv events %s: a replay reply of %d frames", self.name, len(frames)
                        )
                        return False
                    seq = int.from_bytes(frames[-2], "big", signed=True)
                    if seq == END_SEQ:
                        break
                    if (until is not None and seq >= until) or (
                        self.last_seq is not None and seq <= self.last_seq
                    ):
                        continue
                    self._apply(seq, frames[-1])
                    got.append(seq)
                    self.replay_max = seq
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("kv events %s: replay from %d failed: %r", self.name, start, exc)
            return False
        finally:
            dealer.close(linger=0)
        return until is None or got == list(range(start, until))

    def _apply(self, seq: int, payload: bytes) -> None:
        if self.stopped:
            return
        self.last_seq = seq
        try:
            events = decode_batch(_decode(payload))
        except (ValueError, KeyError, TypeError, msgspec.DecodeError) as exc:
            log.warning("kv events %s: batch %d unreadable: %s", self.name, seq, exc)
            return
        orphans = self.blocks.orphans
        for event in events:
            try:
                self.blocks.apply(event)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("kv events %s: an event of batch %d ignored: %s", self.name, seq, exc)
        if self.blocks.orphans > orphans:
            self.orphans_at = self.clock()
        self.batches += 1
        self.waiting_since = None
        if self.metrics is not None:
            self.metrics.series(self.metrics.kv_event_batches, self.pool, self.name).inc()
        self._applied.set()

    def _count_gap(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.series(self.metrics.kv_event_gaps, self.pool, self.name, outcome).inc()


class KvEventFeeds:
    """The fleet's feeds: one per replica with ``kv_events`` in a ``cache_aware`` pool, kept in
    step with the policy (``sync`` at start and after each reload)."""

    def __init__(self, fleet: Fleet, metrics: Metrics | None = None) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.by_replica: dict[tuple[str, str], KvEventFeed] = {}  # (pool, url) -> feed
        self._ctx: zmq.asyncio.Context | None = None
        self.started = False
        self.pools: set[str] = set()  # pools with a feed (the request path asks, per request)
        self._stopping: set[asyncio.Task[None]] = set()  # feeds cancelled by a reload

    def start(self) -> None:
        self.started = True
        self.sync()

    def sync(self) -> None:
        """Start feeds for new replicas, stop those of replicas gone (on the loop; nothing
        before ``start``)."""
        if not self.started:
            return
        wanted: dict[tuple[str, str], Replica] = {}
        for pool in self.fleet.pools.values():
            if pool.config.balance != "cache_aware":
                continue
            for r in pool.replicas:
                if r.config.kv_events:
                    wanted[(r.pool, r.url)] = r
        for key in [k for k in self.by_replica if k not in wanted]:
            feed = self.by_replica.pop(key)
            self._retire(feed)
            if self.metrics is not None:
                self.metrics.forget_kv_events(feed.pool, feed.name)
        for key, r in wanted.items():
            cfg = r.config
            kv_events = cfg.kv_events
            assert kv_events is not None
            old = self.by_replica.get(key)
            new_key = (r.pool, r.name, kv_events, cfg.kv_events_replay, cfg.kv_events_topic)
            if old is not None and old.key() == new_key:
                continue
            if old is not None:
                self._retire(old)
                if self.metrics is not None and old.name != r.name:
                    self.metrics.forget_kv_events(old.pool, old.name)
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            feed = KvEventFeed(
                r.pool, r.name, kv_events, cfg.kv_events_replay, cfg.kv_events_topic,
                self._ctx, self.metrics,
            )  # fmt: skip
            self.by_replica[key] = feed
            if self.metrics is not None:  # born at 0: rate() sees the first batch and gap
                m = self.metrics
                m.series(m.kv_event_batches, r.pool, r.name)
                for outcome in ("replayed", "lost"):
                    m.series(m.kv_event_gaps, r.pool, r.name, outcome)
            feed.start()
        self.pools = {pool for pool, _ in self.by_replica}

    def _retire(self, feed: KvEventFeed) -> None:
        task = feed.cancel()
        if task is not None:
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    async def stop(self) -> None:
        self.started = False
        self.pools = set()
        feeds, self.by_replica = list(self.by_replica.values()), {}
        for feed in feeds:
            self._retire(feed)
        # Every socket closed before the context ends (``term`` waits for them, blocking).
        if self._stopping:
            await asyncio.wait(list(self._stopping))
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def feed(self, replica: Replica) -> KvEventFeed | None:
        return self.by_replica.get((replica.pool, replica.url))

    def wanted_for(self, pools: Iterable[str | None]) -> bool:
        """Whether a request routed in these pools could use token ids."""
        return bool(self.pools) and any(p in self.pools for p in pools)

    def refresh_gauges(self) -> None:
        if self.metrics is None:
            return
        now = time.monotonic()
        pools = self.fleet.pools
        for feed in self.by_replica.values():
            pool = pools.get(feed.pool)
            if pool is None:  # a reload in progress: synced at its end
                continue
            up = feed.live(now, pool.config.cache_aware.events_stale_s)
            self.metrics.series(self.metrics.kv_events_up, feed.pool, feed.name).set(int(up))


class PromptTokens:
    """Fills ``Call.prompt_token_ids`` for requests a precise pool may route (the relay asks
    ``wanted``, on every request and without awaiting, then calls ``fill`` once before
    admission)."""

    def __init__(self, feeds: KvEventFeeds, client: UpstreamClient) -> None:
        self.feeds = feeds
        self.client = client

    def wanted(self, call: Call) -> bool:
        lane = call.lane
        return call.kind in RENDER_PATHS and self.feeds.wanted_for((lane.pool, lane.spill_to))

    async def fill(self, call: Call) -> None:
        lane = call.lane
        pool = self.feeds.fleet.pools.get(lane.pool)
        if pool is None:
            return
        candidates = pool.candidates(call.model)
        if not candidates:
            return
        renderer = min(candidates, key=lambda r: r.load)
        timeout_s = pool.config.cache_aware.render_timeout_s
        call.prompt_token_ids = await render_token_ids(self.client, renderer, call, timeout_s)


async def render_token_ids(
    client: UpstreamClient, replica: Replica, call: Call, timeout_s: float
) -> list[int] | None:
    """The prompt's token ids as ``replica`` tokenizes it (its render route), or None: a
    render that fails in any way, or takes longer than ``timeout_s`` in all, only costs the
    request its precise match, never its answer (cancellation, a client leaving, still ends
    it)."""
    path = RENDER_PATHS.get(call.kind)
    if path is None:
        return None
    headers = {"authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}
    try:
        body = call.fields if call.fields is not None else json.loads(call.body)
        async with asyncio.timeout(timeout_s):
            r = await fetch(
                client, "POST", replica.url + path, headers=headers, timeout_s=timeout_s,
                json=body,
            )  # fmt: skip
        if r.status_code != 200:
            return None
        data: Any = r.json()
    except Exception as exc:  # not BaseException: cancellation goes on up
        log.debug("render on %s failed: %r", replica.name, exc)
        return None
    item = data[0] if isinstance(data, list) and data else data
    ids = item.get("token_ids") if isinstance(item, dict) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        return None
    return ids


__all__ = ["KvEventFeed", "KvEventFeeds", "PromptTokens", "render_token_ids"]
