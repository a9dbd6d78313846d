"""Continuations re-prefilling at once: bounded for the gateway and per target replica.

A replica that dies holding many streams would otherwise send all of them to re-prefill on the
survivors at once (``continuation.max_in_flight``, ``continuation.max_in_flight_per_replica``,
and ``continuation.max_tokens_in_flight_per_replica``, since a re-prefill costs the survivor its
tokens: one continuation always starts on a replica re-prefilling nothing, however long).
A continuation holds its slot from its start to its first token (its prefill); after that it is
one more stream on its replica, bounded like any other by the replica's ``max_in_flight``.

With workers the bounds hold for the whole serve: a ``Ledger`` (the workers' board) counts
every worker's slots, a slot is taken under its lock, and a worker waiting for a slot looks
again every ``POLL_S`` (a slot freed in another worker wakes nobody here).
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

POLL_S: Final = (
    0.05  # with workers: how often a waiting continuation looks for a slot freed elsewhere
)
TOTAL_ROW: Final = (
    "reprefill"  # the board's row of the serve's re-prefills; per replica + ":" + name
)


class Ledger(Protocol):
    """Counts shared with the serve's other workers (``proxy.workers.link.BoardLedger``)."""

    def claim(self, name: str, limit: int, amount: int = 1) -> bool: ...

    def hold(self, name: str, count: int) -> None: ...


def has_room(
    total: int,
    on_target: int,
    max_total: int,
    max_per_replica: int,
    tokens_on_target: int = 0,
    tokens: int = 0,
    max_tokens_per_replica: int | None = None,
) -> bool:
    """May one more continuation (``tokens`` to re-prefill) start on a replica re-prefilling
    ``on_target`` continuations of ``tokens_on_target`` tokens? A replica re-prefilling
    nothing always takes one, however long (else a long context would never continue)."""
    if total >= max_total or on_target >= max_per_replica:
        return False
    if max_tokens_per_replica is None or tokens_on_target == 0:
        return True
    return tokens_on_target + tokens <= max_tokens_per_replica


class Reprefills:
    """The continuations in their prefill, counted for the gateway and per replica name."""

    def __init__(self, ledger: Ledger | None = None) -> None:
        self.ledger = ledger
        self.total = 0
        self.by_replica: dict[str, int] = {}
        self.tokens_by_replica: dict[str, int] = {}
        self.peak_by_replica: dict[str, int] = {}  # the most at once: what the bound held to
        self.full = 0  # takes refused for want of room (each then waits for a slot)
        self._freed = asyncio.Event()

    def try_take(
        self,
        replica: str,
        max_total: int,
        max_per_replica: int,
        tokens: int = 0,
        max_tokens_per_replica: int | None = None,
    ) -> Slot | None:
        on_tokens = self.tokens_by_replica.get(replica, 0)
        on_target = self.by_replica.get(replica, 0)
        if not has_room(
            self.total, on_target, max_total, max_per_replica, on_tokens, tokens,
            max_tokens_per_replica,
        ):  # fmt: skip
            self.full += 1
            return None
        ledger = self.ledger
        if ledger is not None:  # the serve's other workers count too (each claim is atomic)
            if not ledger.claim(TOTAL_ROW, max_total):
                self.full += 1
                return None
            if not ledger.claim(f"{TOTAL_ROW}:{replica}", max_per_replica):
                ledger.hold(TOTAL_ROW, self.total)  # give the first claim back
                self.full += 1
                return None
            if max_tokens_per_replica is not None and not ledger.claim(
                f"{TOTAL_ROW}:{replica}:tokens", max_tokens_per_replica, max(tokens, 1)
            ):
                ledger.hold(TOTAL_ROW, self.total)  # give both claims back
                ledger.hold(f"{TOTAL_ROW}:{replica}", on_target)
                self.full += 1
                return None
        self.total += 1
        held = self.by_replica[replica] = on_target + 1
        self.tokens_by_replica[replica] = on_tokens + max(tokens, 1)
        self.peak_by_replica[replica] = max(self.peak_by_replica.get(replica, 0), held)
        return Slot(self, replica, max(tokens, 1))

    async def freed(self, timeout_s: float) -> None:
        """Until a slot is given back (here; with workers, or ``POLL_S``), or ``timeout_s``."""
        if self.ledger is not None:
            timeout_s = min(timeout_s, POLL_S)
        if timeout_s <= 0:
            return
        event = self._freed
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            pass

    def _give(self, replica: str, tokens: int) -> None:
        self.total -= 1
        left = self.by_replica[replica] - 1
        tokens_left = self.tokens_by_replica[replica] - tokens
        if left:
            self.by_replica[replica] = left
            self.tokens_by_replica[replica] = tokens_left
        else:
            del self.by_replica[replica]
            del self.tokens_by_replica[replica]
            tokens_left = 0
        if self.ledger is not None:
            self.ledger.hold(TOTAL_ROW, self.total)
            self.ledger.hold(f"{TOTAL_ROW}:{replica}", left)
            self.ledger.hold(f"{TOTAL_ROW}:{replica}:tokens", tokens_left)
        # Wake every waiter once, then arm a fresh event for the next wait.
        self._freed.set()
        self._freed = asyncio.Event()


class Slot:
    """One continuation's place; given back once, however many times ``release`` is called."""

    __slots__ = ("_owner", "_replica", "_tokens")

    def __init__(self, owner: Reprefills, replica: str, tokens: int = 1) -> None:
        self._owner: Reprefills | None = owner
        self._replica = replica
        self._tokens = tokens

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._give(self._replica, self._tokens)
