"""The access log: one JSON line per request, written off the request's path.

A request's line is queued when the request ends and written, with every line queued by then,
within ``FLUSH_S`` (as Envoy's file access log flushes on an interval) or as soon as
``MAX_QUEUED`` lines wait; a process killed outright loses at most the last ``FLUSH_S``.
Building and writing a line costs tens of microseconds: written on the spot, that work sat
between a response and the next request on its connection, adding 0.1 ms to every request at
concurrency 1. Lines go through the ``tokenlane.access`` logger, so they reach whatever
handlers the process configures; ``close()`` runs on shutdown.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .relay import Call

FLUSH_S = 0.01
MAX_QUEUED = 256

logger = logging.getLogger("tokenlane.access")


class AccessLog:
    def __init__(self, log: logging.Logger = logger) -> None:
        self.log = log
        self._queued: list[tuple[Call, float, float]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.log.isEnabledFor(logging.INFO)

    def add(self, call: Call, duration_s: float) -> None:
        """Queue ``call``'s line (the call is done: nothing in it changes any more)."""
        self._queued.append((call, duration_s, time.time()))
        if self._closed or len(self._queued) >= MAX_QUEUED:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(FLUSH_S, self.flush)

    def close(self) -> None:
        """Write what waits; from now on every line is written at once (no timer is left
        behind on a loop that is ending)."""
        self._closed = True
        self.flush()

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        queued, self._queued = self._queued, []
        for call, duration_s, ts in queued:
            self.log.info(json.dumps(record_of(call, duration_s, ts), separators=(",", ":")))


def record_of(call: Call, duration_s: float, ts: float) -> dict[str, Any]:
    """A request's access-log record: no body, no header, so no secret."""
    usage = call.usage
    profile = call.profile
    return {
        "ts": round(ts, 3),
        "request_id": call.request_id,
        "path": call.path,
        "lane": call.lane.name,
        "pool": call.pool,
        "replica": call.replica.name if call.replica is not None else None,
        "status": call.status,
        "stream": call.stream,
        "model": call.model,
        "prompt_tokens_est": profile.prompt_tokens_est if profile else None,
        "prompt_tokens": usage.get("prompt_tokens") if usage else None,
        "output_tokens": usage.get("completion_tokens") if usage else None,
        "content_chunks": call.content_chunks if call.stream else None,
        "queue_wait_ms": round(call.queue_wait_s * 1000, 2),
        "ttft_ms": round(call.ttft_s * 1000, 2) if call.ttft_s is not None else None,
        "duration_ms": round(duration_s * 1000, 2),
        "retries": call.retries,
        "error": call.error,
        "client_disconnected": call.disconnected or None,
    }


__all__ = ["FLUSH_S", "MAX_QUEUED", "AccessLog", "record_of"]
