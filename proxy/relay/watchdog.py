"""An attempt's first-token watchdog: cancels the attempt's task when its time comes, as
``asyncio.timeout_at`` does, at a quarter of its cost per request.

``asyncio.Timeout`` is interpreted code (an async context manager, ``current_task``, a state
enum) on every request's path; this is one compiled object and one timer handle
(``proxy/compiled.py``). The cancellation's bookkeeping is ``asyncio.Timeout``'s: the task's
cancel count at arming is remembered, and a cancellation is the watchdog's own only when
uncancelling it brings the count back to that (anything else, a client that left or a
shutdown's cut, is someone else's and goes on).

The relay's watchdogs share their timers (``Alarms``): a loop timer made, cancelled and freed
for every request was about 7,000 instructions of it (callgrind), where the requests that
start within one ``SLOT_S`` share one timer, which none cancels. The price: such a watchdog
fires up to ``SLOT_S`` after its time.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

SLOT_S: Final = 0.01  # how late a watchdog of ``Alarms`` may fire after its time


class Alarms:
    """Watchdogs due in the same ``SLOT_S`` of loop time, fired by one timer at its end.

    A watchdog is put in its slot when armed and taken out when disarmed (a dict each: an
    insertion and a deletion); the slot's timer, made by the first watchdog due in it, is
    never cancelled: it finds its slot empty, or fires what is still in it."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: dict[int, dict[Watchdog, None]] = {}

    def arm(self, loop: asyncio.AbstractEventLoop, watchdog: Watchdog, when: float) -> int:
        """Put ``watchdog`` in the slot ending at or after ``when``; that slot's number."""
        slot = int(when / SLOT_S) + 1
        due = self._slots.get(slot)
        if due is None:
            due = self._slots[slot] = {}
            loop.call_at(slot * SLOT_S, self._fire, slot)
        due[watchdog] = None
        return slot

    def disarm(self, watchdog: Watchdog, slot: int) -> None:
        due = self._slots.get(slot)
        if due is not None:
            due.pop(watchdog, None)

    def _fire(self, slot: int) -> None:
        due = self._slots.pop(slot, None)
        if due:
            for watchdog in list(due):
                watchdog._fire()

    def __len__(self) -> int:
        """The watchdogs armed (each in one slot)."""
        return sum(len(due) for due in self._slots.values())


class Watchdog:
    """Armed on creation for ``when`` (event loop time; None: never); ``reschedule`` moves or
    disarms it; ``close`` ends it and says whether the cancellation being raised is its own.

    Use::

        watchdog = Watchdog(loop, when)
        try:
            ...
        except asyncio.CancelledError:
            if watchdog.close(cancelled=True):
                raise <the timeout's fault> from None
            raise
        finally:
            watchdog.close(cancelled=False)
    """

    __slots__ = ("_alarms", "_cancelling", "_fired", "_handle", "_loop", "_slot", "_task")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        when: float | None,
        task: asyncio.Task[Any] | None = None,
        alarms: Alarms | None = None,
    ) -> None:
        # ``task``: the task it runs in, when the caller knows it (a request's ``Call.task``,
        # named by the server): asyncio's ``current_task`` is interpreted in Python 3.11.
        # ``alarms``: the shared timers it is armed on (late by up to ``SLOT_S``); else a
        # timer of its own, at its time.
        if task is None:
            task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a watchdog cancels a task: create it inside one")
        self._loop = loop
        self._task: asyncio.Task[Any] = task
        self._cancelling = task.cancelling()
        self._fired = False
        self._handle: asyncio.TimerHandle | None = None
        self._alarms = alarms
        self._slot = 0  # its slot in ``alarms`` while armed there, else 0
        if when is not None:
            self._arm(when)

    def _arm(self, when: float) -> None:
        alarms = self._alarms
        if alarms is not None:
            self._slot = alarms.arm(self._loop, self, when)
        else:
            self._handle = self._loop.call_at(when, self._fire)

    def _disarm(self) -> None:
        handle = self._handle
        if handle is not None:
            handle.cancel()
            self._handle = None
        if self._slot:
            alarms = self._alarms
            assert alarms is not None
            alarms.disarm(self, self._slot)
            self._slot = 0

    def reschedule(self, when: float | None) -> None:
        """Fire at ``when`` instead; None disarms (the client has bytes: no retry)."""
        self._disarm()
        if when is not None and not self._fired:
            self._arm(when)

    def _fire(self) -> None:
        self._handle = None
        self._slot = 0
        self._fired = True
        self._task.cancel()

    def close(self, *, cancelled: bool) -> bool:
        """Disarm. After it fired, its cancellation is taken back from the task (``uncancel``)
        and True is returned when ``cancelled`` (a ``CancelledError`` is being raised) and no
        other cancellation is pending: that error is the watchdog's timeout. Again: False."""
        self._disarm()
        if not self._fired:
            return False
        self._fired = False
        return self._task.uncancel() <= self._cancelling and cancelled


__all__ = ["SLOT_S", "Alarms", "Watchdog"]
