"""The workers' shared counts: one file in shared memory, one column per worker, one lock.

``tokenlane serve --workers N`` runs N processes that must act as one gateway: a replica's
``max_in_flight``, a lane's ``max_in_flight`` and ``max_queue`` and a key's rate limits hold
for all of them together. Each process writes only its own column of counts (what it holds
now); the gateway-wide figure is the column sum. A claim (check the sum against a limit and
take one) runs under an ``flock`` on the file, so two workers never both take the last slot.
The kernel drops a dead process's ``flock``, so a worker killed holding it blocks nobody, and
the supervisor zeroes the dead worker's column at once: what it held is free again.

Rows are found by an 8-byte hash of their name in a directory at the file's start (filled
under the lock, never emptied: a name keeps its row). Rate-limit buckets keep their level and
refill time as doubles in a row of their own (``bucket``/``set_bucket``, under the lock).

Layout: header (magic, rows, workers) | directory: rows × u64 | counts: workers × rows × i32 |
buckets: rows × 3 × f64.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
from collections.abc import Iterator

MAGIC = 0x544B4C42  # "TKLB"
HEADER = struct.Struct("<III4x")
# Names (replicas, lanes, queues, rate-limit buckets) a serve can ever count: rows are never
# freed, so replicas discovered by DNS at ever new addresses use them up over time; a name
# past the last row is counted by its worker alone (``BoardLedger`` logs it once).
ROWS = 32768


class BoardFull(RuntimeError):
    """More distinct names than ``ROWS``: counting stops being shared (logged by the caller)."""


def _hash(name: str) -> int:
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return h or 1  # 0 marks a free directory entry


def board_size(workers: int, rows: int = ROWS) -> int:
    return HEADER.size + rows * 8 + workers * rows * 4 + rows * 24


class Board:
    """One process's handle on the shared file: the supervisor's (``worker=None``: it only
    zeroes columns) or a worker's (it writes column ``worker``)."""

    def __init__(
        self,
        path: str,
        worker: int | None,
        *,
        create: bool = False,
        workers: int = 0,
        rows: int = ROWS,
    ) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        self.fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self.fd, board_size(workers, rows))
        self.map = mmap.mmap(self.fd, 0)
        if create:
            HEADER.pack_into(self.map, 0, MAGIC, rows, workers)
        magic, rows, n = HEADER.unpack_from(self.map, 0)
        if magic != MAGIC:
            raise ValueError(f"{path} is not a tokenlane board")
        self.rows, self.workers, self.worker = rows, n, worker
        base = HEADER.size
        self.directory = memoryview(self.map)[base : base + rows * 8].cast("Q")
        base += rows * 8
        self.counts = memoryview(self.map)[base : base + n * rows * 4].cast("i")
        base += n * rows * 4
        self.buckets = memoryview(self.map)[base : base + rows * 24].cast("d")
        self.rows_known: dict[str, int] = {}  # name: row, as found (``row``)

    def close(self) -> None:
        for view in (self.directory, self.counts, self.buckets):
            view.release()
        self.map.close()
        os.close(self.fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    # -- rows -----------------------------------------------------------------------------

    def row(self, name: str) -> int:
        """The row of ``name``, made on first use (under the lock; cached per process)."""
        row = self.rows_known.get(name)
        if row is not None:
            return row
        h = _hash(name)
        directory = self.directory
        start = h % self.rows
        with self.locked():
            for i in range(self.rows):  # open addressing, linear probe
                row = (start + i) % self.rows
                if directory[row] == h:
                    break
                if directory[row] == 0:
                    directory[row] = h
                    break
            else:
                raise BoardFull(f"more than {self.rows} counted names")
        self.rows_known[name] = row
        return row

    # -- counts ---------------------------------------------------------------------------

    def total(self, row: int) -> int:
        # The row's cell in every column: every ``rows``-th count from the row's, summed in C
        # over a strided view (a generator over the columns was ten Python steps a call, and
        # a request asks four times).
        return sum(self.counts[row :: self.rows])

    def others(self, row: int) -> int:
        """What the other workers hold in ``row``."""
        assert self.worker is not None
        return sum(self.counts[row :: self.rows]) - self.counts[self.worker * self.rows + row]

    def mine(self, row: int) -> int:
        assert self.worker is not None
        return self.counts[self.worker * self.rows + row]

    def set_mine(self, row: int, value: int) -> None:
        """This worker's own count (one aligned store: no lock, one writer per column)."""
        assert self.worker is not None
        self.counts[self.worker * self.rows + row] = value

    def claim(self, row: int, limit: int, amount: int = 1) -> bool:
        """Take ``amount`` of ``limit`` for this worker when the workers together hold little
        enough: one while they hold fewer than ``limit``; a larger amount while it fits, or
        whatever its size when they hold nothing (a token budget must let a long one start)."""
        assert self.worker is not None
        at = self.worker * self.rows + row
        # ``locked`` written out: its context manager was five Python calls a claim.
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            held = sum(self.counts[row :: self.rows])
            if held >= limit or (held > 0 and held + amount > limit):
                return False
            self.counts[at] += amount
            return True
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def zero_column(self, worker: int) -> None:
        """A worker died: nothing it held is held any more (supervisor)."""
        start = worker * self.rows
        with self.locked():
            self.counts[start : start + self.rows] = memoryview(bytes(self.rows * 4)).cast("i")

    # -- rate-limit buckets (caller holds the lock) ----------------------------------------

    def bucket(self, row: int) -> tuple[float, float, float] | None:
        """(capacity, level, at) of the bucket in ``row``; None when never written."""
        b = self.buckets
        cap, level, at = b[row * 3], b[row * 3 + 1], b[row * 3 + 2]
        return None if cap == 0.0 else (cap, level, at)

    def set_bucket(self, row: int, capacity: float, level: float, at: float) -> None:
        b = self.buckets
        b[row * 3], b[row * 3 + 1], b[row * 3 + 2] = capacity, level, at


__all__ = ["ROWS", "Board", "BoardFull", "board_size"]
