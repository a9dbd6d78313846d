"""Finishing a stream on another replica when its own fails mid-answer: the I/O around the
pure parts in ``proxy.relay.continuation``.

The relay hands an eligible stream here (``Resumer.relay``): every event is parsed, its token
ids kept (and hidden from a client that did not ask for them). When the replica fails after
content reached the client, the generation goes on elsewhere within the policy's bounds
(attempts, re-prefill slots, start timeout, the request's deadline) and is spliced into the
client's one stream; otherwise the stream ends with the error event.

Length: one job, a continuation's I/O from the failure to the splice; its steps share one stream's
state and must be read in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import TYPE_CHECKING, Any, Final

import httpx

from proxy.errors import (
    AttemptFault,
    FailureKind,
    Fault,
    UpstreamError,
    UpstreamReadTimeout,
)
from proxy.fleet.fleet import Fleet, Replica
from proxy.observe.metrics import Metrics
from proxy.observe.tracing import Tracer
from proxy.relay import continuation as cont
from proxy.relay import sse
from proxy.relay.call import Attempt, Call
from proxy.relay.h1 import PAUSE, H1Pool, without_framing
from proxy.relay.reply import Reply
from proxy.relay.reprefill import Reprefills, Slot
from proxy.relay.respond import StreamFlow
from proxy.relay.retry import Phase
from proxy.relay.watchdog import Watchdog
from proxy.routing.admission import Admission
from proxy.routing.pick import CANARY_POLL_S

if TYPE_CHECKING:
    from starlette.types import Send

    from proxy.config import LaneConfig, Policy

now: Final = time.monotonic


# With more requests than this in flight, a read's first content goes out with the rest of
# the read (see ``first_content_alone``).
FIRST_CONTENT_ALONE_UP_TO: Final = 2


def first_content_alone(live: int) -> bool:
    """Whether a read that holds a stream's first content and more events (a burst) sends
    that content to the client before taking the rest (two writes), or all of it at once.

    Alone, the first token does not wait for the rest of the read (0.7-1 µs an event, a
    64-token burst ~50 µs) but costs the request a second write and its send (~40 µs on the
    2-core machine, ``docs/benchmarks.md``). With ``live`` (this process's requests being
    relayed or queued) above a couple, the event loop has other work queued ahead of that
    second write anyway and the CPU is what is short: one write."""
    return live <= FIRST_CONTENT_ALONE_UP_TO


class Resumer:
    """Relays eligible streams and continues them; its dependencies are the relay's parts."""

    def __init__(
        self,
        *,
        admission: Admission,
        fleet: Fleet,
        metrics: Metrics,
        policy: Callable[[], Policy],
        pool: H1Pool,
        pick: Callable[[Call], Replica | None],
        canary_coming: Callable[[Call], bool],
        read_timeout: Callable[[LaneConfig, bool], float | None],
        response_start: Callable[[Call, Reply, int], dict[str, Any]],
        send_start: Callable[
            [Call, Send, dict[str, Any], bytes | list[bytes], bool], Awaitable[None]
        ],
        end_with_error: Callable[[Call, Send, str], Awaitable[None]],
        live: Collection[Call],
        tracer: Tracer | None = None,
    ) -> None:
        self.admission = admission
        self.fleet = fleet
        self.metrics = metrics
        self.policy = policy
        self.pool = pool
        self.pick = pick  # the relay's choice of a replica for a request (``Relay.try_pick``)
        # For a call with no target: probes the ejected it could take, then says whether one is
        # on its canary (``Picker.canary_coming``).
        self.canary_coming = canary_coming
        self.read_timeout = read_timeout
        self.response_start = response_start
        self.send_start = send_start
        self.end_with_error = end_with_error
        self.live = live  # this process's requests being relayed (``first_content_alone``)
        self.tracer = tracer  # None: tracing off; else each continuation is a CLIENT span
        # Continuations between their start and first token; with workers, counted serve-wide.
        self.reprefills = Reprefills(admission.ledger)
        self.shapes = cont.Shapes()  # token-chunk templates, from one stream to the next

    def mark(self, call: Call, policy: Policy) -> None:
        """Give an eligible stream its ``Splice`` and ask its replica for token ids. Reads the
        body the edge parsed: a request pays nothing here while continuation is off."""
        body = call.fields
        if body is None:
            return
        if cont.refusal_under(policy.continuation, call.lane.continuation, call.kind, body):
            return
        call.continuation = cont.Splice(call.kind, body, call.wants_usage, self.shapes)
        call.body = cont.forward_body(call.body, body)

    async def relay(
        self,
        call: Call,
        attempt: Attempt,
        response: Reply,
        send: Send,
        watchdog: Watchdog,
    ) -> None:
        """The stream relay for an eligible stream: every event is parsed (its ids kept, and
        hidden from a client that did not ask for them), and a failure after content reached
        the client is continued on another replica (``_continue``)."""
        sp: cont.Splice = call.continuation
        if sp.relayed and not call.started:  # a retry before anything was sent starts afresh
            fresh = cont.Splice(sp.kind, sp.body, sp.wants_usage, self.shapes)
            fresh.deadline = sp.deadline
            sp = call.continuation = fresh
        sp.relayed = True
        strip = not sp.client_wants_ids
        name = attempt.replica.name
        events = sse.EventBuffer()
        held: list[bytes] = []
        ended = False
        trigger: cont.Trigger | None = None
        why = ""
        # A message being sent: the response start (its dict and first body) or a body
        # message; kept until its send returned (not a ``functools.partial``: compiled, one is
        # built through its type's generic call).
        unsent_start: dict[str, Any] | None = None
        unsent_body: list[bytes] = []
        unsent_more = True
        unsent_message: dict[str, Any] | None = None
        # Ordinary token chunks after the start are relayed from the connection's callback;
        # this loop sees the rest (``_TokenRelay``). ``flow`` holds what both share.
        flow = _TokenRelay(call, attempt, self.metrics, sp, events, strip)
        alone = first_content_alone(len(self.live))
        try:
            async for chunk in flow.handed_back(response):
                attempt.last_progress = now()
                # An ordinary token chunk is relayed without parsing it: a read that is one
                # (vLLM sends one event per token) skips the event split too. With a direct
                # writer the handler tried that already, and this read is what it declined.
                out: list[bytes]
                if (
                    flow.writer is None
                    and events.empty
                    and (token := sp.take_chunk(chunk, strip)) is not None
                ):
                    out = [token[0]]
                    content = token[1]
                else:
                    out = []
                    content = False
                    events.push(chunk)
                    while (ev := events.next_event()) is not None:
                        if (token := sp.take_event(ev, strip)) is not None:  # several in a read
                            out.append(token[0])
                            content = content or token[1]
                            if not call.started and (alone or not content):
                                if content:
                                    break  # the first content goes out before the rest
                                continue
                            # The token chunks after it in this read, in one go (a burst).
                            buffered, at = events.pending()
                            if (run := sp.take_run(buffered, at, strip)) is not None:
                                out.append(run[0])
                                events.advance(run[1])
                                content = True
                            continue
                        if (known := sp.take_known(ev, strip)) is not None:
                            # The first chunk or a finish of bytes met before: noted unparsed.
                            out.append(known[0])
                            if known[1]:
                                content = True
                                if not call.started and alone:
                                    break
                            continue
                        obj, shown = sp.parse(ev)
                        if obj is sse.DONE:
                            ended = True
                            out.append(b"data: [DONE]\n\n")
                            break
                        if not isinstance(obj, dict):
                            if sse.event_data(ev) is not None:
                                # Not JSON: the ids can no longer be trusted.
                                if not call.started:
                                    raise AttemptFault(
                                        Fault.ERROR_EVENT, f"{name} sent a bad chunk"
                                    )
                                self._refused(call, cont.Refusal.MALFORMED)
                                await self.end_with_error(
                                    call, send, f"replica {name} sent a chunk that is not JSON"
                                )
                                return
                            out.append(ev + b"\n\n")
                            continue
                        if sse.is_error(obj):
                            if not call.started:
                                msg = sse.error_message(obj)
                                raise AttemptFault(
                                    Fault.ERROR_EVENT,
                                    f"{name} failed before the first token: {msg}",
                                )
                            if cont.error_code(obj) < 500:
                                out.append(ev + b"\n\n")  # the request's own fault: relayed
                                self._refused(call, cont.Refusal.CLIENT_ERROR)
                                continue
                            trigger, why = cont.Trigger.ERROR_EVENT, sse.error_message(obj)
                            break
                        if sp.observe(obj) is cont.Trigger.ABORT:
                            if not call.started:
                                raise AttemptFault(Fault.ERROR_EVENT, f"{name} aborted the request")
                            trigger, why = cont.Trigger.ABORT, "the engine aborted the request"
                            break
                        relayed, has_content = _noted(call, sp, ev, shown, obj, strip)
                        out.append(relayed)
                        content = content or has_content
                        if content and not call.started and alone:
                            # The first content goes out now, the rest of the read after it
                            # (the flow's ``ready``: an empty read), unless other requests
                            # are in flight (``first_content_alone``).
                            break
                if not call.started:
                    held += out
                    if content:
                        flow.found = True
                    if not (flow.found or ended or trigger):
                        continue
                    watchdog.reschedule(None)  # from here on the client has bytes: no retry
                    call.status = 200
                    call.started = True
                    attempt.phase = Phase.CONTENT if flow.found else Phase.STARTED
                    start = self.response_start(call, response, 200)
                    # A stream that ended in the held reads before any content ends in the
                    # same write; one with content sends its rest after (the loop's break).
                    # The held parts go to the server's writer unjoined (``send_start``).
                    unsent_start, unsent_body, unsent_more = start, held, not ended
                    await self._begin(call, send, start, unsent_body, unsent_more, flow)
                    unsent_start = None
                else:
                    writer = flow.writer
                    if writer is not None and not ended:
                        # The server's writer, without an interpreted ``send`` (as the handler
                        # writes a chunk); a full client socket is drained before the next.
                        if out and not writer.write_body(b"".join(out)):
                            await writer.drain()
                    elif out or ended:  # [DONE] and the body's end: one write
                        body = b"".join(out)
                        if writer is None or not writer.end(body):
                            unsent_message = {"type": "http.response.body", "body": body,
                                              "more_body": not ended}  # fmt: skip
                            await send(unsent_message)
                            unsent_message = None
                    if content:
                        flow.content(now())
                if ended or trigger:
                    break
        except UpstreamError as exc:
            if not call.started:
                raise
            if isinstance(exc, UpstreamReadTimeout):
                trigger = cont.Trigger.STALL
                why = f"replica {name} sent nothing for {call.lane.stream_idle_timeout_s:g}s"
            else:
                trigger, why = cont.Trigger.RESET, f"replica {name} closed the connection"
        except asyncio.CancelledError:
            task = call.task
            if not call.started or attempt.interrupted is None or task is None:
                raise
            if task.uncancel() > 0:
                raise
            trigger = cont.Trigger.STALL
            why = f"replica {name} stopped generating and was ejected"
        finally:
            flow.finish()
        # The replica was ejected while this message waited for the client to read: it was
        # not written, and what it holds is noted as sent. Sent now, before the end or the
        # continuation.
        if unsent_start is not None:
            await self._begin(call, send, unsent_start, unsent_body, unsent_more, flow)
        elif unsent_message is not None:
            await send(unsent_message)
        if ended:
            return  # its end went with [DONE]
        if trigger is None:
            if sp.finish_reason is not None:
                # Finished, then cut before the usage and [DONE]: nothing is missing.
                tail = b"".join(cont.event(c) for c in sp.length_ending()[1:])
                end = tail + b"data: [DONE]\n\n"
                await send({"type": "http.response.body", "body": end, "more_body": False})
                return
            trigger, why = cont.Trigger.EOF, f"replica {name} closed the stream early"
        if not call.started:
            # Ended before any content (only the role chunk, if that): as an ordinary fault.
            raise AttemptFault(Fault.CLOSED, why)
        await self._continue(call, attempt, response, send, trigger, why, flow.t)

    async def _begin(
        self,
        call: Call,
        send: Send,
        start: dict[str, Any],
        body: list[bytes],
        more_body: bool,
        flow: StreamFlow,
    ) -> None:
        await self.send_start(call, send, start, body, more_body)
        flow.started()

    def _refused(self, call: Call, reason: cont.Refusal) -> None:
        self.metrics.continuation_refusals.labels(call.lane.name, reason.value).inc()

    def not_continued(self, call: Call, policy: Policy) -> None:
        """Count why a stream that was never continuable (``mark`` left it to the plain
        relay: continuation off, or the request ineligible) is not continued now that its
        replica failed mid-answer. Only here, on the failure path, is the reason worked out."""
        body = call.fields
        if call.continuation is not None or not call.stream or call.kind == "other":
            return
        if body is None:
            return
        refusal = cont.refusal_under(policy.continuation, call.lane.continuation, call.kind, body)
        if refusal is not None:
            self._refused(call, refusal)

    async def _continue(
        self,
        call: Call,
        attempt: Attempt,
        response: Reply,
        send: Send,
        trigger: cont.Trigger,
        why: str,
        last_sent: float,
    ) -> None:
        """Go on with the failed stream on other replicas, within ``continuation.max_attempts``;
        else end it with the error event. The failed upstream is closed first: nothing it
        sends later can reach the client."""
        sp: cont.Splice = call.continuation
        cfg = self.policy().continuation
        lane = call.lane.name
        with contextlib.suppress(Exception):
            await response.aclose()
        old = attempt.replica
        # The attempt is over for the fleet's stream watch: a later verdict on its replica
        # must not cancel the continuation.
        if attempt.interrupted is None:
            attempt.interrupted = "continued"
        old.streams.discard(attempt)
        sp.failure = _TRIGGER_FAILURE[trigger]
        while True:
            call.tried.add(old)
            # From each failure, start_timeout_s to the continuation's first token, waiting
            # for a re-prefill slot included.
            until = asyncio.get_running_loop().time() + cfg.start_timeout_s
            if sp.deadline is not None:
                until = min(until, sp.deadline)
            if sp.exhausted():
                # Every allowed token was generated: the answer is complete.
                tail = b"".join(cont.event(c) for c in sp.length_ending())
                await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n",
                            "more_body": False})  # fmt: skip
                return
            refusal = sp.refusal(cfg.max_attempts, cfg.max_seq_len)
            target: Replica | None = None
            slot: Slot | None = None
            if refusal is None:
                target, slot, refusal = await self._continuation_target(call, send, until)
            if target is None or slot is None:
                assert refusal is not None
                self._refused(call, refusal)
                await self.end_with_error(call, send, f"{why}; not continued: {refusal.value}")
                return
            body = sp.continuation_body(call.model)
            sp.seams.append(
                {"from": old.name, "to": target.name, "at_token": sp.text_ids,
                 "trigger": trigger.value}
            )  # fmt: skip
            self.metrics.continuation_replayed.labels(lane).inc(len(body["prompt"]))
            failed = await self._run_continuation(call, target, body, send, last_sent, slot, until)
            if failed is None:
                self.metrics.continuations.labels(lane, trigger.value, "ok").inc()
                call.replica = target
                call.pool = target.pool
                call.usage = sp.usage()
                return
            self.metrics.continuations.labels(lane, trigger.value, "failed").inc()
            trigger, why, last_sent = failed
            old = target

    async def _continuation_target(
        self, call: Call, send: Send, until: float
    ) -> tuple[Replica | None, Slot | None, cont.Refusal | None]:
        """A replica to continue on and its re-prefill slot, or why not. While every slot the
        pick could use is held, waits for one to be given back (the client gets keep-alives)
        until ``until`` (event-loop time)."""
        cfg = self.policy().continuation
        loop = asyncio.get_running_loop()
        next_keepalive = loop.time() + cfg.keepalive_s
        while True:
            target = self.pick(call)
            left = until - loop.time()
            if target is None:
                # A replica on its canary may be back in a moment (one ejected for failures
                # but answering /health again is probed at once for it, as are the ejected
                # when the cap holds a failing replica back): wait for it, within the start
                # timeout, rather than give the stream up.
                if left <= 0 or not self.canary_coming(call):
                    return None, None, cont.Refusal.NO_TARGET
                await asyncio.sleep(min(left, CANARY_POLL_S, next_keepalive - loop.time()))
            else:
                slot = self.reprefills.try_take(
                    target.name,
                    cfg.max_in_flight,
                    cfg.max_in_flight_per_replica,
                    call.continuation.replay_tokens,
                    cfg.max_tokens_in_flight_per_replica,
                )
                if slot is not None:
                    return target, slot, None
                if left <= 0:
                    return None, None, cont.Refusal.BUSY
                await self.reprefills.freed(min(left, next_keepalive - loop.time()))
            if loop.time() >= next_keepalive:
                await send({"type": "http.response.body", "body": cont.KEEPALIVE,
                            "more_body": True})  # fmt: skip
                next_keepalive = loop.time() + cfg.keepalive_s

    async def _run_continuation(
        self,
        call: Call,
        target: Replica,
        body: dict[str, Any],
        send: Send,
        last_sent: float,
        slot: Slot,
        limit: float,
    ) -> tuple[cont.Trigger, str, float] | None:
        """One continuation on ``target``, spliced into the client's stream; None when it
        ended the answer, else what failed (trigger, words, when the client last got bytes).
        ``slot`` is given back at its first token; ``limit`` (event-loop time) bounds the wait
        for that token."""
        sp: cont.Splice = call.continuation
        cfg = self.policy().continuation
        attempt = Attempt(target, call.task)
        self.fleet.attempt_started(target)
        target.streams.add(attempt)
        failure: FailureKind | None = None
        holder: list[Reply] = []
        spans: list[Any] = []  # the continuation's CLIENT span, while tracing
        loop = asyncio.get_running_loop()
        name = target.name
        events = sse.EventBuffer()

        async def first() -> tuple[AsyncIterator[bytes], bytes, bool]:
            """Open the continuation and read it up to its first content (or its end)."""
            headers = [
                (b"content-type", b"application/json"),
                (b"x-request-id", f"{call.request_id}-c{len(sp.seams)}".encode()),
            ]
            if target.api_key:
                headers.append((b"authorization", b"Bearer " + target.api_key.encode()))
            url = httpx.URL(target.url + "/v1/completions")
            if self.tracer is not None:
                seam = len(sp.seams)
                request = httpx.Request("POST", url, headers=headers)
                spans.append(self.tracer.attempt_started(call, target, request, continuation=seam))
                headers = without_framing(request.headers.raw)
            origin = self.pool.origin(url.scheme, url.raw_host, url.port)
            conn = await self.pool.send(
                origin,
                "POST",
                url.raw_path,
                headers,
                json.dumps(body).encode(),
                self.read_timeout(call.lane, True),
            )
            resp = Reply(self.pool, origin, conn)
            holder.append(resp)
            if resp.status_code != 200:
                raise AttemptFault(Fault.STATUS_5XX, f"{name} answered {resp.status_code}")
            chunks = resp.chunks()
            out: list[bytes] = []
            async for chunk in chunks:
                attempt.last_progress = now()
                events.push(chunk)
                while (ev := events.next_event()) is not None:
                    data, trig, done, content, words = sp.take(ev)
                    if trig is not None:
                        raise AttemptFault(Fault.ERROR_EVENT, f"{name}: {words}")
                    out.append(data)
                    if done or content:
                        return chunks, b"".join(out), done
            raise AttemptFault(Fault.CLOSED, f"{name} closed the continuation before a token")

        opener = asyncio.ensure_future(first())
        result: tuple[cont.Trigger, str, float] | None = None
        raised: BaseException | None = None
        try:
            try:
                while True:
                    left = limit - loop.time()
                    if left <= 0:
                        raise AttemptFault(Fault.FIRST_TOKEN_TIMEOUT, f"{name} sent no token")
                    done_set, _ = await asyncio.wait({opener}, timeout=min(cfg.keepalive_s, left))
                    if done_set:
                        break
                    await send({"type": "http.response.body", "body": cont.KEEPALIVE,
                                "more_body": True})  # fmt: skip
                chunks, head, done = opener.result()
                slot.release()  # prefilled: from here one more stream on its replica
                attempt.phase = Phase.CONTENT
                self.metrics.continuation_gap.labels(call.lane.name).observe(now() - last_sent)
                await send({"type": "http.response.body", "body": head, "more_body": not done})
                last_sent = now()
                if done:
                    return None
                # What the first read held past the first content, then further reads.
                async for chunk in events.reads(chunks):
                    attempt.last_progress = now()
                    out: list[bytes] = []
                    events.push(chunk)
                    while (ev := events.next_event()) is not None:
                        data, trig, done, content, words = sp.take(ev)
                        if trig is not None:
                            raise AttemptFault(Fault.ERROR_EVENT, f"{name}: {words}")
                        out.append(data)
                        if content:
                            call.content_chunks += 1
                        if done:
                            break
                    if out:
                        await send({"type": "http.response.body", "body": b"".join(out),
                                    "more_body": not done})  # fmt: skip
                        last_sent = now()
                    if done:
                        return None
                if sp.finish_reason is not None:
                    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                                "more_body": False})  # fmt: skip
                    return None
                raise AttemptFault(Fault.CLOSED, f"replica {name} closed the stream early")
            except asyncio.CancelledError:
                task = call.task
                if attempt.interrupted is None or task is None or task.uncancel() > 0:
                    raise
                failure = FailureKind.STREAM_IDLE
                result = (cont.Trigger.STALL, f"replica {name} was ejected", last_sent)
            except AttemptFault as exc:
                failure = FailureKind.UPSTREAM_5XX
                result = (_FAULT_TRIGGER.get(exc.fault, cont.Trigger.ERROR_EVENT), exc.detail,
                          last_sent)  # fmt: skip
            except UpstreamError as exc:
                stall = isinstance(exc, UpstreamReadTimeout)
                failure = FailureKind.STREAM_IDLE if stall else FailureKind.RESET
                trig = cont.Trigger.STALL if stall else cont.Trigger.RESET
                result = (trig, f"replica {name}: {exc.why}", last_sent)
            return result
        except BaseException as exc:
            raised = exc  # for the span, as ``Relay._attempt`` holds it
            raise
        finally:
            if spans and self.tracer is not None:
                failed = f"continuation_{result[0].value}" if result is not None else None
                self.tracer.attempt_finished(spans[0], call, attempt, raised, failed)
            raised = None
            slot.release()
            if not opener.done():
                opener.cancel()
                with contextlib.suppress(BaseException):
                    await opener
            target.streams.discard(attempt)
            self.fleet.attempt_finished(target, failure)
            self.admission.released(target)
            for resp in holder:
                with contextlib.suppress(Exception):
                    await resp.aclose()


_TRIGGER_FAILURE: Final = {
    cont.Trigger.EOF: FailureKind.RESET,
    cont.Trigger.RESET: FailureKind.RESET,
    cont.Trigger.ERROR_EVENT: FailureKind.UPSTREAM_5XX,
    cont.Trigger.ABORT: FailureKind.UPSTREAM_5XX,
    cont.Trigger.STALL: FailureKind.STREAM_IDLE,
}
_FAULT_TRIGGER: Final = {
    Fault.CLOSED: cont.Trigger.EOF,
    Fault.FIRST_TOKEN_TIMEOUT: cont.Trigger.STALL,
}


class _TokenRelay(StreamFlow):
    """An eligible stream's reads after its start that decide nothing: one ordinary token
    chunk of the learned template (``Splice.take_token``, or ``take_chunk`` for one without
    text: unparsed), one other event the loop
    would only note and relay (parsed: a finish, usage, a text with a quote), or several token
    chunks that came in one read (``Splice.take_run``, as the loop takes a burst; the events
    after them are handed back). Noted, their ids hidden when the client did not ask, and
    written to the client at once, without waking the relay's task. Anything else
    (``[DONE]``, an error, an abort), and everything while the server offers no direct
    writer, is handed back to ``Resumer.relay``'s loop."""

    __slots__ = ("events", "sp", "strip")

    def __init__(
        self,
        call: Call,
        attempt: Attempt,
        metrics: Metrics,
        sp: cont.Splice,
        events: sse.EventBuffer,
        strip: bool,
    ) -> None:
        super().__init__(call, attempt, metrics, found=False)
        self.sp = sp
        self.events = events
        self.strip = strip

    def ready(self) -> bool:
        """A read left complete events pending (the relay sent its first content before
        taking them): ``handed_back`` hands an empty read back for them before pumping."""
        return self.events.ready

    def __call__(self, chunk: bytes) -> bytes | None:
        writer = self.writer
        if writer is None or not self.events.empty:
            return chunk
        out = self.sp.take_token(chunk, self.strip)
        if out is not None:  # vLLM's every token: one chunk with text, a read of its own
            self.attempt.last_progress = t = now()
            room = writer.write_body(out)
            self.content(t)
            return None if room else PAUSE
        rest = b""
        token = self.sp.take_chunk(chunk, self.strip)
        if token is None and (token := self._parsed(chunk)) is None:
            # Several events in a read (tokens that came at once): its token chunks from the
            # start in one write, as the loop takes a run; what follows them is handed back.
            run = self.sp.take_run(chunk, 0, self.strip)
            if run is None:
                return chunk
            token = (run[0], True)
            rest = chunk[run[1] :]
        self.attempt.last_progress = t = now()
        room = writer.write_body(token[0])
        if token[1]:
            self.content(t)
        if rest:
            # To the loop, which writes it and drains a full client socket before the handler
            # writes again (the socket's state goes with the next write, not this return).
            return rest
        return None if room else PAUSE

    def _parsed(self, chunk: bytes) -> tuple[bytes, bool] | None:
        """A read that is one event of another kind the relay's loop would only note and
        relay (a finish, usage, a text with a quote or ending in a backslash): parsed and
        noted here, as the loop notes it (``_noted``), without waking the loop's task. None
        for what the loop decides on (``[DONE]``, an error, an abort, what is not JSON) or a
        read of several events: it is handed back."""
        end = len(chunk) - 2
        if not chunk.endswith(b"\n\n") or sse.FIND(chunk, b"\n\n", 0, end) >= 0:
            return None
        known = self.sp.take_finish(chunk, self.strip)
        if known is not None:
            return known
        event = chunk[:end]
        obj, shown = self.sp.parse(event)
        if not isinstance(obj, dict) or sse.is_error(obj):
            return None
        if self.sp.observe(obj) is not None:
            return None  # the abort, of which nothing was noted: the loop observes it again
        return _noted(self.call, self.sp, event, shown, obj, self.strip)


def _noted(
    call: Call, sp: cont.Splice, event: bytes, shown: bytes, obj: dict[str, Any], strip: bool
) -> tuple[bytes, bool]:
    """An eligible stream's event that is relayed as it is, observed already: the template
    learned from it (``event``, as the replica sent it) while there is none, its usage kept;
    (the event as the client gets it: ``shown``, as ``Splice.parse`` gave it, ``\\n\\n``
    ended and its ids nulled when ``strip``; whether it carries content)."""
    if sp.head is None or sp.guessed:
        sp.learn_template(event, obj)  # a made template no chunk matched yet may be wrong
    elif sp.finish_reason is not None:
        sp.learn_finish(event, obj)  # the next stream's finish of these bytes: unparsed
    sp.learn_role(event, obj)  # the next stream's first chunk of these bytes: unparsed
    usage = obj.get("usage")
    if isinstance(usage, dict):
        call.usage = usage
    return (cont.strip_ids(shown) if strip else shown) + b"\n\n", sse.carries_content(obj)
