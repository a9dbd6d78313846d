"""One replica's engine core: the :class:`~.scheduler.Scheduler` driven by a step loop.

The loop sleeps each step's duration (times the ``slow`` factor) on absolute deadlines, so sleep
overshoot does not accumulate, and never busy-waits: with nothing to do it waits for a request.
A stall freezes it with its requests, as vLLM #37729's deadlocked engine core: nothing is
processed, not even aborts (a client that leaves during the stall keeps its slot and blocks until
the stall lifts), so running, waiting and every counter stay as they were. A request arriving
meanwhile is parked where the engine cannot see it. The HTTP side of each request is woken when
it gets tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol

from .scheduler import EngineRequest, Scheduler, StepPlan, StepResult
from .settings import SimSettings

# Sleeps overshoot; the next step may start up to this much early to make up for it.
MAX_CATCH_UP_S = 0.002


class EngineDead(RuntimeError):
    """The engine core is gone (``engine_dead`` fault); requests fail with HTTP 500."""


class EngineObserver(Protocol):
    """What the engine reports (the Prometheus metrics implement it)."""

    def on_step(self, plan: StepPlan, result: StepResult, now: float) -> None: ...

    def on_finished(self, req: EngineRequest, now: float) -> None: ...


class Engine:
    """One replica's engine core: the scheduler driven by a step loop on the event loop."""

    def __init__(
        self,
        settings: SimSettings,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.scheduler = Scheduler(settings)
        self.observer = observer
        self.clock = clock
        self.slow_factor = 1.0
        self.dead: str | None = None  # the error message while the engine is dead
        self.stalled = False
        # A stall armed to begin when some request is about to get a token past this many.
        self.stall_after: int | None = None
        self._deferred_aborts: list[EngineRequest] = []  # aborts that arrived during a stall
        self.completed = 0  # requests finished with stop or length
        self.aborted = 0
        self._parked: list[EngineRequest] = []  # arrived during a stall: never seen
        # Where each step's KV cache events go (``kv_events.KvEventPublisher.publish``).
        self.kv_sink: Callable[[list[tuple[Any, ...]]], None] | None = None
        self._in_transit: set[EngineRequest] = set()  # between API server and engine
        self._wake = asyncio.Event()
        self._unstalled = asyncio.Event()
        self._unstalled.set()
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- requests -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def submit(self, req: EngineRequest) -> None:
        """Hand a request to the engine after the API server's overhead."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        self._in_transit.add(req)
        delay = self.settings.request_overhead_s
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self._arrive, req)
        else:
            self._arrive(req)

    def _arrive(self, req: EngineRequest) -> None:
        if req not in self._in_transit:  # aborted or failed on the way
            return
        self._in_transit.discard(req)
        if self.stalled:
            self._parked.append(req)
            return
        self.scheduler.add(req)
        self._wake.set()

    def abort(self, req: EngineRequest) -> None:
        """The client went away: free the request's slot and blocks at once, unless the engine
        is stalled: a deadlocked engine core processes no aborts, so they wait for the lift."""
        self._in_transit.discard(req)
        if req in self._parked:
            self._parked.remove(req)
            return
        if self.stalled and req.state in ("waiting", "running"):
            if req not in self._deferred_aborts:
                self._deferred_aborts.append(req)
            return
        self._abort_now(req)

    def _abort_now(self, req: EngineRequest) -> None:
        if self.scheduler.abort(req):
            self.aborted += 1
            req.finished_at = self.clock()
            if self.observer is not None:
                self.observer.on_finished(req, req.finished_at)

    # -- faults -------------------------------------------------------------------------------

    def set_stalled(self, stalled: bool) -> None:
        """#37729: the loop freezes with its requests; new ones never reach it until lifted."""
        self.stalled = stalled
        if stalled:
            self._unstalled.clear()
            return
        self.stall_after = None
        deferred, self._deferred_aborts = self._deferred_aborts, []
        for req in deferred:
            self._abort_now(req)
        for req in self._parked:
            self.scheduler.add(req)
        self._parked.clear()
        self._unstalled.set()
        self._wake.set()

    def fail(self, message: str) -> None:
        """EngineCore died: every request in it fails; new ones are refused until revived."""
        self.dead = message
        victims = [*self.scheduler.drain(), *self._parked, *self._in_transit]
        self._deferred_aborts.clear()
        self._parked.clear()
        self._in_transit.clear()
        now = self.clock()
        for req in victims:
            req.state = "finished"
            req.finish_reason = "error"
            req.error = message
            req.finished_at = now
            if self.observer is not None:
                self.observer.on_finished(req, now)
            if req.notify is not None:
                req.notify()

    def revive(self) -> None:
        """A fresh engine core: empty queues and an empty KV cache."""
        self.dead = None
        self.scheduler.pool.reset()
        self._flush_kv_events()
        self._wake.set()

    def _flush_kv_events(self) -> None:
        events = self.scheduler.pool.events
        if events and self.kv_sink is not None:
            self.scheduler.pool.events = []
            self.kv_sink(events)

    # -- the step loop ------------------------------------------------------------------------

    async def _run(self) -> None:
        sched = self.scheduler
        deadline = self.clock()
        while True:
            if self.stalled:
                await self._unstalled.wait()
                deadline = self.clock()
                continue
            if self.dead is not None or not sched.has_work():
                self._wake.clear()
                await self._wake.wait()
                deadline = self.clock()
                continue
            plan = sched.schedule(self.clock())
            if not plan.items:  # cannot happen with valid settings; never spin
                self._wake.clear()
                await self._wake.wait()
                continue
            duration = sched.step_time(plan) * self.slow_factor
            deadline = max(deadline, self.clock() - MAX_CATCH_UP_S) + duration
            await asyncio.sleep(max(0.0, deadline - self.clock()))
            if self.stall_after is not None and _reaches(plan, self.stall_after):
                self.set_stalled(True)
            if self.stalled:  # a stall that begins mid-step holds back that step's tokens
                await self._unstalled.wait()
                deadline = self.clock()
            if self.dead is not None:
                continue
            now = self.clock()
            result = sched.complete(plan, now)
            self._flush_kv_events()  # one batch per step, as vLLM's scheduler publishes
            self.completed += len(result.finished)
            if self.observer is not None:
                self.observer.on_step(plan, result, now)
                for req in result.finished:
                    self.observer.on_finished(req, now)
            for req in result.produced:
                if req.notify is not None:
                    req.notify()


def _reaches(plan: StepPlan, after_tokens: int) -> bool:
    """Whether this step would give some request a token past ``after_tokens``."""
    for req, n in plan.items:
        if (
            req.state == "running"
            and req.num_output >= after_tokens
            and req.num_computed + n >= len(req.tokens)
        ):
            return True
    return False
