"""The suite's one way to wait for something to become true.

Tests wait on a condition that proves the other side acted (a counter, a state, a log line, a
file), never on a fixed sleep. The timeout is only a backstop for a test that would otherwise
hang: it is wide (the suite runs on loaded two-core machines), and when it expires the failure
says what was awaited and what the condition last returned.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

TIMEOUT_S = 30.0  # a backstop, not a claim about speed: machines under load are slow
POLL_S = 0.01


class WaitTimeout(AssertionError):
    """What was awaited did not come true in time: a failed test, or (for start-up helpers
    that add the child's stderr) caught and reported."""


def _fail(what: str, timeout: float, last: object) -> None:
    raise WaitTimeout(f"not within {timeout:g}s: {what} (last seen: {last!r:.200})")


async def wait_until(
    pred: Callable[[], object], *, what: str, timeout: float = TIMEOUT_S, poll: float = POLL_S
) -> float:
    """Seconds until ``pred()`` is truthy, polling every ``poll`` without blocking the loop;
    fails the test after ``timeout`` saying ``what`` was awaited. ``pred`` may be a coroutine
    function (an HTTP request, say): its result is awaited."""
    start = time.monotonic()
    while True:
        last = pred()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            _fail(what, timeout, last)
        await asyncio.sleep(poll)


def wait_until_sync(
    pred: Callable[[], object], *, what: str, timeout: float = TIMEOUT_S, poll: float = POLL_S
) -> float:
    """``wait_until`` for code outside an event loop (subprocesses, threads, files)."""
    start = time.monotonic()
    while not (last := pred()):
        if time.monotonic() - start > timeout:
            _fail(what, timeout, last)
        time.sleep(poll)
    return time.monotonic() - start
