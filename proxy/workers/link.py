"""A worker's link to the other workers of its serve: the shared counts, the news, the questions.

What each worker does alone: serve its connections, relay, detect (a first-token timeout, a
silent stream, failures: its verdicts are published to all). What one worker does for all,
the leader (worker 0): the health prober (its rounds' results, models and scrapes go to every
worker), the policy file's watch and every reload (a worker asked for one forwards it, and a
reload is sent as the file's text, so every worker swaps to the same version or none does).
A worker that starts (or restarts) first asks a peer for the fleet's state and the policy
version (``sync``), so a restarted leader does not start the fleet from "probing".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from proxy.config import RateLimitsConfig
from proxy.fleet.detect import Progress
from proxy.fleet.fleet import Fleet
from proxy.fleet.replica import Replica
from proxy.fleet.vllm import EngineSample
from proxy.relay.homes import ResponseHomes
from proxy.routing.admission import WAITING_ROW, Admission
from proxy.routing.ratelimit import (
    KeyBuckets,
    LocalRateLimiter,
    RateLimiter,
    TokenBucket,
    Verdict,
)
from proxy.state.codec import ReplicaRecord
from proxy.state.protocol import LocalView
from proxy.workers.board import Board, BoardFull
from proxy.workers.mesh import Mesh, Message

log = logging.getLogger("tokenlane.workers")

ASK_TIMEOUT_S = 2.0
SYNC_TRIES = 3


@dataclass(frozen=True, slots=True)
class WorkerPlace:
    """Where one worker process sits in its serve (given by the supervisor)."""

    rundir: str
    index: int
    count: int

    @property
    def leader(self) -> bool:
        return self.index == 0

    @property
    def board_path(self) -> str:
        return os.path.join(self.rundir, "board")

    @property
    def policy_path(self) -> str:
        """The policy text the leader runs now: what a worker that (re)starts loads, so a
        file broken since the last reload cannot keep it from starting."""
        return os.path.join(self.rundir, "policy.yaml")

    def policy_source(self, config: str) -> str:
        """Where this worker reads its policy: the leader's text once there is one."""
        return self.policy_path if os.path.exists(self.policy_path) else config


class HomesHolder(Protocol):
    homes: ResponseHomes


class LinkedGateway(Protocol):
    """What a worker's link does with its gateway (``proxy.gateway.Gateway``)."""

    admission: Admission

    @property
    def fleet(self) -> Fleet: ...

    @property
    def relay(self) -> HomesHolder: ...

    def adopt(self, text: str, version: int) -> None: ...

    def adopt_sync(self, answer: Mapping[str, Any]) -> None: ...

    def sync_state(self) -> dict[str, Any]: ...

    def local_families(self) -> list[Any]: ...

    async def reload_answer(self) -> dict[str, Any]: ...


class BoardLedger:
    """``admission.Ledger`` over the board; a freed slot wakes the workers that have waiters."""

    def __init__(self, board: Board, kick: Callable[[int], None]) -> None:
        self.board = board
        self.kick = kick
        self._kicked: set[int] = set()
        self._full_logged = False
        self._waiting_row = board.row(WAITING_ROW)
        # A name's row once the board gave it one (``Board.row`` caches it): the dict's own
        # ``get``, no Python frame, on the three or four asks of every request.
        self._known = board.rows_known.get

    def _row(self, name: str) -> int | None:
        row = self._known(name)
        if row is not None:
            return row
        try:
            return self.board.row(name)
        except BoardFull:
            if not self._full_logged:
                self._full_logged = True
                log.error("worker board full: %r and later names are counted per worker", name)
            return None

    def others(self, name: str) -> int:
        row = self._known(name)
        if row is None and (row := self._row(name)) is None:
            return 0
        return self.board.others(row)

    def claim(self, name: str, limit: int, amount: int = 1) -> bool:
        row = self._known(name)
        if row is None and (row := self._row(name)) is None:
            return True
        return self.board.claim(row, limit, amount)

    def hold(self, name: str, count: int) -> None:
        row = self._known(name)
        if row is None and (row := self._row(name)) is None:
            return
        self.board.set_mine(row, count)

    def kick_others(self) -> None:
        board, row = self.board, self._waiting_row
        if not board.others(row):
            return  # no other worker has a waiter: nobody to kick
        for w in range(board.workers):
            if w == board.worker or w in self._kicked:
                continue
            if board.counts[w * board.rows + row] > 0:
                if not self._kicked:  # one kick per peer per loop step
                    asyncio.get_running_loop().call_soon(self._kicked.clear)
                self._kicked.add(w)
                self.kick(w)


@dataclass
class BoardRateLimiter(LocalRateLimiter):
    """The local limiter's buckets, kept on the board: every worker of the serve spends from
    the same two buckets per key, under the board's lock (no overshoot, no lease). The clock
    is ``time.monotonic``, one clock for every process of the host."""

    board: Board | None = None

    def check(self, key: str, tokens: int) -> Verdict:
        board = self.board
        assert board is not None
        rows = {
            "requests": board.row(f"rl requests {key}"),
            "tokens": board.row(f"rl tokens {key}"),
        }
        with board.locked():
            kb = self.buckets.setdefault(key, KeyBuckets())
            for name, row in rows.items():
                stored = board.bucket(row)
                bucket = None
                if stored is not None:
                    cap, level, at = stored
                    bucket = TokenBucket(capacity=cap, per_s=cap / 60.0, level=level, at=at)
                setattr(kb, name, bucket)
            verdict = super().check(key, tokens)
            for name, row in rows.items():
                b = getattr(kb, name)
                board.set_bucket(row, *((b.capacity, b.level, b.at) if b else (0.0, 0.0, 0.0)))
        return verdict


class MeshState:
    """``SharedState`` for the workers of one serve without Redis: transitions and response
    homes go to every worker as news; load is on the board (``Admission.has_room`` reads it)."""

    def __init__(self, link: WorkerLink, instance: str) -> None:
        self.link = link
        self.instance = instance
        self.view: LocalView | None = None

    @property
    def up(self) -> bool:
        return True

    async def start(self, view: LocalView) -> None:
        self.view = view

    async def stop(self) -> None:
        return None

    def publish(self, record: ReplicaRecord) -> None:
        shared = replace(record, instance=self.instance)
        self.link.mesh.tell_all({"t": "record", "record": asdict(shared)})

    def remote_in_flight(self, url: str) -> int:
        return 0  # has_room puts the other workers' count on the replica

    def rate_limiter(self, limits: Callable[[], RateLimitsConfig]) -> RateLimiter:
        return BoardRateLimiter(limits, board=self.link.board)

    def share_response_home(self, response_id: str, url: str, ttl_s: float) -> None:
        self.link.mesh.tell_all({"t": "home", "id": response_id, "url": url})

    async def response_home(self, response_id: str) -> str | None:
        return None  # every worker was told

    def share_placement(self, pool: str, url: str, hashes: Sequence[int]) -> None:
        message = {"t": "placed", "pool": pool, "url": url, "h": list(hashes)}
        self.link.mesh.tell_all(message, hint=True)


def health_item(replica: Replica) -> dict[str, Any]:
    s = replica.stats
    return {
        "pool": replica.pool,
        "url": replica.url,
        "models": replica.models,
        "sample": asdict(s.sample),
        "at": s.at,
        "stale": s.stale,
        "health_ok": replica.health_ok,
        # What the leader's clock moves (``Fleet.tick``): the others do not tick.
        "weight": replica.weight,
        "level": replica.backoff_level,
        "level_since": replica.level_since,
        "healthy_since": replica.healthy_since,
        # What the detectors weigh a silent stream against (counters flat since when).
        "progress": asdict(replica.progress),
    }


def apply_health(replicas: list[Replica], item: Mapping[str, Any]) -> None:
    """The leader's health round for one replica, as this worker's view of it (the monotonic
    clock is the host's, the same in every worker)."""
    for replica in replicas:
        if replica.url == item["url"] and replica.pool == item["pool"]:
            replica.models = dict(item["models"])
            replica.stats.sample = EngineSample(**item["sample"])
            replica.stats.at = item["at"]
            replica.stats.stale = bool(item["stale"])
            replica.health_ok = bool(item["health_ok"])
            replica.weight = float(item["weight"])
            replica.backoff_level = int(item["level"])
            replica.level_since = float(item["level_since"])
            since = item["healthy_since"]
            replica.healthy_since = None if since is None else float(since)
            replica.progress = Progress(**item["progress"])


class WorkerLink:
    """One worker's board, mesh and the handlers of what the others say."""

    def __init__(self, place: WorkerPlace) -> None:
        self.place = place
        self.board = Board(place.board_path, place.index)
        self.ledger = BoardLedger(self.board, self._kick)
        self.mesh = Mesh(place.rundir, place.index, place.count, self._news, self._ask)
        self.gateway: LinkedGateway | None = None
        self.state: MeshState | None = None
        self.synced = False  # questions wait for this: a starting worker knows nothing yet

    def shared_state(self, instance: str) -> MeshState:
        self.state = MeshState(self, instance)
        return self.state

    async def start(self, gateway: LinkedGateway, policy_text: str | None) -> None:
        self.gateway = gateway
        await self.mesh.start()
        await self._sync()
        self.synced = True
        if self.place.leader and policy_text is not None:
            self.keep_policy(policy_text)

    async def stop(self) -> None:
        await self.mesh.stop()
        self.board.close()

    def _kick(self, worker: int) -> None:
        self.mesh.tell(worker, {"t": "kick"})

    # -- what this worker tells ------------------------------------------------------------

    def health_round(self, replica: Replica) -> None:
        """The leader probed ``replica``: every worker gets what it found."""
        self.mesh.tell_all({"t": "health", "item": health_item(replica)})

    def policy_swapped(self, text: str, version: int) -> None:
        self.keep_policy(text)
        self.mesh.tell_all({"t": "policy", "text": text, "version": version})

    def keep_policy(self, text: str) -> None:
        """The leader's: write the text it runs where restarting workers read it (whole)."""
        tmp = self.place.policy_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, self.place.policy_path)

    async def ask_leader_reload(self) -> Message | None:
        return await self.mesh.ask(0, {"ask": "reload"}, ASK_TIMEOUT_S * 5)

    async def peer_metrics(self) -> dict[int, Message | None]:
        return await self.mesh.ask_all({"ask": "metrics"}, ASK_TIMEOUT_S)

    # -- what the others say ---------------------------------------------------------------

    def _news(self, message: Message) -> None:
        gw = self.gateway
        if gw is None:
            return
        kind = message.get("t")
        if kind == "kick":
            gw.admission.kick()
        elif kind == "record":
            if self.state is not None and self.state.view is not None:
                self.state.view.apply(ReplicaRecord(**message["record"]))
        elif kind == "health":
            apply_health(list(gw.fleet.replicas()), message["item"])
        elif kind == "policy":
            gw.adopt(message["text"], int(message["version"]))
        elif kind == "home":
            gw.relay.homes.remember(str(message["id"]), str(message["url"]), share=False)
        elif kind == "placed":
            if self.state is not None and self.state.view is not None:
                self.state.view.learn_placement(message["pool"], message["url"], message["h"])

    async def _ask(self, message: Message) -> Message:
        gw = self.gateway
        if gw is None or not self.synced:
            return {"error": "starting"}
        kind = message.get("ask")
        if kind == "metrics":
            return {"families": gw.local_families()}
        if kind == "sync":
            return gw.sync_state()
        if kind == "reload":
            return await gw.reload_answer()
        return {"error": f"unknown question {kind!r}"}

    async def _sync(self) -> None:
        """Start from what a running peer knows (the leader first)."""
        gw = self.gateway
        assert gw is not None
        for _ in range(SYNC_TRIES):
            for peer in self.mesh.peers:
                answer = await self.mesh.ask(peer, {"ask": "sync"}, ASK_TIMEOUT_S)
                if answer is None or "error" in answer:
                    continue
                gw.adopt_sync(answer)
                log.info("worker %d: synced from worker %d", self.place.index, peer)
                return
            if not self.mesh.peers:
                return
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.1)
        # A fresh start: nobody is up yet (they all start together).


__all__ = [
    "BoardLedger",
    "BoardRateLimiter",
    "MeshState",
    "WorkerLink",
    "WorkerPlace",
    "apply_health",
    "health_item",
]
