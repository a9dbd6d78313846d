"""An access line: a request's record (``record_of``, ``refusal_record``), as compact JSON,
handed to the access log's handler (``proxy.observe.accesslog``).

Compiled (``proxy/compiled.py``): a line is made for every request, and made interpreted it
was 2.9 % of a burst request's samples under ``perf``.
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Any, Final

import msgspec

from proxy.observe.accesslog import PLAIN, BatchedLines, flush_lines, logger

if TYPE_CHECKING:
    from proxy.relay.call import Call

_ENCODER: Final = msgspec.json.Encoder()
_INF: Final = math.inf


def encode_line(record: dict[str, Any]) -> str:
    """``record`` as one line of compact JSON, as ``json.dumps(record, separators=(",", ":"))``
    writes it, in an eighth of the time (``loadtest/bench_parse.py``). msgspec writes text
    beyond ASCII as UTF-8 where ``json`` escapes it: such a line is written by ``json``, as
    it always was. Otherwise the two differ only where a record never goes: the exponent
    form of floats under 1e-4 or from 1e16 (``1e16`` for ``1e+16``; both JSON), and NaN
    (null, where ``json`` writes ``NaN``, which is not JSON)."""
    line = _ENCODER.encode(record)
    if line.isascii():
        return line.decode()
    return json.dumps(record, separators=(",", ":"))


def _emit(log: logging.Logger, line: str) -> None:
    # The usual set-up (``configure_logging``): the line straight to the one handler's stream,
    # as its ``emit`` would write it; a log record and its handling cost 7.5 µs more a line
    # (timeit). Else ``log.info`` less its ``findCaller``, a walk of the stack for a source
    # line nobody reads.
    handler = _plain_handler(log)
    if handler is not None:
        if handler.level <= logging.INFO:
            handler.write(line)
        return
    log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, line, (), None))


def _plain_handler(log: logging.Logger) -> BatchedLines | None:
    """The access log's one handler when it writes lines as they are (the usual set-up)."""
    handlers = log.handlers
    if len(handlers) == 1 and not log.propagate and not log.filters:
        handler = handlers[0]
        if type(handler) is BatchedLines and handler.formatter is PLAIN and not handler.filters:
            return handler
    return None


def write_line(call: Call, duration_s: float, ts: float, log: logging.Logger = logger) -> None:
    if log.isEnabledFor(logging.INFO):
        _emit(log, encode_line(record_of(call, duration_s, ts)))


def write_lines(ended: list[tuple[Call, float, float]], log: logging.Logger = logger) -> None:
    """``write_line`` of each of a batch's finished requests (call, duration, wall-clock end),
    in order: the level asked and the handler found once a batch, the lines handed to it in
    one call (``BatchedLines.write_all``), where per line each was a call into interpreted
    ``logging`` code, twice a request."""
    if not ended or not log.isEnabledFor(logging.INFO):
        return
    lines = [encode_line(record_of(call, duration_s, ts)) for call, duration_s, ts in ended]
    handler = _plain_handler(log)
    if handler is not None:
        if handler.level <= logging.INFO:
            handler.write_all(lines)
        return
    for line in lines:
        _emit(log, line)


def rounded(value: float, scale: float) -> float:
    """``value`` to ``1 / scale`` (1000: three decimals), as ``round(value, 3)`` gives it but
    for a tie, which goes up: ``round`` with digits formats and parses the number (about
    2,700 instructions a call, four a request: 2 % of a plain request's, counted with
    callgrind), this is a multiplication and a division. The quotient of a whole number by a
    power of ten is the double nearest that decimal, so it prints as at most three decimals."""
    scaled = value * scale
    # ``math.isfinite`` spelled as comparisons (false for nan): compiled, the function is a
    # lookup in the module's dict per call, four a request.
    if not -_INF < scaled < _INF:
        return value  # inf, nan, or too large to scale: as round gives it
    return math.floor(scaled + 0.5) / scale


def record_of(call: Call, duration_s: float, ts: float) -> dict[str, Any]:
    """A request's access-log record: no body, no header, so no secret."""
    usage = call.usage
    profile = call.profile
    return {
        "ts": rounded(ts, 1000.0),
        "request_id": call.request_id,
        "path": call.path,
        "api": call.kind,  # chat, completion, messages, responses, other (pass-through)
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
        "queue_wait_ms": rounded(call.queue_wait_s * 1000, 100.0),
        "ttft_ms": rounded(call.ttft_s * 1000, 100.0) if call.ttft_s is not None else None,
        "duration_ms": rounded(duration_s * 1000, 100.0),
        "retries": call.retries,
        "error": call.error,
        "client_disconnected": call.disconnected or None,
        # who produced the error: "gateway" (its own refusal or failure) or "replica" (a
        # relayed upstream error); null on success
        "error_origin": call.error_origin,
        # cache_aware pools only: the prompt tokens the chosen replica was judged to hold
        "prefix_match_tokens": call.prefix_match_tokens,
        # each seam of a stream continued on another replica: from, to, at_token, trigger
        "continuations": _seams(call),
    }


def _seams(call: Call) -> list[dict[str, Any]] | None:
    splice = call.continuation
    seams = getattr(splice, "seams", None) if splice is not None else None
    return list(seams) if seams else None


def refusal_record(
    path: str, status: int, request_id: str | None, error: str, duration_s: float, ts: float
) -> dict[str, Any]:
    """The access-log record of a request the gateway refused before it was a relayed call
    (401, 400, 404, 405, 413, 503 on shutdown...): the same fields, those never reached null,
    so a brute force or a fuzzer shows in the log line by line."""
    return {
        "ts": rounded(ts, 1000.0),
        "request_id": request_id,
        "path": path,
        "api": None,
        "lane": None,
        "pool": None,
        "replica": None,
        "status": status,
        "stream": None,
        "model": None,
        "prompt_tokens_est": None,
        "prompt_tokens": None,
        "output_tokens": None,
        "content_chunks": None,
        "queue_wait_ms": 0.0,
        "ttft_ms": None,
        "duration_ms": rounded(duration_s * 1000, 100.0),
        "retries": 0,
        "error": error,
        "client_disconnected": None,
        "error_origin": "gateway",
        "prefix_match_tokens": None,
        "continuations": None,
    }


def write_refusal(
    path: str,
    status: int,
    request_id: str | None,
    error: str,
    duration_s: float,
    ts: float,
    log: logging.Logger = logger,
) -> None:
    if log.isEnabledFor(logging.INFO):
        record = refusal_record(path, status, request_id, error, duration_s, ts)
        _emit(log, encode_line(record))
        flush_lines(log)  # written on the spot, not in a batch


__all__ = [
    "encode_line",
    "record_of",
    "refusal_record",
    "write_line",
    "write_lines",
    "write_refusal",
]
