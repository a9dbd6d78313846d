"""Background loops that end when asked: whether the running task has been cancelled.

A loop that survives an error (a probe, a Redis call) must not survive a cancel. Two ways a
cancel can be lost inside a call: Python 3.11's ``asyncio.timeout`` may turn an outside cancel
that lands as it expires into ``TimeoutError``, and a library may catch ``CancelledError``
(``tests/test_shared.py`` once hung on a sync loop cancelled twice and still looping). The
task still counts the request (``Task.cancelling``), so a loop that asks at every round ends
there instead of never.
"""

from __future__ import annotations

import asyncio


def cancelling() -> bool:
    """Whether the current task is being cancelled (so a caught error must not be survived)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def end_if_cancelled() -> None:
    """``CancelledError`` when the current task has been asked to stop: a background loop
    calls it every round, after the calls that may have lost a cancel."""
    if cancelling():
        raise asyncio.CancelledError


__all__ = ["cancelling", "end_if_cancelled"]
