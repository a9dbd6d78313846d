"""A call that loses its first cancel, as a library may: for the tests of the background loops
that must end all the same (``proxy/tasks.py``)."""

from __future__ import annotations

import asyncio


class LostCancel:
    """``wait`` runs until cancelled. The first cancel goes no further: swallowed, or turned into
    ``becomes`` (Python 3.11's ``asyncio.timeout`` may turn a cancel that lands as it expires
    into ``TimeoutError``). A later cancel is raised, so a loop that fails its test still ends
    at teardown."""

    def __init__(self, becomes: type[Exception] | None = None) -> None:
        self.becomes = becomes
        self.entered = asyncio.Event()  # ``wait`` was called
        self.swallowed = asyncio.Event()  # its first cancel was lost

    async def wait(self) -> None:
        self.entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if self.swallowed.is_set():
                raise
            self.swallowed.set()
            if self.becomes is not None:
                raise self.becomes from None


async def ended_in_time(task: asyncio.Task[None], timeout_s: float = 30.0) -> bool:
    """Whether ``task`` ended within ``timeout_s``. Waited on with ``asyncio.wait``, which
    leaves it running when time is up (``wait_for`` would cancel it, and that second cancel
    would end a loop that lost its first and hide the failure); then cancelled again, so that
    it ends before the test reports."""
    await asyncio.wait({task}, timeout=timeout_s)
    if task.done():
        return True
    task.cancel()
    await asyncio.wait({task})
    return False
