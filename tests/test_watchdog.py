"""The first-token watchdog (``proxy/relay/watchdog.py``): whose cancellation is whose, as
``asyncio.timeout_at`` tells them apart, on a timer of its own and on the relay's shared ones
(``Alarms``, late by up to ``SLOT_S``). Every "did not fire" is asserted after a later timer
of the same loop has run: timers run in the order of their times."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.relay.watchdog import SLOT_S, Alarms
from proxy.relay.watchdog import Watchdog as _Watchdog

_SHARED: Alarms | None = None  # the timers the tests' watchdogs are armed on (``mode``)


@pytest.fixture(autouse=True, params=["own timer", "shared timers"])
def mode(request: pytest.FixtureRequest) -> Any:
    """Every test twice: each watchdog on a timer of its own, then on shared ``Alarms``."""
    global _SHARED
    _SHARED = Alarms() if request.param == "shared timers" else None
    yield request.param
    _SHARED = None


def Watchdog(  # stands in for the class in the tests below
    loop: asyncio.AbstractEventLoop, when: float | None, task: Any = None
) -> _Watchdog:
    return _Watchdog(loop, when, task, _SHARED)


async def _past(when: float) -> None:
    """Return once the loop has run its timers up to ``when`` (and a hair beyond; past the
    slot it falls in, on shared timers)."""
    loop = asyncio.get_running_loop()
    passed = asyncio.Event()
    loop.call_at(when + 0.002 + (SLOT_S if _SHARED is not None else 0.0), passed.set)
    await passed.wait()


async def test_it_cancels_its_task_at_its_time_and_says_the_cancellation_is_its_own() -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    watchdog = Watchdog(loop, loop.time() + 0.01)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.Event().wait()  # a replica that never answers
    assert watchdog.close(cancelled=True) is True
    assert task.cancelling() == 0  # taken back: the task goes on
    assert watchdog.close(cancelled=True) is False  # settled once


async def test_disarmed_or_closed_before_its_time_it_never_fires() -> None:
    loop = asyncio.get_running_loop()
    when = loop.time() + 0.01
    disarmed = Watchdog(loop, when)
    disarmed.reschedule(None)  # the client has bytes
    closed = Watchdog(loop, when)
    assert closed.close(cancelled=False) is False
    never = Watchdog(loop, None)
    await _past(when)  # no CancelledError on the way
    assert [w.close(cancelled=False) for w in (disarmed, closed, never)] == [False] * 3


async def test_rescheduled_it_fires_at_the_new_time_only() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    watchdog = Watchdog(loop, start + 0.01)
    watchdog.reschedule(start + 0.05)
    await _past(start + 0.01)  # the first time passed without a cancellation
    with pytest.raises(asyncio.CancelledError):
        await asyncio.Event().wait()
    assert loop.time() >= start + 0.05 - 0.001  # uvloop's timers are in milliseconds
    assert watchdog.close(cancelled=True) is True


async def test_a_cancellation_of_someone_else_is_not_taken_for_a_timeout() -> None:
    """The client left (the task is cancelled from outside) while the watchdog was armed."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    watchdog = Watchdog(loop, loop.time() + 60)
    loop.call_soon(task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.Event().wait()
    assert watchdog.close(cancelled=True) is False
    assert task.uncancel() == 0  # the outside cancellation was left as it was: one


async def test_fired_and_cancelled_from_outside_too_the_outside_one_wins() -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    when = loop.time() + 0.01
    watchdog = Watchdog(loop, when)
    # After the watchdog's own timer, at the same time (shared: its slot's end).
    at = when if _SHARED is None else (int(when / SLOT_S) + 1) * SLOT_S
    loop.call_at(at, task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.Event().wait()
    assert watchdog.close(cancelled=True) is False  # the watchdog's is taken back only
    assert task.cancelling() == 1
    task.uncancel()


async def test_fired_while_the_block_ended_another_way_its_cancellation_is_taken_back() -> None:
    """As ``asyncio.Timeout``: something inside turned the cancellation into another error;
    that error is not replaced, and no cancellation of the watchdog's is left on the task."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    watchdog = Watchdog(loop, loop.time() + 0.01)
    with pytest.raises(ValueError):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ValueError("handled inside") from None
    assert task.cancelling() == 1
    assert watchdog.close(cancelled=False) is False
    assert task.cancelling() == 0


def test_it_needs_a_task_to_cancel() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(RuntimeError, match="inside"):
            Watchdog(loop, None)
    finally:
        loop.close()


async def test_given_its_task_it_cancels_that_one() -> None:
    # The relay names the request's task (``Call.task``) rather than asking asyncio for it.
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    watchdog = Watchdog(loop, loop.time() + 0.01, task)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.Event().wait()
    assert watchdog.close(cancelled=True) is True
    assert task.cancelling() == 0


async def test_shared_watchdogs_due_in_one_slot_share_its_timer_and_leave_it_when_closed() -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    alarms = Alarms()
    # Three due within one slot (a slot starts at a multiple of SLOT_S), one far later.
    start = (int(loop.time() / SLOT_S) + 5) * SLOT_S
    near = [_Watchdog(loop, start + SLOT_S * f, task, alarms) for f in (0.1, 0.4, 0.7)]
    far = _Watchdog(loop, start + 60, task, alarms)
    assert len(alarms) == 4 and len(alarms._slots) == 2  # two slots: two timers
    near[1].reschedule(None)
    assert len(alarms) == 3
    for w in (*near, far):
        assert w.close(cancelled=False) is False
    assert len(alarms) == 0
    await _past(start + SLOT_S)  # the near slot's timer ran, its slot empty: nothing fired
    assert len(alarms._slots) == 1  # the far one's slot waits for its timer (never cancelled)


async def test_a_shared_watchdog_never_fires_before_its_time() -> None:
    loop = asyncio.get_running_loop()
    alarms = Alarms()
    when = loop.time() + 0.03
    watchdog = _Watchdog(loop, when, asyncio.current_task(), alarms)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.Event().wait()
    assert loop.time() >= when - 0.001  # uvloop's timers are in milliseconds
    assert watchdog.close(cancelled=True) is True
