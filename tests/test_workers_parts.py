"""The parts of `serve --workers N`, each on its own: how many workers, the board (shared counts
and rate-limit buckets), admission over a shared ledger, and the metrics merge."""

from __future__ import annotations

import asyncio
import errno
import os
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from proxy.config import LaneConfig, RateLimitsConfig
from proxy.errors import Rejected
from proxy.fleet.fleet import Fleet
from proxy.observe.merge import families, merge, registry_of
from proxy.observe.metrics import Metrics
from proxy.policyfile import build_policy
from proxy.routing.admission import Admission
from proxy.workers.board import Board
from proxy.workers.link import BoardLedger, BoardRateLimiter
from proxy.workers.supervisor import (
    Listeners,
    auto_workers,
    bind,
    cgroup_cpus,
    spreads_connections,
)


@pytest.mark.parametrize(
    ("cpu_max", "quota", "period", "expected"),
    [
        ("max 100000", None, None, None),  # v2, unlimited
        ("200000 100000", None, None, 2),
        ("150000 100000", None, None, 2),  # 1.5 CPUs: rounded up
        ("50000 100000", None, None, 1),
        ("garbage", None, None, None),
        (None, "-1", "100000", None),  # v1, unlimited
        (None, "400000", "100000", 4),
        (None, None, None, None),  # no cgroup files
    ],
)
def test_cgroup_cpus(
    cpu_max: str | None, quota: str | None, period: str | None, expected: int | None
) -> None:
    assert cgroup_cpus(cpu_max, quota, period) == expected


@pytest.mark.parametrize(
    ("affinity", "cgroup", "expected"),
    [(64, 2, 2), (2, None, 2), (4, 16, 4), (1, None, 1), (8, 8, 8)],
)
def test_auto_workers_is_the_smaller_of_affinity_and_quota(
    affinity: int, cgroup: int | None, expected: int
) -> None:
    assert auto_workers(affinity, cgroup) == expected


@pytest.fixture
def boards(tmp_path: Path) -> Iterator[tuple[Board, Board, Board]]:
    """The supervisor's handle and two workers' on one board file."""
    path = str(tmp_path / "board")
    parent = Board(path, None, create=True, workers=2)
    w0, w1 = Board(path, 0), Board(path, 1)
    yield parent, w0, w1
    for b in (w0, w1, parent):
        b.close()


def _accepted(socks: list[socket.socket], n: int) -> list[int]:
    """Accept ``n`` connections from ``socks`` (as their workers would): how many each took.
    Waits for each (a loaded machine finishes a handshake late), with a wide deadline."""
    counts = [0] * len(socks)
    deadline = time.monotonic() + 30
    while sum(counts) < n and time.monotonic() < deadline:
        ready, _, _ = select.select(socks, [], [], 0.5)
        for sock in ready:
            conn, _ = sock.accept()
            conn.close()
            counts[socks.index(sock)] += 1
    return counts


def _as_inherited(sock: socket.socket) -> socket.socket:
    """The copy a worker started with ``sock`` holds (its supervisor's is closed after)."""
    return socket.socket(fileno=os.dup(sock.fileno()))


@pytest.mark.skipif(not spreads_connections(), reason="the kernel spreads no connections here")
def test_each_worker_listens_on_a_socket_of_its_own_and_connections_are_spread() -> None:
    """``Listeners``: a listening socket per worker on one port (``SO_REUSEPORT``), bound
    before any worker starts, the supervisor's copy closed once the worker has it. A client
    that opens many connections at once has them spread over the workers; a worker gone takes
    its socket along and the others get every new connection; the worker started in its
    place gets a new one, on which it listens once it serves. The port is refused to anyone
    else from the start."""
    listeners = Listeners("127.0.0.1", 0, 2)
    port = listeners.port
    workers: list[socket.socket] = []
    clients: list[socket.socket] = []
    try:
        assert port
        # Before any worker has started, and after: another serve, or any plain bind, is
        # refused, as with one socket.
        for _ in range(2):
            with pytest.raises(OSError) as exc:
                Listeners("127.0.0.1", port, 2)
            assert exc.value.errno == errno.EADDRINUSE
            with pytest.raises(OSError):
                bind("127.0.0.1", port)
            sock = listeners.for_worker()
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            assert sock.getsockname()[1] == port
            workers.append(_as_inherited(sock))
            listeners.given(sock)
            assert sock.fileno() == -1  # the worker's alone

        def connect(n: int) -> None:
            clients.extend(socket.create_connection(("127.0.0.1", port)) for _ in range(n))

        # Hashed over the two: each has some (a split of 200 as bad as 40/160 has odds below
        # 1e-17); on one shared socket the first worker awake took them all.
        connect(200)
        counts = _accepted(workers, 200)
        assert sum(counts) == 200 and min(counts) >= 40
        workers.pop().close()  # a worker gone: the other takes every new connection
        connect(50)
        assert _accepted(workers, 50) == [50]
        # The worker started in its place gets a new socket, bound and not listening: until
        # its server listens, every new connection still goes to the one serving.
        again = listeners.for_worker()
        assert not again.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        starting = _as_inherited(again)
        listeners.given(again)
        connect(50)
        assert _accepted(workers, 50) == [50]
        starting.listen()  # as its server does once it serves: it takes its share again
        workers.append(starting)
        connect(200)
        counts = _accepted(workers, 200)
        assert sum(counts) == 200 and min(counts) >= 40
    finally:
        for c in clients:
            c.close()
        for sock in workers:
            sock.close()
        listeners.close()


def test_one_worker_gets_the_one_socket_and_a_port_in_use_is_refused() -> None:
    """One worker (or a kernel that spreads nothing): one listening socket, kept by the
    supervisor and passed as it is; a port another process serves is refused."""
    listeners = Listeners("127.0.0.1", 0, 1)
    try:
        sock = listeners.for_worker()
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        listeners.given(sock)
        assert sock.fileno() != -1 and listeners.for_worker() is sock
        with pytest.raises(OSError) as exc:
            Listeners("127.0.0.1", listeners.port, 2)
        assert exc.value.errno == errno.EADDRINUSE
    finally:
        listeners.close()


def test_a_name_has_one_row_in_every_process(boards: tuple[Board, Board, Board]) -> None:
    _, w0, w1 = boards
    names = [f"r pool http://10.0.0.{i}:8000" for i in range(200)]
    rows0 = [w0.row(n) for n in names]
    assert [w1.row(n) for n in names] == rows0
    assert len(set(rows0)) == len(names)


def test_claims_hold_a_limit_across_workers_and_a_dead_column_frees(
    boards: tuple[Board, Board, Board],
) -> None:
    parent, w0, w1 = boards
    row = w0.row("r p http://a")
    assert w0.claim(row, 3) and w0.claim(row, 3)
    assert w1.claim(row, 3)
    assert not w1.claim(row, 3) and not w0.claim(row, 3)
    assert (w0.total(row), w0.mine(row), w1.mine(row)) == (3, 2, 1)
    parent.zero_column(0)  # worker 0 died
    assert w1.total(row) == 1
    assert w1.claim(row, 3) and w1.claim(row, 3) and not w1.claim(row, 3)
    w1.set_mine(row, 0)  # worker 1 released all
    assert w0.total(row) == 0


def test_a_rows_total_and_the_others_share_are_its_column_cells(
    boards: tuple[Board, Board, Board],
) -> None:
    # Summed over a strided view of the counts: the row's cell in every worker's column, and
    # nothing of the rows beside it.
    _, w0, w1 = boards
    row, beside = w0.row("r p http://a"), w0.row("r p http://b")
    w0.set_mine(row, 4)
    w1.set_mine(row, 3)
    w1.set_mine(beside, 50)
    assert (w0.total(row), w0.others(row), w1.others(row)) == (7, 3, 4)
    assert (w0.total(beside), w0.others(beside), w1.others(beside)) == (50, 50, 0)


def test_rate_limit_buckets_are_one_budget_for_all_workers(
    boards: tuple[Board, Board, Board],
) -> None:
    _, w0, w1 = boards
    now = [1000.0]
    limits = RateLimitsConfig(requests_per_min=5)
    a = BoardRateLimiter(lambda: limits, clock=lambda: now[0], board=w0)
    b = BoardRateLimiter(lambda: limits, clock=lambda: now[0], board=w1)
    allowed = [lim.check("key-1", 10).allowed for lim in (a, b, a, b, a, b, a)]
    assert allowed == [True] * 5 + [False] * 2
    refused = b.check("key-1", 10)
    assert refused.requests is not None and refused.requests.remaining == 0
    assert refused.retry_after_s == pytest.approx(12.0)  # one request's refill: 60 s / 5
    assert a.check("key-2", 10).allowed  # another key, its own budget
    now[0] += 12.0
    assert b.check("key-1", 10).allowed and not a.check("key-1", 10).allowed


def _admission(fleet: Fleet, ledger: BoardLedger, lane: LaneConfig) -> Admission:
    adm = Admission(fleet, Metrics(), [lane], sweep_s=60.0)  # no sweeper help
    adm.ledger = ledger
    return adm


async def test_admission_over_a_ledger_holds_replica_and_lane_limits_and_wakes_the_other(
    boards: tuple[Board, Board, Board],
) -> None:
    """Two workers' admissions over one board: a replica's max_in_flight and a lane's
    max_queue hold for both together, and a slot freed in one wakes a waiter of the other."""
    _, w0, w1 = boards
    policy = build_policy(
        {
            "pools": {"p": {"replicas": [{"url": "http://r0", "max_in_flight": 2}]}},
            "lanes": [{"name": "all", "pool": "p", "max_queue": 1, "queue_timeout_s": 30}],
        }
    )
    lane = policy.lanes[0]
    fleets = [Fleet(policy, {}), Fleet(policy, {})]
    for fleet in fleets:
        for r in fleet.replicas():
            r.state = r.state.HEALTHY
            r.models = {"m": {}}
    adms: list[Admission] = []
    ledgers = [
        BoardLedger(w0, lambda w: adms[w].kick()),
        BoardLedger(w1, lambda w: adms[w].kick()),
    ]
    adms.extend(_admission(f, led, lane) for f, led in zip(fleets, ledgers, strict=True))

    def picker(i: int):  # the relay's try_pick, reduced: the one replica when it has room
        def pick():
            replica = next(fleets[i].replicas())
            if adms[i].has_room(replica) and adms[i].claim(replica):
                return replica
            return None

        return pick

    async def admit(i: int):
        replica = await adms[i].admit(lane, picker(i), lambda: True)
        fleets[i].attempt_started(replica)
        return replica

    r0 = await admit(0)
    r1 = await admit(1)
    await asyncio.sleep(0)  # the claims settle into the held counts at the end of the step
    assert w0.total(w0.row("r p http://r0")) == 2
    waiter = asyncio.create_task(admit(1))  # worker 1 queues: the replica is full
    while not adms[1].waiting:
        await asyncio.sleep(0)
    with pytest.raises(Rejected) as full:  # the lane's one queue place is taken, in worker 1
        await adms[0].admit(lane, picker(0), lambda: True)
    assert full.value.reason == "queue_full"
    fleets[0].attempt_finished(r0, None)
    adms[0].released(r0)  # frees a slot in worker 0: worker 1's waiter gets it
    adms[0].finished(lane)
    got = await asyncio.wait_for(waiter, 5)
    assert got.url == "http://r0"
    await asyncio.sleep(0)
    assert w1.total(w1.row("r p http://r0")) == 2
    assert (w0.mine(w0.row("r p http://r0")), w1.mine(w1.row("r p http://r0"))) == (0, 2)
    assert r1 is not None


def test_merge_sums_counters_and_held_gauges_and_takes_the_leaders_other_gauges() -> None:
    regs = []
    for worker, (served, held, version) in enumerate([(3, 1, 7), (5, 2, 6)]):
        r = CollectorRegistry()
        c = Counter("tokenlane_requests", "n", ["lane"], registry=r)
        c.labels("a").inc(served)
        if worker == 1:
            c.labels("b").inc(1)  # a series only one worker has
        Gauge("tokenlane_replica_in_flight", "h", ["replica"], registry=r).labels("x").set(held)
        Gauge("tokenlane_policy_version", "v", registry=r).set(version)
        regs.append(r)
    merged = merge([families(r) for r in regs])
    text = generate_latest(registry_of(merged)).decode()
    assert 'tokenlane_requests_total{lane="a"} 8.0' in text
    assert 'tokenlane_requests_total{lane="b"} 1.0' in text
    assert 'tokenlane_replica_in_flight{replica="x"} 3.0' in text
    assert "tokenlane_policy_version 7.0" in text  # the first (the leader's), not a sum
    created = [line for line in text.splitlines() if line.startswith("tokenlane_requests_created")]
    assert len(created) == 2  # one per series, a start time (the earliest), never a sum
    assert all(float(line.split()[-1]) < 4e9 for line in created)


def test_a_full_board_counts_later_names_per_worker_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "small")
    parent = Board(path, None, create=True, workers=1, rows=8)
    board = Board(path, 0)
    ledger = BoardLedger(board, lambda w: None)
    # Fill every row but the one the ledger already holds (its waiting count).
    for i in range(board.rows - 1):
        board.row(f"r p http://10.0.0.{i}:8000")
    assert ledger.claim("r p http://late:8000", 1) and ledger.claim("r p http://late:8000", 1)
    assert ledger.others("r p http://late:8000") == 0
    assert "worker board full" in caplog.text
    board.close()
    parent.close()


async def test_hints_to_a_peer_that_stops_reading_are_dropped_not_piled_up(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """cache_aware placements are hints: to a worker that reads nothing (stopped, or busy for
    seconds), they stop once its backlog passes the bound, while news that must arrive (a
    health round, a policy) is still queued."""
    from proxy.workers.mesh import MAX_HINT_BACKLOG, Mesh, socket_path

    accepted = asyncio.Event()

    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await asyncio.sleep(3600)

    server = await asyncio.start_unix_server(never_reads, path=socket_path(str(tmp_path), 1))
    mesh = Mesh(str(tmp_path), 0, 2, lambda m: None, lambda m: None)  # type: ignore[arg-type,return-value]
    await mesh.start()
    try:
        big = {"t": "placed", "h": list(range(20_000))}  # ~120 KB a message
        mesh.tell(1, big, hint=True)
        await asyncio.wait_for(accepted.wait(), 30)
        for _ in range(200):  # ~24 MB offered
            mesh.tell(1, big, hint=True)
            await asyncio.sleep(0)
        assert mesh.hints_dropped > 0
        writer = mesh._peers[1]
        held = writer.transport.get_write_buffer_size()
        assert held <= MAX_HINT_BACKLOG + 200_000
        mesh.tell(1, {"t": "health"})  # not a hint: queued all the same
        assert writer.transport.get_write_buffer_size() > held
    finally:
        await mesh.stop()
        server.close()


async def test_reprefill_bounds_hold_for_the_serve_across_workers(
    boards: tuple[Board, Board, Board],
) -> None:
    """Continuations re-prefilling at once: the gateway-wide and per-replica bounds count every
    worker's, and a slot freed in one worker is found by the other's waiter."""
    from proxy.relay.reprefill import Reprefills

    _, w0, w1 = boards
    kicks: list[int] = []
    r0 = Reprefills(BoardLedger(w0, kicks.append))
    r1 = Reprefills(BoardLedger(w1, kicks.append))
    a = r0.try_take("a", 2, 1)
    assert a is not None
    assert r1.try_take("a", 2, 1) is None  # replica a's one slot is worker 0's
    b = r1.try_take("b", 2, 1)
    assert b is not None
    assert r0.try_take("c", 2, 1) is None  # the serve's two slots are taken
    a.release()
    await r1.freed(30)  # with a ledger, a bounded wait (a freed slot elsewhere wakes nobody)
    assert r1.try_take("a", 2, 1) is not None
    a.release()  # released once only
    assert r0.try_take("c", 2, 1) is None and r0.total == 0


async def test_the_reprefill_token_budget_holds_across_workers(
    boards: tuple[Board, Board, Board],
) -> None:
    from proxy.relay.reprefill import Reprefills

    _, w0, w1 = boards
    r0 = Reprefills(BoardLedger(w0, lambda _: None))
    r1 = Reprefills(BoardLedger(w1, lambda _: None))
    big = r0.try_take("a", 64, 32, 50_000, 32_768)
    assert big is not None  # nothing re-prefilling on a: a long one starts alone
    assert r1.try_take("a", 64, 32, 10, 32_768) is None  # worker 0's 50,000 tokens fill it
    assert r1.try_take("b", 64, 32, 30_000, 32_768) is not None
    big.release()
    first = r1.try_take("a", 64, 32, 20_000, 32_768)
    assert first is not None
    assert r0.try_take("a", 64, 32, 12_768, 32_768) is not None  # exactly the budget
    assert r0.try_take("a", 64, 32, 1, 32_768) is None
