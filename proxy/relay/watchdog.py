"""An attempt's first-token watchdog: cancels the attempt's task when its time comes, as
``asyncio.timeout_at`` does, at a quarter of its cost per request.

``asyncio.Timeout`` is interpreted code (an async context manager, ``current_task``, a state
enum) on every request's path; this is one compiled object and one timer handle
(``proxy/compiled.py``). The cancellation's bookkeeping is ``asyncio.Timeout``'s: the task's
cancel count at arming is remembered, and a cancellation is the watchdog's own only when
uncancelling it brings the count back to that (anything else, a client that left or a
shutdown's cut, is someone else's and goes on).
"""

from __future__ import annotations

import asyncio
from typing import Any


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

    __slots__ = ("_cancelling", "_fired", "_handle", "_loop", "_task")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        when: float | None,
        task: asyncio.Task[Any] | None = None,
    ) -> None:
        # ``task``: the task it runs in, when the caller knows it (a request's ``Call.task``,
        # named by the server): asyncio's ``current_task`` is interpreted in Python 3.11.
        if task is None:
            task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a watchdog cancels a task: create it inside one")
        self._loop = loop
        self._task: asyncio.Task[Any] = task
        self._cancelling = task.cancelling()
        self._fired = False
        self._handle: asyncio.TimerHandle | None = None
        if when is not None:
            self._handle = loop.call_at(when, self._fire)

    def reschedule(self, when: float | None) -> None:
        """Fire at ``when`` instead; None disarms (the client has bytes: no retry)."""
        handle = self._handle
        if handle is not None:
            handle.cancel()
            self._handle = None
        if when is not None and not self._fired:
            self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._fired = True
        self._task.cancel()

    def close(self, *, cancelled: bool) -> bool:
        """Disarm. After it fired, its cancellation is taken back from the task (``uncancel``)
        and True is returned when ``cancelled`` (a ``CancelledError`` is being raised) and no
        other cancellation is pending: that error is the watchdog's timeout. Again: False."""
        handle = self._handle
        if handle is not None:
            handle.cancel()
            self._handle = None
        if not self._fired:
            return False
        self._fired = False
        return self._task.uncancel() <= self._cancelling and cancelled


__all__ = ["Watchdog"]
