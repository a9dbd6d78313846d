"""The upstream side of a request: attempts, retries, and the stream relay.

One ``httpx.AsyncClient`` over the aiohttp transport carries every request. Each client request
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
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx

from proxy.edge.asgi_ext import START_BODY, START_MORE_BODY
from proxy.errors import Rejected, UpstreamBusy, UpstreamFailed
from proxy.fleet.fleet import Replica
from proxy.relay import sse
from proxy.relay.call import Attempt, Call
from proxy.relay.transport import RawResponseStream, RelayTransport
from proxy.routing import balance, cache_aware
from proxy.routing.classify import affinity_key

if TYPE_CHECKING:
    from starlette.types import Send

    from proxy.app import Gateway
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

CONNECT_TIMEOUT_S = 3.0
POOL_TIMEOUT_S = 5.0
# An idle pooled connection is dropped (on its next acquire) after this long. vLLM's uvicorn
# closes idle keep-alive connections after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a POST sent on
# one it is closing meets a reset after the request was sent, which is not retried by default
# (RELIABILITY 6). Staying below 5 s keeps that race off the common path.
KEEPALIVE_EXPIRY_S = 4.0


class RetryableFailure(Exception):
    """An attempt failed before anything reached the client; another replica may take it,
    unless ``retry`` is False (the request then fails with this failure)."""

    def __init__(
        self,
        reason: str,
        failure: str | None,
        detail: str,
        *,
        overloaded: bool = False,
        retry: bool = True,
    ) -> None:
        super().__init__(detail)
        self.reason = reason  # tokenlane_retries_total reason
        self.failure = failure  # what the fleet is told (None: not the replica's fault)
        self.detail = detail
        self.overloaded = overloaded  # the replica said 429 / 503: busy, not broken
        self.retry = retry


def make_client(policy: Policy) -> UpstreamClient:
    """The one upstream client. The aiohttp transport ignores ``AsyncClient(limits=...)`` and
    defaults to 100 connections, so it gets the limits itself, sized to what the policy can
    ever have in flight."""
    total = sum(r.max_in_flight for p in policy.pools.values() for r in p.replicas)
    limits = httpx.Limits(
        max_connections=max(256, total + 64),
        max_keepalive_connections=max(256, total + 64),
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )
    timeout = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=None, write=30.0, pool=POOL_TIMEOUT_S)
    return UpstreamClient(
        transport=RelayTransport(limits=limits, client=_session_factory(limits)),
        timeout=timeout,
        limits=limits,
        # A proxy forwards what it is given: no redirects followed, no headers of its own.
        follow_redirects=False,
        headers={},
    )


def _session_factory(limits: httpx.Limits) -> Callable[[], aiohttp.ClientSession]:
    """The aiohttp session under the transport, made on first use (inside the event loop).

    A proxy keeps no cookies: aiohttp's default jar would store a replica's ``Set-Cookie`` and
    replay it on other clients' requests (and costs a lookup per request), and adds no headers
    of its own. The connector gets the same explicit limits."""

    def make() -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=limits.max_connections or 0,
            keepalive_timeout=limits.keepalive_expiry,
        )
        return aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            # What the client sent goes upstream, nothing of aiohttp's own: its default
            # "Accept-Encoding: gzip, deflate" would invite a compressed answer that the relay
            # passes on, raw, to a client that never asked for one.
            # (and its "Content-Type: application/octet-stream" on a body sent without one,
            # which vLLM, reading such a body as JSON, would refuse).
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
        )

    return make


class UpstreamClient(httpx.AsyncClient):
    """An ``AsyncClient`` that also names its transport, for the relay's direct sends."""

    def __init__(self, *, transport: httpx.AsyncBaseTransport, **kw: Any) -> None:
        super().__init__(transport=transport, **kw)
        self.transport = transport


class Relay:
    def __init__(self, gateway: Gateway, client: UpstreamClient) -> None:
        self.gw = gateway
        # Requests go to the client's transport directly: AsyncClient.send() adds redirects,
        # auth, cookie extraction and event hooks, none of which a proxy uses, at ~15 % of the
        # gateway's CPU per request.
        self.transport = client.transport
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self.rng = random.Random()
        self.requests_in_flight = 0
        self.retries_in_flight = 0
        self._timeouts: dict[tuple[str, bool], dict[str, float | None]] = {}

    # -- picking ---------------------------------------------------------------------------

    def try_pick(self, call: Call) -> Replica | None:
        """A replica of the lane's pool, else of its ``spill_to`` pool, that can take the
        request now: healthy, serving the model, below its limit, not tried yet."""
        lane = call.lane
        fleet = self.gw.fleet
        has_room = self.gw.admission.has_room  # counts slots handed to queued requests
        for pool_name in (lane.pool, lane.spill_to):
            # A request keeps the lane it started with; a reload may have removed its pool.
            pool = fleet.pools.get(pool_name) if pool_name is not None else None
            if pool is None:
                continue
            cands = [r for r in pool.candidates(call.model) if has_room(r) and r not in call.tried]
            if not cands:
                continue
            key = None
            cfg = pool.config
            if cfg.balance == "prefix_affinity" and call.profile is not None:
                key = affinity_key(call.profile, cfg.prefix_chars)
            if cfg.balance == "cache_aware":
                choice = cache_aware.pick(self.gw, pool_name, cands, call, self.rng)
            else:
                choice = balance.pick(
                    cfg.balance,
                    cands,
                    key=key,
                    rng=self.rng,
                    rr_index=pool.rr_counter,
                    bounded_load=cfg.bounded_load,
                )
            if not call.tried:  # round robin advances once per request, not per retry
                pool.rr_counter += 1
            if choice is not None:
                if pool_name != lane.pool:
                    self.gw.metrics.spills.labels(lane.name, lane.pool, pool_name).inc()
                return choice
        return None

    def any_serving(self, call: Call) -> bool:
        fleet = self.gw.fleet
        lane = call.lane
        pools = fleet.pools
        return any(
            pools[p].candidates(call.model) for p in (lane.pool, lane.spill_to) if p in pools
        )

    def _retry_allowed(self) -> bool:
        budget = max(3.0, self.gw.policy.retry.budget_ratio * self.requests_in_flight)
        return self.retries_in_flight < budget

    # -- the request -----------------------------------------------------------------------

    async def run(self, call: Call, send: Send) -> None:
        """Relay ``call`` to a replica, retrying before the first byte; raises ``Rejected`` or
        ``UpstreamFailed`` when nothing could be sent."""
        policy = self.gw.policy
        queued_at = now()
        replica = await self.gw.admission.admit(
            call.lane, lambda: self.try_pick(call), lambda: self.any_serving(call)
        )
        # No await between here and ``fleet.attempt_started`` in ``_attempt``: admission's
        # reservation of this slot turns into the replica's in-flight count in one step.
        call.queue_wait_s = now() - queued_at
        self.requests_in_flight += 1
        # One deadline for all attempts (DESIGN 5), from the first one's start: the queue wait
        # has its own bound (queue_timeout_s).
        loop_time = asyncio.get_running_loop().time
        deadline = loop_time() + policy.retry.deadline_s
        try:
            last: RetryableFailure | None = None
            all_overloaded = True
            attempts = 0
            while True:
                attempts += 1
                is_retry = attempts > 1
                if is_retry:
                    self.retries_in_flight += 1
                try:
                    await self._attempt(call, replica, send, deadline)
                    return
                except RetryableFailure as failure:
                    last = failure
                    all_overloaded = all_overloaded and failure.overloaded
                    call.tried.add(replica)
                finally:
                    if is_retry:
                        self.retries_in_flight -= 1
                # Rescues of an ejected replica's requests are outside the budget: they are
                # bounded by what that replica held, and the budget is there to stop retry
                # storms against replicas that fail, not to fail the requests of one that died.
                rescue = last.reason == "replica_ejected"
                if (
                    not last.retry
                    or attempts >= policy.retry.max_attempts
                    or loop_time() >= deadline
                    or not (rescue or self._retry_allowed())
                ):
                    break
                nxt = self.try_pick(call)
                if nxt is None:
                    break
                replica = nxt
                call.retries += 1
                self.gw.metrics.retries.labels(call.lane.name, last.reason).inc()
            assert last is not None
            call.error = last.detail
            if all_overloaded:
                # Every replica tried said it was busy: that is a 503 to come back later, not
                # a broken gateway.
                raise UpstreamBusy(
                    f"every replica tried is overloaded ({attempts} attempt(s)): {last.detail}",
                    headers={"retry-after": "1"},
                )
            raise UpstreamFailed(
                f"no replica could serve the request after {attempts} attempt(s): {last.detail}"
            )
        finally:
            self.requests_in_flight -= 1
            self.gw.admission.finished(call.lane)

    def _timeout(self, lane: LaneConfig, stream: bool) -> dict[str, float | None]:
        """The request's timeout extension. A stream's idle watchdog is the socket read
        timeout; a plain response arrives whole at the end of generation, so it has none (a
        stalled replica is ended by its ejection)."""
        read = lane.stream_idle_timeout_s if stream else None
        key = (lane.name, stream)
        t = self._timeouts.get(key)
        if t is None or t["read"] != read:
            t = httpx.Timeout(
                connect=CONNECT_TIMEOUT_S, read=read, write=30.0, pool=POOL_TIMEOUT_S
            ).as_dict()
            self._timeouts[key] = t
        return t

    def _upstream_headers(self, call: Call, replica: Replica) -> list[tuple[bytes, bytes]]:
        headers = list(call.headers)
        headers.append((b"x-request-id", call.request_id.encode()))
        if replica.api_key:
            headers.append((b"authorization", b"Bearer " + replica.api_key.encode()))
        return headers

    async def _attempt(self, call: Call, replica: Replica, send: Send, deadline: float) -> None:
        """One attempt on ``replica``. ``deadline`` (event loop time) is the request's: a
        stream's first-token watchdog fires at it at the latest."""
        fleet = self.gw.fleet
        attempt = Attempt(replica, call.task)
        fleet.attempt_started(replica)
        replica.streams.add(attempt)
        call.replica = replica
        call.pool = replica.pool
        failure: str | None = None
        response: httpx.Response | None = None
        try:
            if call.query:
                url = httpx.URL(replica.url + call.path + "?" + query_text(call.query))
            else:
                url = self._urls.get((replica.url, call.path))
                if url is None:
                    url = self._urls[(replica.url, call.path)] = httpx.URL(replica.url + call.path)
            # Built directly, with the body as a ready stream: a fifth of the cost of
            # ``content=`` (which copies headers twice to add Host and Content-Length; aiohttp
            # adds both from the URL and the bytes) and of client.build_request().
            request = httpx.Request(
                "POST",
                url,
                stream=httpx.ByteStream(call.body),
                headers=self._upstream_headers(call, replica),
                extensions={"timeout": self._timeout(call.lane, call.stream)},
            )
            if call.overhead_s is None:  # arrival to the first send, retries apart
                call.overhead_s = now() - call.received_at
            # The first-token watchdog (streams only) runs from the attempt's start: a replica
            # that withholds its status line is as silent as one withholding its first token.
            # It fires at the request's deadline at the latest, and is switched off just
            # before anything is sent to the client. A plain response arrives whole at the end
            # of generation: its attempt is not cut (the deadline only stops further ones).
            fire_at = None
            if call.stream:
                fire_at = asyncio.get_running_loop().time() + call.lane.first_token_timeout_s
                if fire_at > deadline:
                    fire_at = deadline
            try:
                async with asyncio.timeout_at(fire_at) as watchdog:
                    try:
                        response = await self.transport.handle_async_request(request)
                    except httpx.ReadTimeout:
                        raise  # silent before the status line: the idle watchdog, below
                    except (httpx.TransportError, aiohttp.ClientError) as exc:
                        if _reached_replica(exc):
                            failure = "reset"
                            detail = f"{replica.name} closed the connection: {_why(exc)}"
                            raise self._after_send(call, failure, detail) from None
                        # Refused, unreachable, connect timeout: the replica never saw the
                        # request. An answer that is not HTTP (aiohttp's own error, unmapped
                        # by the transport) comes from something that is no vLLM server (a
                        # wrong port, another protocol): nothing was generated, so it is
                        # retried the same way.
                        failure = "connect"
                        detail = f"connect to {replica.name}: {_why(exc)}"
                        raise RetryableFailure("connect", failure, detail) from None
                    await self._relay_response(call, attempt, response, send, watchdog)
            except TimeoutError:
                if fire_at == deadline:
                    # Cut short by the request's deadline, not by its own timeout: no verdict
                    # on the replica (as when the client leaves), and no retry after it.
                    detail = (
                        f"{replica.name} sent no token before the request's deadline "
                        f"(retry.deadline_s={self.gw.policy.retry.deadline_s:g})"
                    )
                    # No retry: the deadline has passed (uvloop's millisecond timers may fire a
                    # hair before loop.time() reaches it, so the loop's own check can miss).
                    raise RetryableFailure(
                        "first_token_timeout", None, detail, retry=False
                    ) from None
                failure = "first_token_timeout"
                detail = f"{replica.name} sent no token within {call.lane.first_token_timeout_s:g}s"
                raise RetryableFailure("first_token_timeout", failure, detail) from None
            if call.status >= 500:
                failure = "upstream_5xx"
        except asyncio.CancelledError:
            reason = attempt.interrupted
            task = call.task
            if reason is None or task is None or task.uncancel() > 0:
                raise  # the client left (or the server stops): nothing more to do
            # Ended by a health verdict on its replica (DESIGN 5, rescue).
            failure = "stream_idle"
            if not attempt.content_sent and not call.started:
                raise RetryableFailure(
                    "replica_ejected", None, f"replica {replica.name} was ejected ({reason})"
                ) from None
            await self._end_stream_with_error(
                call, send, f"replica {replica.name} stopped generating and was ejected"
            )
        except RetryableFailure as exc:
            failure = failure or exc.failure
            raise
        except httpx.TimeoutException:
            # The idle watchdog (the socket read timeout) fired.
            failure = "stream_idle"
            if not call.started:
                raise RetryableFailure(
                    "first_token_timeout", failure, f"{replica.name} went silent"
                ) from None
            await self._end_stream_with_error(
                call,
                send,
                f"replica {replica.name} sent nothing for {call.lane.stream_idle_timeout_s:g}s",
            )
        except (httpx.TransportError, aiohttp.ClientError) as exc:
            # The answer had begun: the request was sent.
            failure = "reset"
            if not call.started:
                detail = f"{replica.name} closed the connection: {_why(exc)}"
                raise self._after_send(call, failure, detail) from None
            await self._end_stream_with_error(
                call, send, f"replica {replica.name} closed the connection mid-stream"
            )
        finally:
            replica.streams.discard(attempt)
            fleet.attempt_finished(replica, failure)
            self.gw.admission.released(replica)
            if response is not None:
                with contextlib.suppress(Exception):
                    await response.aclose()

    def _after_send(self, call: Call, failure: str, detail: str) -> RetryableFailure:
        """A reset after the request was sent, before anything reached the client. The
        replica may have spent GPU work on it, so like a 500/502/504 it is retried only with
        ``retry.on_5xx_after_send``, at most once per request (RELIABILITY 6); counted under
        that rule's retry reason, ``upstream_5xx``. Otherwise the request fails with it."""
        retry = self.gw.policy.retry.on_5xx_after_send and not call.retried_after_send
        if retry:
            call.retried_after_send = True
        return RetryableFailure("upstream_5xx", failure, detail, retry=retry)

    async def _relay_response(
        self,
        call: Call,
        attempt: Attempt,
        response: httpx.Response,
        send: Send,
        watchdog: asyncio.Timeout,
    ) -> None:
        status = response.status_code
        name = attempt.replica.name
        if status in (429, 503):
            await response.aread()
            # A 429 is a busy replica, not a broken one: retried, but never held against it
            # (ejecting replicas for being busy would only push their load onto the rest).
            failure = None if status == 429 else "upstream_5xx"
            detail = f"{name} answered {status} (overloaded)"
            raise RetryableFailure("upstream_5xx", failure, detail, overloaded=True)
        if status in (500, 502, 504):
            # Retried only under the opt-in, once; otherwise the replica's answer is relayed.
            if self.gw.policy.retry.on_5xx_after_send and not call.retried_after_send:
                await response.aread()
                raise self._after_send(call, "upstream_5xx", f"{name} answered {status}")
            attempt.last_progress = time.monotonic()
        if call.stream and status == 200 and _is_event_stream(response):
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
        if self.gw.policy.server.response_headers:
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
        if call.status == 200 and call.kind != "other":
            with contextlib.suppress(ValueError):
                call.usage = sse.usage_of(json.loads(body))
        call.started = True
        attempt.content_sent = True
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
        call.started = True
        attempt.content_sent = True
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
                    raise RetryableFailure(
                        "upstream_5xx",
                        "upstream_5xx",
                        f"{attempt.replica.name} failed before the first token: "
                        f"{_error_message(obj)}",
                    )
                if sse.carries_content(obj):
                    found = True
                    break
            if found or ended:
                break
        watchdog.reschedule(None)  # from here on the client has bytes: no retry
        metrics = self.gw.metrics
        call.status = 200
        call.started = True
        attempt.content_sent = found
        body = held[0] if len(held) == 1 else b"".join(held)
        # A stream that ended within the held chunks (one burst) goes out whole, its end in
        # the same write.
        if not ended and isinstance(response.stream, RawResponseStream):
            ended = response.stream.at_eof()
        await self._send_start(
            call, send, self._response_start(call, response, 200), body, not ended
        )
        t = now()
        if found:
            call.ttft_s = t - call.received_at
            call.content_chunks = 1
        tail = body[-2048:] if call.wants_usage else b""
        itl = metrics.series(metrics.inter_token, lane.name, attempt.replica.pool)
        if not ended:
            async for chunk in chunks:
                attempt.last_progress = time.monotonic()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                t2 = now()
                if not found:
                    found = attempt.content_sent = True
                    call.ttft_s = t2 - call.received_at
                else:
                    itl.observe(t2 - t)
                t = t2
                call.content_chunks += 1
                if call.wants_usage:
                    tail = (tail + chunk)[-2048:]
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        if tail:
            call.usage = sse.last_usage(tail)

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
            {"type": "http.response.body", "body": sse.error_event(message), "more_body": False}
        )


def _reached_replica(exc: BaseException) -> bool:
    """Whether a transport failure came on an established connection (the request may have
    reached the replica) rather than while connecting. The aiohttp transport raises
    ``ConnectTimeout`` for every aiohttp connection error, refused and reset alike, keeping
    aiohttp's exception as the cause: the cause tells them apart."""
    cause = exc.__cause__ if isinstance(exc.__cause__, aiohttp.ClientError) else exc
    if isinstance(cause, aiohttp.ClientConnectionError):
        # Connector errors cover refused, DNS and TLS; ConnectionTimeoutError the connect
        # and pool timeouts.
        return not isinstance(cause, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))
    if isinstance(cause, aiohttp.ClientError):
        return False  # not HTTP: see the caller
    # Without aiohttp underneath: httpx's own classes say the phase.
    return not isinstance(cause, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))


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


def raw_chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    """The response body as the transport reads it: ``aiter_raw()`` without its per-chunk
    re-chunking and byte counting (the relay's finally closes the response)."""
    stream = response.stream
    assert isinstance(stream, httpx.AsyncByteStream)
    return stream.__aiter__()


def _why(exc: BaseException) -> str:
    """The root cause of an httpx error: the aiohttp transport reports a refused connection
    as ``ConnectTimeout``, so look at the cause to tell refused from slow."""
    cause = exc.__cause__ or exc.__context__
    while cause is not None and (cause.__cause__ or cause.__context__) is not None:
        nxt = cause.__cause__ or cause.__context__
        if nxt is cause:
            break
        cause = nxt
    text = str(cause or exc) or type(cause or exc).__name__
    return text[:200]


def _error_message(obj: Any) -> str:
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", ""))[:200]
    return str(err)[:200]


__all__ = [
    "Attempt",
    "Call",
    "Rejected",
    "Relay",
    "RetryableFailure",
    "UpstreamClient",
    "make_client",
]
