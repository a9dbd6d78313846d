"""The upstream side of a request: attempts, retries, and the stream relay.

One upstream client (``proxy.relay.upstream``, the only module that knows what is under it)
carries every request. Each client request
is relayed by its own task (the ASGI handler's), chunk by chunk: one upstream read, one
downstream write, so a slow client slows only its own stream and pushes back to its replica.

For streams the status line, headers and the role-only first chunk are held until the first
chunk that carries content: until then nothing has reached the client, so a replica that fails,
errors or stays silent can be abandoned and the request retried elsewhere. After that, an
attempt is never retried; a failure ends the stream with an SSE error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from proxy.edge.asgi_ext import START_BODY, START_MORE_BODY
from proxy.errors import (
    AttemptFault,
    FailureKind,
    Fault,
    Rejected,
    RetryableFailure,
    ShuttingDown,
    StreamCut,
    UpstreamBusy,
    UpstreamClosed,
    UpstreamError,
    UpstreamFailed,
    UpstreamReadTimeout,
    sse_error_event,
)
from proxy.fleet import detect
from proxy.fleet.fleet import Fleet, Pool, Replica
from proxy.observe.metrics import Metrics
from proxy.observe.tracing import Tracer
from proxy.relay import sse
from proxy.relay.call import Attempt, Call
from proxy.relay.homes import ResponseHomes
from proxy.relay.resume import Resumer
from proxy.relay.retry import (
    Action,
    Phase,
    RetryDecision,
    Verdict,
    budget_left,
    decide_retry,
    judge,
)
from proxy.relay.upstream import (
    UpstreamClient,
    at_eof,
    make_client,
    raw_chunks,
    timeout_extension,
)
from proxy.routing import balance, cache_aware
from proxy.routing.admission import Admission
from proxy.routing.profile import affinity_key

if TYPE_CHECKING:
    from starlette.types import Send

    from proxy.config import LaneConfig, Policy

now = time.perf_counter

# Hop-by-hop headers (RFC 9110 7.6.1): about one connection, never relayed either way.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te",
     b"trailer", b"upgrade"}
)  # fmt: skip
# Not forwarded upstream: hop-by-hop, what the upstream client sets itself, and the client's
# own credentials (a replica has its own key; a client's key must never reach it).
DROP_UPSTREAM = HOP_BY_HOP | {
    b"host", b"content-length", b"expect", b"x-request-id",
    b"authorization", b"proxy-authorization", b"api-key", b"x-api-key", b"cookie",
}  # fmt: skip
# Not relayed back: hop-by-hop, and what the ASGI server or the gateway sets itself.
_DROP_DOWNSTREAM = HOP_BY_HOP | {b"date", b"server", b"x-request-id"}
_DROP_DOWNSTREAM_STREAM = _DROP_DOWNSTREAM | {b"content-length"}

# Statuses the retry rules look at before anything is relayed.
_STATUS_FAULTS = {
    429: Fault.BUSY_429,
    503: Fault.BUSY_503,
    500: Fault.STATUS_5XX,
    502: Fault.STATUS_5XX,
    504: Fault.STATUS_5XX,
}


# Why retrying stopped, when a policy bound stopped it: the client and the access line say so.
_STOPPED_BECAUSE: dict[RetryDecision, str] = {
    RetryDecision.ATTEMPTS_SPENT: " (retry.max_attempts reached)",
    RetryDecision.DEADLINE_PASSED: " (the request's retry.deadline_s passed)",
    RetryDecision.BUDGET_SPENT: " (the retry budget, retry.budget_ratio, is spent)",
}


class Relay:
    def __init__(
        self,
        client: UpstreamClient,
        *,
        admission: Admission,
        fleet: Fleet,
        metrics: Metrics,
        policy: Callable[[], Policy],
        tracer: Tracer | None = None,
        homes: ResponseHomes | None = None,
    ) -> None:
        """``policy`` is a getter: a reload swaps the policy, and each request reads the one
        current when it starts. ``homes`` learns where each stored response lives."""
        self.homes = homes if homes is not None else ResponseHomes()
        self.admission = admission
        self.fleet = fleet
        self.metrics = metrics
        self.policy = policy
        self.tracer = tracer  # None: tracing off
        # Requests go to the client's transport directly: AsyncClient.send() adds redirects,
        # auth, cookie extraction and event hooks, none of which a proxy uses, at ~15 % of the
        # gateway's CPU per request.
        self.transport = client.transport
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self.rng = random.Random()
        self.requests_in_flight = 0
        # Requests on a retried attempt. Only those whose retry is still pending (nothing sent
        # to the client yet) count against the retry budget: a retry that got its answer
        # started is a request like any other, and holding the budget for its whole stream
        # refused retries while healthy capacity sat free.
        self.retrying: set[Call] = set()
        # A request's 5xx replayed elsewhere (retry.on_5xx_after_send): the replica's verdict
        # waits for the replay's (a 5xx there too makes the request the common factor).
        self._deferred_5xx: dict[Call, Replica] = {}
        self._timeouts: dict[tuple[str, bool], dict[str, float | None]] = {}
        self.live: set[Call] = set()  # requests being relayed or queued (``cut_all``)
        # Finishing a stream on another replica when its own fails mid-answer.
        self.resumer = Resumer(
            admission=admission,
            fleet=fleet,
            metrics=metrics,
            policy=policy,
            transport=self.transport,
            pick=self.try_pick,
            timeout=self._timeout,
            response_start=self._response_start,
            send_start=self._send_start,
            end_with_error=self._end_stream_with_error,
            tracer=tracer,
        )

    def cut_all(self, message: str) -> int:
        """End every request still running (shutdown past its grace): each is cancelled with
        ``message`` as its ``cut``, so a stream ends with the error event and ``[DONE]``, a
        request that has nothing yet gets a 503, and its upstream is closed. Returns how many."""
        cut = 0
        for call in list(self.live):
            task = call.task
            if task is None or task.done() or call.cut is not None:
                continue
            call.cut = message
            task.cancel(message)
            cut += 1
        return cut

    @staticmethod
    def _was_cut(call: Call) -> bool:
        """A cancellation that is only the gateway's own cut (``cut_all``): swallowed and
        answered; one from anything else (the client left, the task is cancelled) goes on."""
        task = call.task
        return call.cut is not None and task is not None and task.uncancel() == 0

    @staticmethod
    def _shutting_down(call: Call) -> ShuttingDown:
        return ShuttingDown(call.cut or "the gateway is shutting down")

    # -- picking ---------------------------------------------------------------------------

    def try_pick(self, call: Call) -> Replica | None:
        """A replica of the lane's pool, else of its ``spill_to`` pool, that can take the
        request now: healthy, serving the model, below its limit, not tried yet. A pinned
        request (``Call.pinned``) has one replica or none."""
        lane = call.lane
        fleet = self.fleet
        has_room = self.admission.has_room  # counts slots handed to queued requests
        if call.pinned is not None:
            home = self._pinned_candidate(call)
            if home is None or not has_room(home) or home in call.tried:
                return None
            return home if self.admission.claim(home) else None
        for pool_name in (lane.pool, lane.spill_to):
            # A request keeps the lane it started with; a reload may have removed its pool.
            if pool_name is None:
                continue
            pool = fleet.pools.get(pool_name)
            if pool is None:
                continue
            cands = [r for r in pool.candidates(call.model) if has_room(r) and r not in call.tried]
            choice = None
            while cands:
                choice = self._choose(pool, pool_name, cands, call)
                # With workers, another worker may have taken the slot since has_room.
                if choice is None or self.admission.claim(choice):
                    break
                cands.remove(choice)
                choice = None
            if not cands:
                continue
            if not call.tried:  # round robin advances once per request, not per retry
                pool.rr_counter += 1
            if choice is not None:
                if pool_name != lane.pool:
                    self.metrics.spills.labels(lane.name, lane.pool, pool_name).inc()
                return choice
        return None

    def _choose(
        self, pool: Pool, pool_name: str, cands: list[Replica], call: Call
    ) -> Replica | None:
        cfg = pool.config
        if cfg.balance == "cache_aware":
            chars = self.policy().estimate.chars_per_token
            return cache_aware.pick(
                self.fleet, self.metrics, chars, pool_name, cands, call, self.rng
            )
        key = None
        if cfg.balance == "prefix_affinity" and call.profile is not None:
            key = affinity_key(call.profile, cfg.prefix_chars)
        return balance.pick(
            cfg.balance,
            cands,
            key=key,
            rng=self.rng,
            rr_index=pool.rr_counter,
            bounded_load=cfg.bounded_load,
        )

    def any_serving(self, call: Call) -> bool:
        fleet = self.fleet
        if call.pinned is not None:
            return self._pinned_candidate(call) is not None
        lane = call.lane
        pools = fleet.pools
        return any(
            pools[p].candidates(call.model) for p in (lane.pool, lane.spill_to) if p in pools
        )

    def _pinned_candidate(self, call: Call) -> Replica | None:
        """The replica ``call`` is pinned to, while it is one its pool would pick from."""
        for pool in self.fleet.pools.values():
            for replica in pool.candidates(call.model):
                if replica.url == call.pinned:
                    return replica
        return None

    # -- the request -----------------------------------------------------------------------

    async def run(self, call: Call, send: Send) -> None:
        """Relay ``call`` to a replica, retrying before the first byte; raises ``Rejected`` or
        ``UpstreamFailed`` when nothing could be sent."""
        policy = self.policy()
        if call.stream and call.kind != "other":
            self.resumer.mark(call, policy)
        queued_at = now()
        self.live.add(call)
        try:
            replica = await self.admission.admit(
                call.lane, lambda: self.try_pick(call), lambda: self.any_serving(call)
            )
        except asyncio.CancelledError:
            self.live.discard(call)
            if self._was_cut(call):
                raise self._shutting_down(call) from None
            raise
        except BaseException:
            self.live.discard(call)
            raise
        # No await between here and ``fleet.attempt_started`` in ``_attempt``: admission's
        # reservation of this slot turns into the replica's in-flight count in one step.
        call.queue_wait_s = now() - queued_at
        self.requests_in_flight += 1
        # One deadline for all attempts, from the first one's start: the queue wait has its
        # own bound (queue_timeout_s).
        loop_time = asyncio.get_running_loop().time
        deadline = loop_time() + policy.retry.deadline_s
        if call.continuation is not None:
            call.continuation.deadline = deadline
        try:
            all_overloaded = True
            attempts = 0
            while True:
                attempts += 1
                is_retry = attempts > 1
                if is_retry:
                    self.retrying.add(call)
                try:
                    await self._attempt(call, replica, send, deadline)
                    return
                except RetryableFailure as failure:
                    last = failure
                    all_overloaded = all_overloaded and failure.overloaded
                    call.tried.add(replica)
                finally:
                    if is_retry:
                        self.retrying.discard(call)
                decision = decide_retry(
                    last.retry,
                    last.reason,
                    attempts=attempts,
                    max_attempts=policy.retry.max_attempts,
                    deadline_left_s=deadline - loop_time(),
                    budget_left=budget_left(
                        self.retries_pending,
                        self.requests_in_flight,
                        self.policy().retry.budget_ratio,
                    ),
                )
                if decision is not RetryDecision.RETRY:
                    break
                nxt = self.try_pick(call)
                if nxt is None:
                    break
                replica = nxt
                call.retries += 1
                self.metrics.retries.labels(call.lane.name, last.reason).inc()
            call.error = last.detail
            if all_overloaded:
                # Every replica tried said it was busy: that is a 503 to come back later, not
                # a broken gateway.
                raise UpstreamBusy(
                    f"every replica tried is overloaded ({attempts} attempt(s)): {last.detail}",
                    headers={"retry-after": "1"},
                )
            raise UpstreamFailed(
                f"no replica could serve the request after {attempts} attempt(s)"
                f"{_STOPPED_BECAUSE.get(decision, '')}: {last.detail}"
            )
        finally:
            self.live.discard(call)
            self.requests_in_flight -= 1
            self.admission.finished(call.lane)
            deferred = self._deferred_5xx.pop(call, None)
            if deferred is not None:  # its replay never ran: the 5xx was that replica's
                self.fleet.note_5xx(deferred)

    @property
    def retries_pending(self) -> int:
        """Retried attempts that have not started the client's response yet (the budget's
        count; rare enough that counting them when asked is cheaper than tracking)."""
        return sum(1 for c in self.retrying if not c.started)

    def _timeout(self, lane: LaneConfig, stream: bool) -> dict[str, float | None]:
        """The request's timeout extension. A stream's idle watchdog is the socket read
        timeout; a plain response arrives whole at the end of generation, so it has none (a
        stalled replica is ended by its ejection)."""
        read = lane.stream_idle_timeout_s if stream else None
        key = (lane.name, stream)
        t = self._timeouts.get(key)
        if t is None or t["read"] != read:
            t = self._timeouts[key] = timeout_extension(read)
        return t

    def _upstream_headers(self, call: Call, replica: Replica) -> list[tuple[bytes, bytes]]:
        headers = list(call.headers)
        headers.append((b"x-request-id", call.request_id.encode()))
        if replica.api_key:
            headers.append((b"authorization", b"Bearer " + replica.api_key.encode()))
        return headers

    def _request(self, call: Call, replica: Replica) -> httpx.Request:
        if call.query:
            url = httpx.URL(replica.url + call.path + "?" + query_text(call.query))
        else:
            cached = self._urls.get((replica.url, call.path))
            if cached is None:
                cached = httpx.URL(replica.url + call.path)
                if call.pinned is None:  # not a path with an id in it: one of a few
                    self._urls[(replica.url, call.path)] = cached
            url = cached
        # Built directly, with the body as a ready stream: a fifth of the cost of
        # ``content=`` (which copies headers twice to add Host and Content-Length; the
        # transport adds both from the URL and the bytes) and of client.build_request().
        return httpx.Request(
            call.method,
            url,
            stream=httpx.ByteStream(call.body),
            headers=self._upstream_headers(call, replica),
            extensions={"timeout": self._timeout(call.lane, call.stream)},
        )

    async def _attempt(self, call: Call, replica: Replica, send: Send, deadline: float) -> None:
        """One attempt on ``replica``. ``deadline`` (event loop time) is the request's: a
        stream's first-token watchdog fires at it at the latest.

        Whatever goes wrong becomes a ``Fault`` (with the words for it), judged in one place
        (``_settle``): raised as ``RetryableFailure`` while the client has nothing, else the
        client's stream is ended with an error event."""
        attempt = Attempt(replica, call.task)
        self.fleet.attempt_started(replica)
        replica.streams.add(attempt)
        call.replica = replica
        call.pool = replica.pool
        failure: FailureKind | None = None
        counted = True  # whether the outcome is held for or against the replica
        # The replica whose 5xx this attempt replays, if any (see ``_deferred_5xx``).
        replayed_5xx_of = self._deferred_5xx.pop(call, None)
        response: httpx.Response | None = None
        tracer = self.tracer
        span = None
        try:
            try:
                request = self._request(call, replica)
                if tracer is not None:
                    span = tracer.attempt_started(call, replica, request)
                if call.overhead_s is None:  # arrival to the first send, retries apart
                    call.overhead_s = now() - call.received_at
                # The first-token watchdog (streams only) runs from the attempt's start: a
                # replica that withholds its status line is as silent as one withholding its
                # first token. It fires at the request's deadline at the latest, and is switched
                # off just before anything is sent to the client. A plain response arrives whole
                # at the end of generation: its attempt is not cut (the deadline only stops
                # further ones).
                fire_at = None
                if call.stream:
                    fire_at = asyncio.get_running_loop().time() + call.lane.first_token_timeout_s
                    if fire_at > deadline:
                        fire_at = deadline
                try:
                    async with asyncio.timeout_at(fire_at) as watchdog:
                        response = await self.transport.handle_async_request(request)
                        attempt.phase = Phase.HELD
                        await self._relay_response(call, attempt, response, send, watchdog)
                except TimeoutError:
                    raise self._watchdog_fault(call, replica, fire_at == deadline) from None
                if call.status >= 500:
                    failure = FailureKind.UPSTREAM_5XX
                elif call.continuation is not None:
                    failure = call.continuation.failure  # continued after this replica failed
                return
            except asyncio.CancelledError:
                if self._was_cut(call):
                    # Shutdown past its grace: the client is told, not left with a cut stream.
                    call.error = call.cut
                    call.error_origin = "gateway"
                    if not call.started:
                        raise self._shutting_down(call) from None
                    if call.stream:
                        event = sse_error_event(self._shutting_down(call), call.dialect)
                        await send(
                            {"type": "http.response.body", "body": event, "more_body": False}
                        )
                    return
                reason = attempt.interrupted
                task = call.task
                if reason is None or task is None or task.uncancel() > 0:
                    raise  # the client left (or the server stops): nothing more to do
                # Ended by a health verdict on its replica: a rescue while nothing was sent.
                fault, why = Fault.EJECTED, reason
            except AttemptFault as exc:
                fault, why = exc.fault, exc.detail
            except UpstreamError as exc:
                fault, why = _fault_of(exc), exc.why
            verdict = self._judge(call, attempt, fault)
            failure = verdict.failure
            if verdict.spends_after_send and fault is Fault.STATUS_5XX:
                counted = False  # judged once the replay's answer is in
                self._deferred_5xx[call] = replica
            await self._settle(call, attempt, send, verdict, _detail(fault, attempt, call, why))
        finally:
            if span is not None and tracer is not None:
                tracer.attempt_finished(span, call, attempt, sys.exc_info()[1])
            replica.streams.discard(attempt)
            status = response.status_code if response is not None else 0
            poison = detect.poisoned(replayed_5xx_of is not None, status)
            self.fleet.attempt_finished(replica, failure, counted=counted and not poison)
            if replayed_5xx_of is not None and not poison:
                # The replay got something other than a 5xx: the first one was its replica's.
                self.fleet.note_5xx(replayed_5xx_of)
            self.admission.released(replica)
            if response is not None:
                with contextlib.suppress(Exception):
                    await response.aclose()

    def _judge(self, call: Call, attempt: Attempt, fault: Fault) -> Verdict:
        return judge(
            fault,
            attempt.phase,
            on_5xx_after_send=self.policy().retry.on_5xx_after_send,
            after_send_used=call.retried_after_send,
        )

    async def _settle(
        self, call: Call, attempt: Attempt, send: Send, verdict: Verdict, detail: str
    ) -> None:
        """Act on a judged fault: end the client's stream, or raise ``RetryableFailure``."""
        if verdict.action is Action.END_STREAM:
            self.resumer.not_continued(call, self.policy())
            await self._end_stream_with_error(call, send, detail)
            return
        if verdict.spends_after_send:
            call.retried_after_send = True
        raise RetryableFailure(
            verdict.reason,
            verdict.failure,
            detail,
            overloaded=verdict.overloaded,
            retry=verdict.action is Action.RETRY,
        )

    def _watchdog_fault(self, call: Call, replica: Replica, at_deadline: bool) -> AttemptFault:
        if at_deadline:
            # Cut short by the request's deadline, not by its own timeout.
            return AttemptFault(
                Fault.DEADLINE,
                f"{replica.name} sent no token before the request's deadline "
                f"(retry.deadline_s={self.policy().retry.deadline_s:g})",
            )
        return AttemptFault(
            Fault.FIRST_TOKEN_TIMEOUT,
            f"{replica.name} sent no token within {call.lane.first_token_timeout_s:g}s",
        )

    async def _relay_response(
        self,
        call: Call,
        attempt: Attempt,
        response: httpx.Response,
        send: Send,
        watchdog: asyncio.Timeout,
    ) -> None:
        status = response.status_code
        fault = _STATUS_FAULTS.get(status)
        if fault is not None:
            # 429 / 503 are retried (busy); 500 / 502 / 504 only under the opt-in, once,
            # otherwise the replica's answer is relayed.
            if self._judge(call, attempt, fault).action is not Action.RELAY:
                await response.aread()
                busy = " (overloaded)" if fault in (Fault.BUSY_429, Fault.BUSY_503) else ""
                raise AttemptFault(fault, f"{attempt.replica.name} answered {status}{busy}")
            attempt.last_progress = time.monotonic()
        if call.stream and status == 200 and _is_event_stream(response):
            if call.continuation is not None:
                await self.resumer.relay(call, attempt, response, send, watchdog)
            else:
                await self._relay_stream(call, attempt, response, send, watchdog)
        elif call.kind == "other":
            await self._relay_passthrough(call, attempt, response, send, watchdog)
        else:
            await self._relay_whole(call, attempt, response, send, watchdog)

    def _response_start(self, call: Call, response: httpx.Response, status: int) -> dict[str, Any]:
        # A relayed stream is re-framed by the ASGI server (chunked): its length cannot stay.
        drop = _DROP_DOWNSTREAM_STREAM if call.stream else _DROP_DOWNSTREAM
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in drop]
        headers.append((b"x-request-id", call.request_id.encode()))
        if call.extra_headers:
            headers += call.extra_headers
        if self.policy().server.response_headers:
            headers.append((b"x-tokenlane-lane", call.lane.name.encode()))
            if call.replica is not None:
                headers.append((b"x-tokenlane-replica", call.replica.name.encode()))
        return {"type": "http.response.start", "status": status, "headers": headers}

    async def _relay_whole(
        self,
        call: Call,
        attempt: Attempt,
        response: httpx.Response,
        send: Send,
        watchdog: asyncio.Timeout,
    ) -> None:
        """A plain chat or completion response (or an error status): read it whole (its usage
        is parsed), then send it unchanged."""
        # Raw bytes, as the stream path relays them: ``aread()`` would undo a Content-Encoding
        # the headers still announce (with the compressed Content-Length).
        body = b"".join([part async for part in raw_chunks(response)])
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
        await self._send_start(
            call, send, self._response_start(call, response, call.status), body, False
        )
        call.ttft_s = now() - call.received_at

    async def _relay_passthrough(
        self,
        call: Call,
        attempt: Attempt,
        response: httpx.Response,
        send: Send,
        watchdog: asyncio.Timeout,
    ) -> None:
        """A pass-through response (embeddings, audio, tokenize...): unchanged, as it comes.

        The start goes out as soon as the replica's status line and headers have arrived (a
        retried status never gets here), then each raw chunk as it is read: a streamed
        transcription reaches the client event by event. Nothing is parsed or held.

        The raw bytes are the body the replica framed, so its Content-Length stays true and is
        kept: the client can tell a cut body from a whole one, and uvicorn writes the bytes
        without re-framing them. An SSE answer is a stream like a chat stream: re-framed
        chunked, and a failure ends it with an in-band error event (``_end_stream_with_error``),
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
        await send(self._response_start(call, response, call.status))
        async for chunk in raw_chunks(response):
            attempt.last_progress = time.monotonic()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if call.ttft_s is None:
                call.ttft_s = now() - call.received_at
            call.content_chunks += 1
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if call.ttft_s is None:
            call.ttft_s = now() - call.received_at

    async def _relay_stream(
        self,
        call: Call,
        attempt: Attempt,
        response: httpx.Response,
        send: Send,
        watchdog: asyncio.Timeout,
    ) -> None:
        lane = call.lane
        chunks = raw_chunks(response)
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
            for event in events.feed(chunk):
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
        metrics = self.metrics
        call.status = 200
        call.started = True
        attempt.phase = Phase.CONTENT if found else Phase.STARTED
        body = held[0] if len(held) == 1 else b"".join(held)
        # A stream that ended within the held chunks (one burst) goes out whole, its end in
        # the same write.
        cut_short = False
        if not ended:
            ended = at_eof(response)
            # The whole stream in the held reads, without its end: the replica closed early.
            cut_short = ended and not sse.stream_complete(call.kind, body)
        await self._send_start(
            call, send, self._response_start(call, response, 200), body, not ended or cut_short
        )
        t = now()
        if found:
            call.ttft_s = t - call.received_at
            call.content_chunks = 1
        # The stream's last bytes, for its usage (when the client asked for it) and, while
        # tracing, its finish reasons; nothing is kept otherwise.
        keep_tail = call.wants_usage or self.tracer is not None
        tail = body[-2048:] if keep_tail else b""
        # A Responses stream's usage is in its last event, which repeats the whole answer:
        # only the whole stream is sure to hold that event's start (kept as parts, joined once).
        whole: list[bytes] | None = [body] if call.kind == "responses" else None
        itl = metrics.series(metrics.inter_token, lane.name, attempt.replica.pool)
        before = last = body  # the last two reads: the stream's end may straddle them
        if not ended:
            async for chunk in chunks:
                attempt.last_progress = time.monotonic()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                before, last = last, chunk
                t2 = now()
                if not found:
                    found = True
                    attempt.phase = Phase.CONTENT
                    call.ttft_s = t2 - call.received_at
                else:
                    itl.observe(t2 - t)
                t = t2
                call.content_chunks += 1
                if keep_tail:
                    if whole is None:
                        tail = (tail + chunk)[-2048:]
                    else:
                        whole.append(chunk)
            cut_short = not sse.stream_complete(call.kind, before[-256:] + last)
            if not cut_short:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        if cut_short:
            # vLLM always ends a stream with its end event: one that stops without it was cut
            # (the replica closed early), and the client is told so, never left with a stream
            # that looks whole.
            await self._end_stream_with_error(
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
    async def _send_start(
        call: Call, send: Send, start: dict[str, Any], body: bytes, more_body: bool
    ) -> None:
        """The response start and its first body: one message (one socket write) where the
        server takes ``START_WITH_BODY``, else the usual two."""
        if call.start_with_body:
            start[START_BODY] = body
            start[START_MORE_BODY] = more_body
            await send(start)
        else:
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": more_body})

    async def _end_stream_with_error(self, call: Call, send: Send, message: str) -> None:
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


def query_text(raw: bytes) -> str:
    """A query string as it came, for a URL: bytes a client left unencoded (non-ASCII) are
    percent-encoded as themselves, never decoded and re-encoded as other characters."""
    if raw.isascii():
        return raw.decode("ascii")
    return "".join(chr(b) if b < 0x80 else f"%{b:02X}" for b in raw)


def _is_event_stream(response: httpx.Response) -> bool:
    # From the raw headers: ``headers.get`` decodes them all first, on every response.
    for key, value in response.headers.raw:
        if key.lower() == b"content-type":
            return value.startswith(b"text/event-stream")
    return False


def _fault_of(exc: UpstreamError) -> Fault:
    """How far an upstream exchange got, in the relay's words."""
    if isinstance(exc, UpstreamReadTimeout):
        return Fault.READ_TIMEOUT
    if isinstance(exc, UpstreamClosed):
        return Fault.CLOSED
    # Unreached, or not HTTP: the replica never took the request, nothing was generated.
    return Fault.UNREACHED


def _detail(fault: Fault, attempt: Attempt, call: Call, why: str) -> str:
    """The words for a fault: the request's error (retry apart) or the client's error event.
    Faults the relay found itself come with theirs (``why``)."""
    name = attempt.replica.name
    started = attempt.phase >= Phase.STARTED
    if fault is Fault.UNREACHED:
        return f"connect to {name}: {why}"
    if fault is Fault.CLOSED:
        if started:
            return f"replica {name} closed the connection mid-stream"
        return f"{name} closed the connection: {why}"
    if fault is Fault.READ_TIMEOUT:
        if started:
            return f"replica {name} sent nothing for {call.lane.stream_idle_timeout_s:g}s"
        return f"{name} went silent"
    if fault is Fault.EJECTED:
        if started:
            return f"replica {name} stopped generating and was ejected"
        return f"replica {name} was ejected ({why})"
    return why


__all__ = [
    "Attempt",
    "Call",
    "Rejected",
    "Relay",
    "RetryableFailure",
    "UpstreamClient",
    "make_client",
]
