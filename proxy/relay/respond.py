"""How an upstream answer reaches the client: the response start (headers relayed and added),
a whole answer, a pass-through body, a stream (held until its first content, then chunk by
chunk), and the in-band error event that ends a stream the gateway must end.

The relay (``proxy.relay.relay``) decides which of these an attempt's answer gets and owns the
attempt around it; nothing here retries or judges a replica.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Final

from proxy.edge.asgi_ext import START_BODY, START_MORE_BODY, BodyWriter
from proxy.errors import AttemptFault, Fault, StreamCut, sse_error_event
from proxy.fleet.fleet import Replica
from proxy.headers import LOWER
from proxy.observe.gaps import Gaps
from proxy.observe.metrics import Metrics
from proxy.observe.tracing import Tracer
from proxy.relay import sse
from proxy.relay.call import Attempt, Call
from proxy.relay.h1 import PAUSE
from proxy.relay.homes import ResponseHomes
from proxy.relay.reply import Reply
from proxy.relay.retry import Phase
from proxy.relay.watchdog import Watchdog

if TYPE_CHECKING:
    from starlette.types import Send

    from proxy.config import Policy

# The gateway's clock for durations: monotonic, the clock of ``Attempt.last_progress`` and the
# stall detectors, so that a relayed chunk's one reading serves its progress and its pace.
now: Final = time.monotonic

# Hop-by-hop headers (RFC 9110 7.6.1): about one connection, never relayed either way.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te",
     b"trailer", b"upgrade"}
)  # fmt: skip
# Not relayed back: hop-by-hop, and what the ASGI server or the gateway sets itself.
_DROP_DOWNSTREAM: Final = HOP_BY_HOP | {b"date", b"server", b"x-request-id"}
_DROP_DOWNSTREAM_STREAM: Final = _DROP_DOWNSTREAM | {b"content-length"}


class Responder:
    """Writes attempts' answers to clients. ``policy`` is the gateway's getter (a reload
    swaps it); ``tracer`` None is tracing off; ``homes`` learns stored responses' replicas."""

    def __init__(
        self,
        metrics: Metrics,
        policy: Callable[[], Policy],
        tracer: Tracer | None,
        homes: ResponseHomes,
    ) -> None:
        self.metrics = metrics
        self.policy = policy
        self.tracer = tracer
        self.homes = homes

    def response_start(self, call: Call, response: Reply, status: int) -> dict[str, Any]:
        # A relayed stream is re-framed by the ASGI server (chunked): its length cannot stay.
        drop = _DROP_DOWNSTREAM_STREAM if call.stream else _DROP_DOWNSTREAM
        headers = [(k, v) for k, v in response.headers.raw if k.translate(LOWER) not in drop]
        headers.append((b"x-request-id", call.request_id.encode()))
        if call.extra_headers:
            headers += call.extra_headers
        if self.policy().server.response_headers:
            headers.append((b"x-tokenlane-lane", call.lane.name.encode()))
            if call.replica is not None:
                headers.append((b"x-tokenlane-replica", call.replica.name.encode()))
        return {"type": "http.response.start", "status": status, "headers": headers}

    async def relay_whole(
        self,
        call: Call,
        attempt: Attempt,
        response: Reply,
        send: Send,
        watchdog: Watchdog,
    ) -> None:
        """A plain chat or completion response (or an error status): read it whole (its usage
        is parsed), then send it unchanged."""
        # Raw bytes, as the stream path relays them: ``aread()`` would undo a Content-Encoding
        # the headers still announce (with the compressed Content-Length).
        body = b"".join([part async for part in response.chunks()])
        watchdog.reschedule(None)  # from here on the client has bytes: no retry
        attempt.last_progress = time.monotonic()
        call.status = response.status_code
        if call.status >= 400:
            call.error_origin = "replica"  # the replica's own answer, relayed
        if call.status == 200 and call.kind != "other":
            with contextlib.suppress(ValueError):
                answer = sse.decode_json(body)
                call.usage = sse.usage_of(answer)
                call.finish_reasons = sse.finish_reasons_of(answer)
                if call.kind == "responses":
                    self._remember(answer, attempt.replica)
        call.started = True
        attempt.phase = Phase.CONTENT
        await self.send_start(
            call, send, self.response_start(call, response, call.status), body, False
        )
        call.ttft_s = now() - call.received_at

    async def relay_passthrough(
        self,
        call: Call,
        attempt: Attempt,
        response: Reply,
        send: Send,
        watchdog: Watchdog,
    ) -> None:
        """A pass-through response (embeddings, audio, tokenize...): unchanged, as it comes.

        The start goes out as soon as the replica's status line and headers have arrived (a
        retried status never gets here), then each raw chunk as it is read: a streamed
        transcription reaches the client event by event. Nothing is parsed or held.

        The raw bytes are the body the replica framed, so its Content-Length stays true and is
        kept: the client can tell a cut body from a whole one, and uvicorn writes the bytes
        without re-framing them. An SSE answer is a stream like a chat stream: re-framed
        chunked, and a failure ends it with an in-band error event (``end_stream_with_error``),
        which a fixed length would not allow."""
        watchdog.reschedule(None)  # from here on the client has bytes: no retry
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            call.stream = True
        call.status = response.status_code
        if call.status >= 400:
            call.error_origin = "replica"  # the replica's own answer, relayed
        call.started = True
        attempt.phase = Phase.CONTENT
        attempt.last_progress = time.monotonic()
        await send(self.response_start(call, response, call.status))
        async for chunk in response.chunks():
            attempt.last_progress = time.monotonic()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if call.ttft_s is None:
                call.ttft_s = now() - call.received_at
            call.content_chunks += 1
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if call.ttft_s is None:
            call.ttft_s = now() - call.received_at

    async def relay_stream(
        self,
        call: Call,
        attempt: Attempt,
        response: Reply,
        send: Send,
        watchdog: Watchdog,
    ) -> None:
        chunks = response.chunks()
        held: list[bytes] = []
        events = sse.EventBuffer()
        found = False
        ended = False
        learn = call.kind == "responses"  # its response.created names the stored response
        # Hold everything until the first chunk with content (or the end of the stream), under
        # the attempt's first-token watchdog.
        async for chunk in chunks:
            attempt.last_progress = time.monotonic()
            held.append(chunk)
            # Parse events only up to the first with content: after it nothing is inspected
            # (a burst of a whole stream in one read costs one parse).
            events.push(chunk)
            while (event := events.next_event()) is not None:
                obj = sse.parse_event(event)
                if obj is sse.DONE:
                    ended = True
                    break
                if sse.is_error(obj):
                    raise AttemptFault(
                        Fault.ERROR_EVENT,
                        f"{attempt.replica.name} failed before the first token: "
                        f"{sse.error_message(obj)}",
                    )
                if sse.carries_content(obj):
                    found = True
                    break
                if learn and self._remember(obj, attempt.replica):
                    learn = False
            if found or ended:
                break
        watchdog.reschedule(None)  # from here on the client has bytes: no retry
        call.status = 200
        call.started = True
        attempt.phase = Phase.CONTENT if found else Phase.STARTED
        body = held[0] if len(held) == 1 else b"".join(held)
        # A stream that ended within the held chunks (one burst) goes out whole, its end in
        # the same write.
        cut_short = False
        if not ended:
            ended = response.at_eof()
            # The whole stream in the held reads, without its end: the replica closed early.
            cut_short = ended and not sse.stream_complete(call.kind, body)
        relayed = _Relayed(call, attempt, self.metrics, found, body)
        await self.send_start(
            call, send, self.response_start(call, response, 200), body, not ended or cut_short
        )
        relayed.started()
        # The stream's last bytes, for its usage (when the client asked for it) and, while
        # tracing, its finish reasons; nothing is kept otherwise.
        keep_tail = call.wants_usage or self.tracer is not None
        tail = body[-2048:] if keep_tail else b""
        # A Responses stream's usage is in its last event, which repeats the whole answer:
        # only the whole stream is sure to hold that event's start (kept as parts, joined once).
        whole: list[bytes] | None = [body] if call.kind == "responses" else None
        if not ended:
            if keep_tail:
                relayed.keep(tail, whole)
            try:
                async for chunk in relayed.handed_back(response):  # no direct writer: ASGI
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finally:
                relayed.finish()
            tail = relayed.tail
            cut_short = not sse.stream_complete(call.kind, relayed.before[-256:] + relayed.last)
            if not cut_short:
                writer = relayed.writer  # the end written by the server's writer where it can
                if writer is None or not writer.end(b""):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        if cut_short:
            # vLLM always ends a stream with its end event: one that stops without it was cut
            # (the replica closed early), and the client is told so, never left with a stream
            # that looks whole.
            await self.end_stream_with_error(
                call, send, f"replica {attempt.replica.name} ended the stream early"
            )
        if whole is not None:
            tail = b"".join(whole)
        if tail:
            if call.wants_usage:
                call.usage = sse.last_usage(tail)
            if self.tracer is not None:
                call.finish_reasons = sse.last_finish_reasons(tail)

    def _remember(self, answer: Any, replica: Replica) -> bool:
        """Learn where a created response lives, from its object or a stream's
        ``response.created`` event; True when it named one."""
        rid = sse.response_id(answer)
        if rid is None:
            return False
        self.homes.remember(rid, replica.url)
        return True

    @staticmethod
    async def send_start(
        call: Call, send: Send, start: dict[str, Any], body: bytes | list[bytes], more_body: bool
    ) -> None:
        """The response start and its first body: one message (one socket write) where the
        server takes ``START_WITH_BODY``, else the usual two. A body given as parts goes to
        the server's writer as they are (``asgi_ext.START_BODY``), joined for a ``send``."""
        if call.start_with_body:
            start[START_BODY] = body
            start[START_MORE_BODY] = more_body
            writer = call.body_writer
            # Written by the server's writer itself where it can (no interpreted ``send``).
            if writer is None or not writer.start(send, start):
                if isinstance(body, list):
                    start[START_BODY] = b"".join(body)  # a middleware's send sees bytes
                await send(start)
        else:
            whole = b"".join(body) if isinstance(body, list) else body
            await send(start)
            await send({"type": "http.response.body", "body": whole, "more_body": more_body})

    async def end_stream_with_error(self, call: Call, send: Send, message: str) -> None:
        call.error = message
        call.error_origin = "replica"  # a replica's fault, told in-band by the gateway
        if call.kind == "other" and not call.stream:
            # A pass-through body that is not a stream cannot carry an error: it is left
            # incomplete, so the ASGI server closes the connection (without the final chunk,
            # or short of its Content-Length) and the client sees it cut, not whole.
            return
        if not call.started:
            # Nothing sent yet: an SSE stream is still what the client asked for.
            call.started = True
            call.status = 200
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"x-request-id", call.request_id.encode()),
                        *call.extra_headers,
                    ],
                }
            )
        await send(
            {
                "type": "http.response.body",
                "body": sse_error_event(StreamCut(message), call.dialect),
                "more_body": False,
            }
        )


class StreamFlow:
    """A started stream's pace and its client writer, shared by the relay's loop and the
    handler the upstream connection calls with each chunk (``Reply.pump``): whether content
    was sent and when the last was, and the server's ``DIRECT_BODY`` writer once the response
    has started (None: the handler hands every chunk back, to go out as an ASGI message).
    Subclasses are the handlers (``__call__``)."""

    __slots__ = ("attempt", "call", "found", "itl", "t", "writer")

    def __init__(self, call: Call, attempt: Attempt, metrics: Metrics, found: bool) -> None:
        self.call = call
        self.attempt = attempt
        self.t = now()
        series = metrics.series(metrics.inter_token, call.lane.name, attempt.replica.pool)
        self.itl = Gaps(series, self.t)  # added in batches: ``finish`` adds the last
        self.found = found
        self.writer: BodyWriter | None = None

    def __call__(self, chunk: bytes) -> bytes | None:
        raise NotImplementedError

    def started(self) -> None:
        """The response started, its first body sent: from now on chunks may go direct."""
        self.t = now()
        call = self.call
        if self.found:
            call.ttft_s = self.t - call.received_at
            call.content_chunks = 1
        writer = call.body_writer
        self.writer = writer if writer is not None and writer.direct() else None

    def content(self, t2: float) -> None:
        """A chunk with content went to the client at ``t2`` (``now()``): TTFT or an
        inter-token time."""
        if self.found:
            self.itl.observe(t2 - self.t, t2)
        else:
            self.found = True
            self.attempt.phase = Phase.CONTENT
            self.call.ttft_s = t2 - self.call.received_at
        self.t = t2
        self.call.content_chunks += 1

    def finish(self) -> None:
        """The stream is over here (ended, failed or continued elsewhere): its last
        inter-token times go into the histogram."""
        self.itl.flush(now())

    def handed_back(self, response: Reply) -> AsyncIterator[bytes]:
        """The rest of ``response``'s body pumped through this handler: the chunks it hands
        back, in order; a full client socket is drained here. An empty read comes before the
        next whenever ``ready`` says so."""
        return _HandedBack(self, response)

    def ready(self) -> bool:
        """Whether the relay's loop left complete events pending (it stopped at its first
        content), to be taken before more is read: an empty read is handed back for them.
        None are here; a handler with an event buffer says (checked here rather than by a
        wrapper around ``handed_back``: one layer fewer for every wake-up of the relay)."""
        return False


class _HandedBack:
    """``StreamFlow.handed_back``; a class, not an async generator, so that a relay leaving
    at ``[DONE]`` leaves nothing for the event loop to close (``proxy/relay/upstream.py``'s
    ``_Reads``)."""

    __slots__ = ("_flow", "_response")

    def __init__(self, flow: StreamFlow, response: Reply) -> None:
        self._flow = flow
        self._response: Reply | None = response

    def __aiter__(self) -> _HandedBack:
        return self

    async def __anext__(self) -> bytes:
        # Over for good once it ended or raised, as a generator is: the response's connection
        # may serve another request by then.
        response = self._response
        if response is None:
            raise StopAsyncIteration
        flow = self._flow
        if flow.ready():
            return b""
        try:
            while (back := await response.pump(flow)) is not None:
                if back:
                    return back
                if flow.writer is not None:
                    await flow.writer.drain()
        except BaseException:
            self._response = None
            raise
        self._response = None
        raise StopAsyncIteration


class _Relayed(StreamFlow):
    """A plain stream's further chunks: each written to the client at once and noted
    (progress, pace, the tail for usage)."""

    __slots__ = ("before", "keep_tail", "last", "tail", "whole")

    def __init__(
        self, call: Call, attempt: Attempt, metrics: Metrics, found: bool, body: bytes
    ) -> None:
        super().__init__(call, attempt, metrics, found)
        self.before = self.last = body  # the last two reads: the end may straddle them
        self.keep_tail = False
        self.tail = b""
        self.whole: list[bytes] | None = None

    def keep(self, tail: bytes, whole: list[bytes] | None) -> None:
        """Keep the stream's last 2 KiB after ``tail``, or every chunk in ``whole``."""
        self.keep_tail = True
        self.tail = tail
        self.whole = whole

    def __call__(self, chunk: bytes) -> bytes | None:
        self.attempt.last_progress = t = now()
        writer = self.writer
        room = writer.write_body(chunk) if writer is not None else True
        self.before, self.last = self.last, chunk
        self.content(t)
        if self.keep_tail:
            if self.whole is None:
                self.tail = (self.tail + chunk)[-2048:]
            else:
                self.whole.append(chunk)
        if writer is None:
            return chunk
        return None if room else PAUSE


__all__ = ["HOP_BY_HOP", "Responder", "StreamFlow"]
