"""The upstream side of a request: its attempts and the retry loop around them.

Length: one job, in about 500 lines: an attempt's life (pick, request, watchdog, the fault it meets,
judged in one place) and the loop that retries it. The answer's way to the client is
``proxy.relay.respond``; the choice of a replica is ``proxy.routing.pick``.

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
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import httpx

from proxy.errors import (
    AttemptFault,
    FailureKind,
    Fault,
    Rejected,
    RetryableFailure,
    ShuttingDown,
    UpstreamBusy,
    UpstreamClosed,
    UpstreamError,
    UpstreamFailed,
    UpstreamReadTimeout,
    sse_error_event,
)
from proxy.fleet import detect
from proxy.fleet.fleet import Fleet, Replica
from proxy.fleet.kv_events import PromptTokens
from proxy.headers import LOWER
from proxy.observe.metrics import Metrics
from proxy.observe.tracing import Tracer
from proxy.relay.call import Attempt, Call
from proxy.relay.h1 import Origin, without_framing
from proxy.relay.homes import ResponseHomes
from proxy.relay.reply import Reply
from proxy.relay.respond import HOP_BY_HOP, Responder
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
from proxy.relay.upstream import UpstreamClient, make_client
from proxy.relay.watchdog import Alarms, Watchdog
from proxy.routing.admission import Admission
from proxy.routing.cache_aware import PreciseFeeds
from proxy.routing.pick import CANARY_POLL_S, Picker

if TYPE_CHECKING:
    from starlette.types import Send

    from proxy.config import LaneConfig, Policy

now: Final = time.monotonic

# Not forwarded upstream: hop-by-hop, what the upstream client sets itself, and the client's
# own credentials (a replica has its own key; a client's key must never reach it).
DROP_UPSTREAM: Final = HOP_BY_HOP | {
    b"host", b"content-length", b"expect", b"x-request-id",
    b"authorization", b"proxy-authorization", b"api-key", b"x-api-key", b"cookie",
}  # fmt: skip

# Statuses the retry rules look at before anything is relayed.
_STATUS_FAULTS: Final = {
    429: Fault.BUSY_429,
    503: Fault.BUSY_503,
    500: Fault.STATUS_5XX,
    502: Fault.STATUS_5XX,
    504: Fault.STATUS_5XX,
}


# Why retrying stopped, when a policy bound stopped it: the client and the access line say so.
_STOPPED_BECAUSE: Final[dict[RetryDecision, str]] = {
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
        share_placement: Callable[[str, str, Sequence[int]], None] | None = None,
        feeds: PreciseFeeds | None = None,
        prompt_tokens: PromptTokens | None = None,
    ) -> None:
        """``policy`` is a getter: a reload swaps the policy, and each request reads the one
        current when it starts. ``homes`` learns where each stored response lives;
        ``share_placement`` tells the other workers and instances where a ``cache_aware`` pick
        sent a prompt; ``feeds`` are the replicas' KV events and ``prompt_tokens`` asks a
        replica for a prompt's token ids, for precise ``cache_aware`` routing."""
        self.homes = homes if homes is not None else ResponseHomes()
        self.admission = admission
        self.fleet = fleet
        self.metrics = metrics
        self.policy = policy
        self.tracer = tracer  # None: tracing off
        # Requests go to the client's transport directly: AsyncClient.send() adds redirects,
        # auth, cookie extraction and event hooks, none of which a proxy uses, at ~15 % of the
        # gateway's CPU per request.
        self.pool = client.transport.pool
        # Where each (replica, path) goes: its pool origin and request target, as httpx.URL
        # reads them, made once (paths with an id in them, and queries, each time).
        self._targets: dict[tuple[str, str], tuple[Origin, bytes]] = {}
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
        self.live: set[Call] = set()  # requests being relayed or queued (``cut_all``)
        self.alarms = Alarms()  # the first-token watchdogs' shared timers
        self.picker = Picker(fleet, admission, metrics, policy, self.rng, share_placement, feeds)
        self.prompt_tokens = prompt_tokens
        self.responder = Responder(metrics, policy, tracer, self.homes)
        # Finishing a stream on another replica when its own fails mid-answer.
        self.resumer = Resumer(
            admission=admission,
            fleet=fleet,
            metrics=metrics,
            policy=policy,
            pool=self.pool,
            pick=self.try_pick,
            canary_coming=self.picker.canary_coming,
            read_timeout=self._read_timeout,
            response_start=self.responder.response_start,
            send_start=self.responder.send_start,
            end_with_error=self.responder.end_stream_with_error,
            live=self.live,
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

    # -- picking (``proxy.routing.pick``) ------------------------------------------------------

    def try_pick(self, call: Call) -> Replica | None:
        return self.picker.try_pick(call)

    def any_serving(self, call: Call) -> bool:
        return self.picker.any_serving(call)

    # -- the request -----------------------------------------------------------------------

    async def run(self, call: Call, send: Send) -> None:
        """Relay ``call`` to a replica, retrying before the first byte; raises ``Rejected`` or
        ``UpstreamFailed`` when nothing could be sent."""
        policy = self.policy()
        if call.stream and call.kind != "other":
            self.resumer.mark(call, policy)
        tokens = self.prompt_tokens
        # Precise cache_aware: token ids. Its pools are read first: ``wanted`` is interpreted
        # (``proxy.fleet.kv_events``), a Python call on every request where no pool is precise.
        if tokens is not None and tokens.feeds.pools and tokens.wanted(call):
            await tokens.fill(call)
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
        loop_time = call.loop().time
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
                    nxt = await self._wait_for_canary(call, deadline)
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

    async def _wait_for_canary(self, call: Call, deadline: float) -> Replica | None:
        """A retry with no replica to go to: the ejected it could take that answer ``/health``
        again are probed at once (``Picker.canary_coming``), and the retry waits for one to pass
        its canary, for at most the lane's ``first_token_timeout_s`` and within the request's
        deadline. The client has nothing yet; a wait of a health round beats a failure."""
        loop = asyncio.get_running_loop()
        until = min(deadline, loop.time() + call.lane.first_token_timeout_s)
        while self.picker.canary_coming(call):
            left = until - loop.time()
            if left <= 0:
                return None
            await asyncio.sleep(min(left, CANARY_POLL_S))
            nxt = self.try_pick(call)
            if nxt is not None:
                return nxt
        return None

    @property
    def retries_pending(self) -> int:
        """Retried attempts that have not started the client's response yet (the budget's
        count; rare enough that counting them when asked is cheaper than tracking)."""
        return sum(1 for c in self.retrying if not c.started)

    def _upstream_headers(self, call: Call, replica: Replica) -> list[tuple[bytes, bytes]]:
        headers = list(call.headers)
        headers.append((b"x-request-id", call.request_id.encode()))
        if replica.api_key:
            headers.append((b"authorization", b"Bearer " + replica.api_key.encode()))
        return headers

    @staticmethod
    def _read_timeout(lane: LaneConfig, stream: bool) -> float | None:
        """The socket read timeout: a stream's idle watchdog. A plain response arrives whole
        at the end of generation, so it has none (a stalled replica is ended by its
        ejection)."""
        return lane.stream_idle_timeout_s if stream else None

    def _target(self, call: Call, replica: Replica) -> tuple[Origin, bytes]:
        """Where the attempt goes: the replica's pool origin and the request target."""
        key = (replica.url, call.path)
        if not call.query:
            found = self._targets.get(key)
            if found is not None:
                return found
            url = httpx.URL(replica.url + call.path)
        else:
            url = httpx.URL(replica.url + call.path + "?" + query_text(call.query))
        found = (self.pool.origin(url.scheme, url.raw_host, url.port), url.raw_path)
        if not call.query and call.pinned is None:  # not a path with an id in it: one of a few
            self._targets[key] = found
        return found

    def _traced_headers(
        self, call: Call, replica: Replica, origin: Origin
    ) -> tuple[Any, list[tuple[bytes, bytes]]]:
        """The attempt's span and its headers with the span's trace context (tracing on)."""
        assert self.tracer is not None
        scheme = "https" if origin.ssl is not None else "http"
        host = origin.host_header.decode()
        request = httpx.Request(
            call.method, f"{scheme}://{host}", headers=self._upstream_headers(call, replica)
        )
        span = self.tracer.attempt_started(call, replica, request)
        return span, without_framing(request.headers.raw)

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
        response: Reply | None = None
        tracer = self.tracer
        span = None
        raised: BaseException | None = None
        try:
            try:
                origin, target = self._target(call, replica)
                if tracer is not None:
                    span, headers = self._traced_headers(call, replica, origin)
                else:
                    headers = self._upstream_headers(call, replica)
                if call.overhead_s is None:  # arrival to the first send, retries apart
                    call.overhead_s = now() - call.received_at
                # The first-token watchdog (streams only) runs from the attempt's start: a
                # replica that withholds its status line is as silent as one withholding its
                # first token. It fires at the request's deadline at the latest, and is switched
                # off just before anything is sent to the client. A plain response arrives whole
                # at the end of generation: its attempt is not cut (the deadline only stops
                # further ones).
                loop = call.loop()
                fire_at = None
                if call.stream:
                    fire_at = loop.time() + call.lane.first_token_timeout_s
                    if fire_at > deadline:
                        fire_at = deadline
                # Named the task this runs in; on the shared timers (late by up to 10 ms).
                watchdog = Watchdog(loop, fire_at, call.task, self.alarms)
                try:
                    conn = await self.pool.send(
                        origin,
                        call.method,
                        target,
                        headers,
                        call.body,
                        self._read_timeout(call.lane, call.stream),
                        loop=loop,
                    )
                    response = Reply(self.pool, origin, conn)
                    attempt.phase = Phase.HELD
                    await self._relay_response(call, attempt, response, send, watchdog)
                except asyncio.CancelledError:
                    if watchdog.close(cancelled=True):
                        raise self._watchdog_fault(call, replica, fire_at == deadline) from None
                    raise
                finally:
                    watchdog.close(cancelled=False)
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
        except BaseException as exc:
            # Held for the span: in compiled code (``proxy/compiled.py``) ``sys.exc_info()``
            # in ``finally`` may still name an exception handled earlier in the coroutine.
            raised = exc
            raise
        finally:
            if span is not None and tracer is not None:
                tracer.attempt_finished(span, call, attempt, raised)
            raised = None  # no cycle through the frame
            replica.streams.discard(attempt)
            status = response.status_code if response is not None else 0
            poison = detect.poisoned(replayed_5xx_of is not None, status)
            self.fleet.attempt_finished(replica, failure, counted=counted and not poison)
            if replayed_5xx_of is not None and not poison:
                # The replay got something other than a 5xx: the first one was its replica's,
                # and a good answer here proves it (detect.suspect's rule).
                served = failure is None and 200 <= status < 300
                self.fleet.note_5xx(replayed_5xx_of, confirmed=served)
            self.admission.released(replica)
            if response is not None:
                try:  # not contextlib.suppress: an interpreted context manager per request
                    await response.aclose()
                except Exception:
                    pass

    def _judge(self, call: Call, attempt: Attempt, fault: Fault) -> Verdict:
        replica = attempt.replica
        policy = self.policy()
        return judge(
            fault,
            attempt.phase,
            on_5xx_after_send=policy.retry.on_5xx_after_send,
            after_send_used=call.retried_after_send,
            suspect=fault is Fault.STATUS_5XX
            and detect.suspect(replica.health_ok, replica.recent_5xx),
            resumable=call.continuation is not None and policy.continuation.max_attempts > 0,
        )

    async def _settle(
        self, call: Call, attempt: Attempt, send: Send, verdict: Verdict, detail: str
    ) -> None:
        """Act on a judged fault: end the client's stream, or raise ``RetryableFailure``."""
        if verdict.action is Action.END_STREAM:
            self.resumer.not_continued(call, self.policy())
            await self.responder.end_stream_with_error(call, send, detail)
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
        response: Reply,
        send: Send,
        watchdog: Watchdog,
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
            attempt.last_progress = now()
        if call.stream and status == 200 and _is_event_stream(response):
            if call.continuation is not None:
                await self.resumer.relay(call, attempt, response, send, watchdog)
            else:
                await self.responder.relay_stream(call, attempt, response, send, watchdog)
        elif call.kind == "other":
            await self.responder.relay_passthrough(call, attempt, response, send, watchdog)
        else:
            await self.responder.relay_whole(call, attempt, response, send, watchdog)


def query_text(raw: bytes) -> str:
    """A query string as it came, for a URL: bytes a client left unencoded (non-ASCII) are
    percent-encoded as themselves, never decoded and re-encoded as other characters."""
    if raw.isascii():
        return raw.decode("ascii")
    return "".join(chr(b) if b < 0x80 else f"%{b:02X}" for b in raw)


def _is_event_stream(response: Reply) -> bool:
    # From the raw headers: ``headers.get`` decodes them all first, on every response.
    for key, value in response.headers.raw:
        if key.translate(LOWER) == b"content-type":
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
