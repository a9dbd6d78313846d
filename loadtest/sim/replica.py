"""One simulated vLLM replica as state: its engine, metrics, faults and what tests observe
(:class:`Sim`). Serving it over HTTP is ``app.py`` (routes) and ``server.py`` (the socket); this
module knows neither, so the HTTP side depends on the replica and never the other way round.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import secrets
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

from . import faults, kv_events, protocol
from .engine import Engine
from .faults import Fault, FaultError
from .listener import Listener
from .metrics import SimMetrics
from .settings import SimSettings, options_from_json, validated

log = logging.getLogger("tokenlane.sim")

ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class Sim:
    """One simulated replica: engine, metrics, faults and what tests observe."""

    def __init__(
        self, settings: SimSettings, *, on_crash: Callable[[Fault], None] | None = None
    ) -> None:
        self.settings = validated(settings)
        self.created = int(time.time())
        self.fingerprint = f"vllm-{protocol.VLLM_VERSION}-{zlib.crc32(settings.name.encode()):08x}"
        self.on_crash = on_crash
        self.listener: Listener | None = None
        self.fault: Fault | None = None
        self._fault_until: float | None = None
        self._fault_timer: asyncio.TimerHandle | None = None
        self._fault_lock = asyncio.Lock()
        self._rng = random.Random(settings.seed)
        self._key_hash = (
            hashlib.sha256(settings.api_key.encode()).digest() if settings.api_key else None
        )
        self.requests_received = 0
        self.requests_by_path: Counter[str] = Counter()
        self.disconnects = 0
        self.request_log: deque[dict[str, Any]] = deque(maxlen=max(1, settings.request_log_size))
        self.engine: Engine
        self.metrics: SimMetrics
        options = options_from_json(settings.kv_events_config)
        self.kv_events = (
            kv_events.KvEventPublisher(options, settings.block_size) if options else None
        )
        self._new_engine()
        self._scrape_key: tuple[Any, ...] | None = None
        self._scrape: bytes = b""

    def _new_engine(self, restarted: bool = False) -> None:
        self.metrics = SimMetrics(self.settings)
        self.engine = Engine(self.settings, self.metrics)
        engine = self.engine
        if self.kv_events is not None:
            self.kv_events.new_engine(restarted)
            engine.scheduler.pool.events = []
            engine.kv_sink = self.kv_events.publish
        self.metrics.bind(
            lambda: engine.num_running,
            lambda: engine.num_waiting,
            lambda: engine.scheduler.pool.usage,
        )

    @property
    def url(self) -> str:
        if self.listener is None:
            raise RuntimeError("this simulator does not own a socket (use run_sim)")
        host = f"[{self.listener.host}]" if ":" in self.listener.host else self.listener.host
        return f"http://{host}:{self.listener.port}"

    # -- observability --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        e = self.engine
        return {
            "name": self.settings.name,
            "requests_received": self.requests_received,
            "requests_by_path": dict(self.requests_by_path),
            "disconnects": self.disconnects,
            "running": e.num_running,
            "waiting": e.num_waiting,
            "completed": e.completed,
            "aborted": e.aborted,
            "preemptions": e.scheduler.num_preemptions,
            "kv_cache_usage": round(e.scheduler.pool.usage, 6),
            "fault": self.fault.name if self.fault else None,
        }

    def requests(self, path: str | None = None) -> list[dict[str, Any]]:
        if self.settings.request_log_size <= 0:
            return []
        return [r for r in self.request_log if path is None or r["path"] == path]

    def metrics_text(self) -> bytes:
        # Rendering costs a few ms, so it is redone only when something changed.
        e, m = self.engine, self.metrics
        key = (id(m), m.steps, m.finished, e.num_running, e.num_waiting)
        if key != self._scrape_key:
            self._scrape = self.metrics.render()
            self._scrape_key = key
        return self._scrape

    def describe_fault(self) -> dict[str, Any]:
        if self.fault is None:
            return {"fault": None}
        remaining = None
        if self._fault_until is not None:
            remaining = self._fault_until - time.monotonic()
        return self.fault.describe(remaining)

    # -- faults ---------------------------------------------------------------------------------

    async def set_fault(self, fault: Fault | Mapping[str, Any] | None) -> None:
        """Replace the current fault (None lifts it); ``duration_s`` lifts it by itself."""
        if isinstance(fault, Mapping):
            fault = faults.parse(fault, require_duration=False)
        if fault is not None and fault.name in faults.UNREACHABLE and self.listener is None:
            if not (fault.name == "crash" and self.on_crash is not None):
                raise FaultError(f"{fault.name} needs a simulator that owns its socket (run_sim)")
        async with self._fault_lock:
            await self._lift()
            if fault is None:
                return
            self.fault = fault
            loop = asyncio.get_running_loop()
            if fault.duration_s is not None:
                self._fault_until = time.monotonic() + fault.duration_s
                self._fault_timer = loop.call_later(
                    fault.duration_s, lambda: loop.create_task(self._expire(fault))
                )
            await self._apply(fault)

    async def _expire(self, fault: Fault) -> None:
        if self.fault is fault:
            await self.set_fault(None)

    async def _apply(self, fault: Fault) -> None:
        engine = self.engine
        name = fault.name
        if name == "stall":
            after = fault.params.get("after_tokens")
            if after is None:
                engine.set_stalled(True)
            else:
                engine.stall_after = int(after)
        elif name == "slow":
            engine.slow_factor = float(fault.params["factor"])
        elif name == "engine_dead":
            engine.fail(ENGINE_DEAD_MESSAGE)
        elif name == "crash" and self.on_crash is not None:
            self.on_crash(fault)
        elif name in faults.UNREACHABLE:
            assert self.listener is not None
            if name == "crash":
                self.listener.abort_connections()
            self.listener.close()
            if name == "crash":
                await engine.stop()
                engine.fail(ENGINE_DEAD_MESSAGE)
                self._new_engine(restarted=True)
                self.engine.start()
            if name == "hang_accept":
                await self.listener.hang()
        log.info("%s: fault %s", self.settings.name, fault.describe())

    async def _lift(self) -> None:
        if self._fault_timer is not None:
            self._fault_timer.cancel()
            self._fault_timer = None
        fault, self.fault, self._fault_until = self.fault, None, None
        if fault is None:
            return
        name = fault.name
        if name == "stall":
            self.engine.set_stalled(False)  # also disarms a stall that has not begun
        elif name == "slow":
            self.engine.slow_factor = 1.0
        elif name == "engine_dead":
            self.engine.revive()
        elif name in faults.UNREACHABLE and self.listener is not None:
            if name == "hang_accept":
                self.listener.unhang()
            await self.listener.open()
        log.info("%s: fault %s lifted", self.settings.name, name)

    # -- auth -----------------------------------------------------------------------------------

    def authorized(self, authorization: str | None) -> bool:
        if self._key_hash is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._key_hash)

    async def reset_connection(self, client: tuple[str, int] | None) -> bool:
        """Reset (TCP RST) the connection of the client at ``client``, once what was written to
        it has left; False if this replica does not own its socket."""
        if self.listener is None or client is None:
            return False
        return await self.listener.reset(client)

    def error_rate_hit(self) -> int | None:
        """The status to fail this generation request with, under ``error_rate``."""
        f = self.fault
        if f is None or f.name != "error_rate":
            return None
        return int(f.params["status"]) if self._rng.random() < float(f.params["rate"]) else None

    def error_rate_error(self) -> protocol.ApiError | None:
        """``error_rate_hit`` as the error to answer with (its status, vLLM's type)."""
        status = self.error_rate_hit()
        if status is None:
            return None
        message = f"Simulated fault: error_rate (status {status})"
        return protocol.ApiError(status, message, protocol.error_type(status))

    async def close(self) -> None:
        """Stop everything the replica runs in the background (the app's lifespan ends)."""
        if self._fault_timer is not None:
            self._fault_timer.cancel()
            self._fault_timer = None
        if self.listener is not None:
            self.listener.unhang()
        await self.engine.stop()
        if self.kv_events is not None:
            await self.kv_events.close()
