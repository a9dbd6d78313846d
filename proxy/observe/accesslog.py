"""The access log: one JSON line per request on the ``tokenlane.access`` logger (stdout).

Lines are written with the rest of a request's outcome, off its path (``outcomes.Outcomes``).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proxy.relay.call import Call

logger = logging.getLogger("tokenlane.access")


def write_line(call: Call, duration_s: float, ts: float, log: logging.Logger = logger) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info(json.dumps(record_of(call, duration_s, ts), separators=(",", ":")))


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
        # cache_aware pools only: the prompt tokens the chosen replica was judged to hold
        "prefix_match_tokens": call.prefix_match_tokens,
    }


__all__ = ["logger", "record_of", "write_line"]
