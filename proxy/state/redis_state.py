"""Shared state in Redis (``redis.url`` set): instances share three things, none of them on
the request path.

- **Replica states** (ejections, readmissions, drains, operator actions). Every transition is
  written to one hash, a record per replica, by a Lua script (``scripts.MERGE_RECORD``) that
  also publishes the record on a channel. The record, not the message, is the truth: pub/sub
  drops messages during any reconnect gap, so every instance also reads the whole hash every
  ``reconcile_s`` and applies what is newer than what it has. The newest *transition* wins, not
  the latest write: each record carries ``changed_at``, the Unix time its instance made the
  transition, and the script refuses a write whose transition is older than the stored one's
  (and answers with the stored record, which the writer adopts). Otherwise an instance cut off
  from Redis would, on its re-sync, write the transitions it made during the outage over newer
  ones made elsewhere. ``updated_at``, stamped by the script from the Redis server's clock,
  orders what readers apply. The script counts ejections (so the count, and with it the
  backoff, is shared) and lets an ejection that already stands win over a second one of the
  same replica: two instances that see the same stall at once make one ejection, not two.
- **Load**: each instance writes its per-replica in-flight counts to its own hash, rewritten
  every ``heartbeat_s`` with a ``ttl_s`` expiry, so a crashed instance's counts vanish by
  themselves. A background loop sums the other live instances' hashes (``codec.sum_load``) into
  a view that the balancer reads from memory.
- **Rate limits**: ``LeasedRateLimiter`` (``leases``) decides from local stock; the lease loop
  here refills that stock in batches leased from token buckets kept in Redis.

Redis slow or down (the calls and the breaker: ``redislink``): every call is bounded by
``redis.timeout_ms``. Two failed calls in a row open the breaker (``tokenlane_shared_state_up``
0, one log line): the instance goes on with its local view and local rate limits, and a probe
every ``PROBE_S`` looks for Redis. When it answers, the instance re-syncs (its unwritten
transitions, its known records if Redis lost them, its load) before it trusts the shared view
again, and says so in one log line.

Keys (prefix ``tokenlane``): ``{p}:replicas`` (hash: ``"{pool} {url}"`` → record JSON),
``{p}:replicas:changed`` (channel), ``{p}:instances`` (set of instance ids),
``{p}:inflight:{instance}`` (hash: url → count, ``_at``), ``{p}:rl:{limit}:{key id}`` (bucket),
``{p}:resp:{response id}`` (the URL of the replica holding a stored Responses-API response,
expiring after the homes' TTL; written in the background, read only for an id the instance
does not know), ``{p}:placed`` (channel: ``cache_aware`` placements, published in batches as
the write loop gets to them; a placement missed while disconnected is not replayed, since it is
a hint that costs hits when lost, never correctness).

Length: one job, one class: ``RedisState``'s loops share its breaker,
its pending and applied records and its events, and the re-sync runs their steps in an order
that matters (write what we hold before trusting what we read). Everything pure lives beside
it: the record codec and load sums (``codec``), the scripts (``scripts``), the lease decisions
(``leases``), the bounded calls and the breaker (``redislink``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar, cast

from redis.asyncio import Redis
from redis.typing import EncodableT, FieldT

from proxy.config import RateLimitsConfig, RedisConfig
from proxy.routing.ratelimit import RateLimiter
from proxy.state.codec import ReplicaRecord, sum_load
from proxy.state.leases import BUCKET_IDLE_MS, LEASE_TICK_S, LeaseAsk, LeasedRateLimiter
from proxy.state.protocol import LocalView, new_instance_id
from proxy.state.redislink import (
    PROBE_S,
    REDIS_ERRORS,
    Breaker,
    Unavailable,
    connect,
    wait_event,
)
from proxy.state.scripts import LEASE, MERGE_RECORD, PRUNE
from proxy.tasks import cancelling, end_if_cancelled

if TYPE_CHECKING:
    from proxy.observe.metrics import Metrics

log = logging.getLogger("tokenlane.shared")

T = TypeVar("T")

RECONCILE_S = 1.0  # full read of the replica records and of the others' load
MAX_PENDING_HOMES = 10_000  # stored responses' homes waiting to be written
MAX_PENDING_PLACEMENTS = 1_000  # cache_aware placements waiting to be published
PLACEMENTS_PER_MESSAGE = 100  # a message stays small (a hint must not slow Redis down)
SUBSCRIBE_POLL_S = 1.0  # a pub/sub read waits this long for a message, then loops


class RedisState:
    """Shared state in Redis; see the module docstring for what is shared and how."""

    def __init__(
        self,
        url: str,
        config: Callable[[], RedisConfig],
        *,
        metrics: Metrics | None = None,
        instance: str | None = None,
        prefix: str = "tokenlane",
        reconcile_s: float = RECONCILE_S,
        probe_s: float = PROBE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.config = config
        self.metrics = metrics
        self.instance = instance or new_instance_id()
        self.reconcile_s = reconcile_s
        self.clock = clock
        self.breaker = Breaker(probe_s)
        self._redis: Redis = connect(url, config().timeout_ms / 1000)
        self._merge = self._redis.register_script(MERGE_RECORD)
        self._lease = self._redis.register_script(LEASE)
        self._prune = self._redis.register_script(PRUNE)
        self._records_key = f"{prefix}:replicas"
        self._channel = f"{prefix}:replicas:changed"
        self._instances_key = f"{prefix}:instances"
        self._inflight_prefix = f"{prefix}:inflight:"
        self._bucket_prefix = f"{prefix}:rl:"
        self._response_prefix = f"{prefix}:resp:"
        # Stored responses' homes not yet written (response id → (url, ttl_s)); bounded: while
        # Redis is down the oldest are dropped (each instance still knows its own).
        self._homes_pending: dict[str, tuple[str, float]] = {}
        self._placed_channel = f"{prefix}:placed"
        # cache_aware placements not yet published: (pool, url, block hashes); dropped while
        # Redis is down (the other instances learn again from the next ones).
        self._placements: list[tuple[str, str, list[int]]] = []
        self._up: bool | None = None  # None until the first attempt to join
        self._view: LocalView | None = None
        self._applied: dict[str, float] = {}  # field → updated_at of the newest record applied
        self._pending: dict[str, ReplicaRecord] = {}  # local transitions not yet written
        self._remote: dict[str, int] = {}
        self._remote_at: float | None = None
        self.instances = 1  # live instances, this one included, as last seen
        self._limiters: list[LeasedRateLimiter] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._dirty = asyncio.Event()  # something to write
        self._reconcile_now = asyncio.Event()
        self._lease_now = asyncio.Event()

    # -- what the gateway calls ----------------------------------------------------------

    @property
    def up(self) -> bool:
        return bool(self._up)

    async def start(self, view: LocalView) -> None:
        """One bounded attempt to join (read the shared records, write our load); then the
        background loops. Never fails: without Redis the instance starts on its local view."""
        self._view = view
        for _ in range(self.breaker.threshold):
            try:
                await self._resync()
            except Unavailable as exc:
                if not self.breaker.closed:
                    self._set_up(False, str(exc))
                    break
            else:
                self._set_up(True, "joined")
                break
        self._tasks = [
            asyncio.create_task(self._sync_loop(), name="shared sync"),
            asyncio.create_task(self._heartbeat_loop(), name="shared heartbeat"),
            asyncio.create_task(self._write_loop(), name="shared writes"),
            asyncio.create_task(self._subscribe_loop(), name="shared subscribe"),
            asyncio.create_task(self._lease_loop(), name="shared leases"),
        ]

    async def stop(self) -> None:
        """Stop the loops; on a clean exit also withdraw our load at once (a crash leaves it to
        the TTL)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)  # bounded: never hold up a shutdown
        self._tasks = []
        if self._up:
            key = self._inflight_prefix + self.instance

            async def withdraw() -> None:
                async with self._redis.pipeline(transaction=True) as p:
                    p.delete(key)
                    p.srem(self._instances_key, self.instance)
                    await p.execute()

            with contextlib.suppress(Unavailable):
                await self._call(withdraw, "withdraw")
        with contextlib.suppress(*REDIS_ERRORS):
            async with asyncio.timeout(1.0):
                await self._redis.aclose()

    def publish(self, record: ReplicaRecord) -> None:
        # The newest local transition per replica waits here until written; while Redis is
        # down it stays, and the re-sync writes it (or adopts a newer one made elsewhere). A
        # record without its transition time is taken as a transition made now.
        changed_at = round(record.changed_at or time.time(), 3)
        self._pending[record.field] = replace(
            record, instance=self.instance, updated_at=0.0, changed_at=changed_at
        )
        self._dirty.set()

    def share_response_home(self, response_id: str, url: str, ttl_s: float) -> None:
        pending = self._homes_pending
        pending[response_id] = (url, ttl_s)
        if len(pending) > MAX_PENDING_HOMES:
            del pending[next(iter(pending))]
        self._dirty.set()

    def share_placement(self, pool: str, url: str, hashes: Sequence[int]) -> None:
        if not self._up:
            return
        pending = self._placements
        pending.append((pool, url, list(hashes)))
        if len(pending) > MAX_PENDING_PLACEMENTS:
            del pending[0]
        self._dirty.set()

    async def response_home(self, response_id: str) -> str | None:
        if not self._up:
            return None
        key = self._response_prefix + response_id

        async def read() -> Any:
            return await self._redis.get(key)

        try:
            raw = await self._call(read, "response home")
        except Unavailable:
            return None
        if isinstance(raw, bytes):
            return raw.decode()
        return raw if isinstance(raw, str) else None

    def remote_in_flight(self, url: str) -> int:
        if not self._up or self._remote_at is None:
            return 0
        if self.clock() - self._remote_at > self.config().ttl_s:
            return 0  # the view stopped refreshing: stale counts are no counts
        return self._remote.get(url, 0)

    def rate_limiter(self, limits: Callable[[], RateLimitsConfig]) -> RateLimiter:
        limiter = LeasedRateLimiter(self, limits)
        self._limiters.append(limiter)
        return limiter

    async def sync(self) -> None:
        """One round of the background sync: apply newer records, refresh the load view.
        ``Unavailable`` when Redis does not answer within ``timeout_ms`` (or the breaker is
        open). The loops call it by themselves; tests and tools may call it too."""
        await self._reconcile()
        await self._refresh_load()

    def wake_leases(self) -> None:
        self._lease_now.set()

    # -- bounded calls and the breaker ---------------------------------------------------

    async def _call(self, fn: Callable[[], Awaitable[T]], what: str, *, probe: bool = False) -> T:
        """``fn()`` within ``timeout_ms``, or ``Unavailable``."""
        if not self.breaker.allows(probe, self.clock()):
            raise Unavailable("breaker open")
        try:
            async with asyncio.timeout(self.config().timeout_ms / 1000):
                result = await fn()
        except REDIS_ERRORS as exc:
            if cancelling():
                raise asyncio.CancelledError from exc
            why = f"{what}: {type(exc).__name__}: {exc}".rstrip(": ")
            if self.breaker.failed(self.clock()):
                self._set_up(False, why)
            elif self.breaker.closed:
                self._reconcile_now.set()  # confirm (or clear) a first failure at once
            raise Unavailable(why) from exc
        # A probe that answers lets the re-sync's calls through; ``up`` waits for the re-sync.
        self.breaker.succeeded()
        return result

    def _set_up(self, up: bool, why: str) -> None:
        if self.metrics is not None:
            self.metrics.shared_state_up.set(1 if up else 0)
        if up == self._up:
            return
        self._up = up
        if up:
            log.info("shared state: Redis at %s in use (%s); instance %s", self._where(), why,
                     self.instance)  # fmt: skip
        else:
            log.warning("shared state: Redis at %s unreachable (%s); going on with the local "
                        "view", self._where(), why)  # fmt: skip
            self._remote = {}
            self._remote_at = None
            if self._view is not None:
                self._safely(self._view.remote_load, {})

    def _where(self) -> str:
        kw = self._redis.connection_pool.connection_kwargs
        if "path" in kw:
            return str(kw["path"])
        return f"{kw.get('host', '?')}:{kw.get('port', '?')}"

    def _safely(self, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            fn(arg)
        except Exception:  # a bug on the gateway side must not end a loop
            log.exception("shared state: applying %r failed", arg)

    # -- re-sync (at start and whenever Redis comes back) --------------------------------

    async def _resync(self) -> None:
        """Write what we hold before trusting what we read: our unwritten transitions, our
        known records where Redis has none (it restarted empty), our load; then read all."""
        await self._call(self._redis.ping, "ping", probe=True)
        await self._flush()
        assert self._view is not None
        known = [r for r in self._view.records() if _informative(r)]
        if known:

            async def fill() -> list[Any]:
                async with self._redis.pipeline(transaction=False) as p:
                    for r in known:
                        rec = replace(r, instance=self.instance, updated_at=0.0)
                        await self._merge(
                            keys=[self._records_key],
                            args=[rec.field, rec.to_json(), "fill", self._channel],
                            client=p,
                        )
                    return await p.execute()

            await self._call(fill, "fill")
        await self._heartbeat()
        await self._reconcile()
        await self._refresh_load()

    # -- replica records -------------------------------------------------------------------

    async def _flush(self) -> None:
        await self._flush_homes()
        for key, record in list(self._pending.items()):

            async def write(record: ReplicaRecord = record) -> Any:
                return await self._merge(
                    keys=[self._records_key],
                    args=[record.field, record.to_json(), "write", self._channel],
                )

            raw = await self._call(write, "write")
            if self._pending.get(key) is record:
                del self._pending[key]
            try:
                stored = ReplicaRecord.from_json(raw)
            except ValueError as exc:  # someone else's junk under our key: overwrite next time
                log.warning("shared state: ignoring a stored record: %s", exc)
                continue
            self._applied[key] = max(self._applied.get(key, 0.0), stored.updated_at)
            ours = (self.instance, record.state, record.reason, record.ejections)
            if key not in self._pending and ours != (
                stored.instance,
                stored.state,
                stored.reason,
                stored.ejections,
            ):
                # Ours was refused (a newer transition, or a standing ejection, won) or merged
                # (the shared count differs from ours): adopt what Redis holds. After an
                # outage this is how newer transitions made elsewhere beat our pending ones.
                self._apply(stored, force=True)

    async def _flush_placements(self) -> None:
        """Everything placed since the last flush, in one message."""
        placed, self._placements = self._placements, []
        for i in range(0, len(placed), PLACEMENTS_PER_MESSAGE):
            part = placed[i : i + PLACEMENTS_PER_MESSAGE]
            data = json.dumps({"i": self.instance, "p": part}, separators=(",", ":"))

            async def publish(data: str = data) -> Any:
                return await self._redis.publish(self._placed_channel, data)

            await self._call(publish, "placements")

    def _on_placed(self, data: str) -> None:
        try:
            message = json.loads(data)
            if message["i"] == self.instance or self._view is None:
                return
            for pool, url, hashes in message["p"]:
                self._view.learn_placement(str(pool), str(url), [int(h) for h in hashes])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("shared state: ignoring a placement message: %s", exc)

    async def _flush_homes(self) -> None:
        homes, self._homes_pending = self._homes_pending, {}
        if not homes:
            return

        async def write() -> Any:
            async with self._redis.pipeline(transaction=False) as p:
                for rid, (url, ttl_s) in homes.items():
                    p.set(self._response_prefix + rid, url, ex=max(1, round(ttl_s)))
                return await p.execute()

        try:
            await self._call(write, "response homes")
        except Unavailable:
            # Put back what was not written, behind what came meanwhile (bounded as above).
            self._homes_pending = {**homes, **self._homes_pending}
            while len(self._homes_pending) > MAX_PENDING_HOMES:
                del self._homes_pending[next(iter(self._homes_pending))]
            raise

    def _apply(self, record: ReplicaRecord, *, force: bool = False) -> None:
        """Apply a record read from Redis if it is newer and not contradicted by a local
        transition still waiting to be written."""
        key = record.field
        if not force:
            if record.updated_at <= self._applied.get(key, 0.0):
                return
            if record.instance == self.instance or key in self._pending:
                self._applied[key] = record.updated_at
                return
        if self._view is None:
            return
        try:
            known = self._view.apply(record)
        except Exception:  # a bug on the gateway side must not end a loop
            log.exception("shared state: applying %r failed", record)
            known = True
        if known:  # an unknown replica's record is offered again at the next reconcile
            self._applied[key] = max(self._applied.get(key, 0.0), record.updated_at)

    def _on_message(self, data: str) -> None:
        try:
            record = ReplicaRecord.from_json(data)
        except ValueError as exc:
            log.warning("shared state: ignoring a message: %s", exc)
            return
        self._apply(record)

    async def _reconcile(self) -> None:
        raw = await self._call(lambda: self._redis.hgetall(self._records_key), "reconcile")
        records = []
        for value in raw.values():
            try:
                records.append(ReplicaRecord.from_json(value))
            except ValueError as exc:
                log.warning("shared state: ignoring a record: %s", exc)
        for record in sorted(records, key=lambda r: r.updated_at):
            self._apply(record)

    # -- load ------------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        assert self._view is not None
        # Typed as redis-py's field mapping: its key type is invariant, so a dict[str, int]
        # would not be accepted as the hash's fields below.
        counts: dict[FieldT, EncodableT] = {
            url: n for url, n in self._view.in_flight().items() if n > 0
        }
        key = self._inflight_prefix + self.instance
        ttl_ms = max(1, int(self.config().ttl_s * 1000))

        async def write() -> None:
            # One transaction: readers never see the hash half-written or without its expiry.
            async with self._redis.pipeline(transaction=True) as p:
                p.delete(key)
                p.hset(key, mapping={"_at": f"{time.time():.3f}", **counts})
                p.pexpire(key, ttl_ms)
                p.sadd(self._instances_key, self.instance)
                await p.execute()

        await self._call(write, "heartbeat")

    async def _refresh_load(self) -> None:
        # The client decodes replies (``decode_responses=True`` in redislink.connect); redis-py's
        # annotations say ``bytes | str`` whatever the client was built with.
        ids = cast(
            "set[str]",
            await self._call(lambda: self._redis.smembers(self._instances_key), "instances"),
        )
        others = sorted(i for i in ids if i != self.instance)

        async def read() -> list[Any]:
            async with self._redis.pipeline(transaction=False) as p:
                for i in others:
                    p.hgetall(self._inflight_prefix + i)
                return await p.execute()

        hashes = await self._call(read, "load") if others else []
        totals, live, dead = sum_load(
            dict(zip(others, hashes, strict=True)), time.time(), self.config().ttl_s
        )
        for gone in dead:
            await self._call(
                functools.partial(
                    self._prune,
                    keys=[self._inflight_prefix + gone, self._instances_key],
                    args=[gone],
                ),
                "prune",
            )
        self._remote = totals
        self._remote_at = self.clock()
        self.instances = live + 1
        if self._view is not None:
            self._safely(self._view.remote_load, totals)

    # -- loops -----------------------------------------------------------------------------

    async def _sync_loop(self) -> None:
        """Reconcile and refresh the load view while up; probe and re-sync while down."""
        while True:
            end_if_cancelled()
            try:
                if self._up:
                    await self.sync()
                    if self._pending:
                        # A write that failed while the breaker stayed closed is still
                        # pending; the write loop waits for news, so wake it to retry.
                        self._dirty.set()
                elif self.breaker.allows(True, self.clock()):
                    await self._resync()
                    self._set_up(True, "re-synced after an outage")
            except Unavailable:
                pass
            except Exception:  # a bug must not end the loop
                log.exception("shared state: sync failed")
            wait = self.reconcile_s if self._up else self.breaker.probe_s
            await wait_event(self._reconcile_now, wait)

    async def _heartbeat_loop(self) -> None:
        while True:
            end_if_cancelled()
            await asyncio.sleep(self.config().heartbeat_s)
            if self._up:
                try:
                    await self._heartbeat()
                except Unavailable:
                    pass
                except Exception:
                    log.exception("shared state: heartbeat failed")

    async def _write_loop(self) -> None:
        while True:
            end_if_cancelled()
            await self._dirty.wait()
            self._dirty.clear()
            if self._up:  # while down the re-sync writes them
                try:
                    await self._flush()
                except Unavailable:
                    pass
                except Exception:
                    log.exception("shared state: writing a record failed")
                # Last, and on their own: a hint never holds up a record or a home.
                with contextlib.suppress(Unavailable):
                    await self._flush_placements()

    async def _subscribe_loop(self) -> None:
        """Apply published records as they come. Only a shortcut: a message lost while
        (re)connecting is picked up by the next reconcile, which each (re)subscription
        triggers at once."""
        while True:
            end_if_cancelled()
            if not self._up:
                await asyncio.sleep(self.breaker.probe_s)
                continue
            pubsub = self._redis.pubsub()
            try:
                async with asyncio.timeout(self.config().timeout_ms / 1000):
                    await pubsub.subscribe(self._channel, self._placed_channel)
                self._reconcile_now.set()
                while self._up and not cancelling():
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=SUBSCRIBE_POLL_S
                    )
                    if message is None or message.get("type") != "message":
                        continue
                    if message.get("channel") == self._placed_channel:
                        self._on_placed(message["data"])
                    else:
                        self._on_message(message["data"])
            except REDIS_ERRORS as exc:
                if cancelling():
                    raise asyncio.CancelledError from exc
                log.debug("shared state: subscription lost: %r", exc)
            finally:
                with contextlib.suppress(*REDIS_ERRORS):
                    async with asyncio.timeout(self.config().timeout_ms / 1000):
                        await pubsub.aclose()
            end_if_cancelled()
            await asyncio.sleep(min(self.breaker.probe_s, self.reconcile_s))

    async def _lease_loop(self) -> None:
        while True:
            end_if_cancelled()
            await wait_event(self._lease_now, LEASE_TICK_S)
            if not self._up:
                continue
            for limiter in self._limiters:
                asks = limiter.due(self.clock())
                if not asks:
                    continue

                async def lease(asks: list[LeaseAsk] = asks) -> list[Any]:
                    async with self._redis.pipeline(transaction=False) as p:
                        for a in asks:
                            await self._lease(
                                keys=[f"{self._bucket_prefix}{a.kind}:{a.key}"],
                                args=[a.limit, repr(a.amount), BUCKET_IDLE_MS],
                                client=p,
                            )
                        return await p.execute()

                try:
                    results = await self._call(lease, "lease")
                except Unavailable:
                    break
                except Exception:
                    log.exception("shared state: leasing failed")
                    break
                limiter.settle(asks, [(float(g), float(left)) for g, left in results], self.clock())


def _informative(record: ReplicaRecord) -> bool:
    """Worth restoring into an empty Redis: anything but the state every gateway starts in."""
    return record.state != "probing" or record.ejections > 0
