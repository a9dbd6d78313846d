"""OpenTelemetry traces: a SERVER span per client request, a CLIENT span per upstream attempt.

Off unless the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
is set (and the optional extra ``otel`` is installed). When off, ``from_environ`` returns None
and the request path pays one ``is None`` check per request and per attempt: opentelemetry is
imported only here, and only when tracing is on.

Parent links: the client's W3C ``traceparent``/``tracestate`` is the SERVER span's parent; each
attempt's CLIENT span is the SERVER span's child, and the CLIENT span's own context replaces the
client's ``traceparent`` upstream, so a replica's spans (vLLM's ``--otlp-traces-endpoint``) are
children of the attempt that carried them, and a retried request shows one child per replica.

Attribute names follow the GenAI semantic conventions (``gen_ai.*``); what only Tokenlane knows
(lane, pool, replica, queue wait, retries, ejection reason) is under ``tokenlane.*``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from proxy.errors import RetryableFailure

if TYPE_CHECKING:
    import httpx

    from proxy.fleet.fleet import Replica
    from proxy.relay.call import Attempt, Call

log = logging.getLogger("tokenlane")

now = time.monotonic

# What the client may send and the gateway re-issues for each attempt.
TRACE_HEADERS = (b"traceparent", b"tracestate")
_TRACE_HEADER_NAMES = ("traceparent", "tracestate")

# gen_ai.operation.name by relayed kind or path (the conventions' well-known values).
_OPERATIONS = {
    "chat": "chat",
    "messages": "chat",  # Anthropic's Messages API is a chat API
    "responses": "chat",
    "completion": "text_completion",
    "/v1/embeddings": "embeddings",
}


def operation_name(kind: str, path: str) -> str:
    """``gen_ai.operation.name`` for a relayed request: the conventions' value where one
    exists, else the path (rerank, score, tokenize, audio have none)."""
    found = _OPERATIONS.get(kind) or _OPERATIONS.get(path)
    if found is not None:
        return found
    if path.startswith("/v1/responses/"):  # by id: no id in a name (its cardinality)
        return "responses." + ("cancel" if path.endswith("/cancel") else "retrieve")
    return path.rsplit("/", 1)[-1]


def endpoint_from(environ: Mapping[str, str]) -> str | None:
    """The OTLP/HTTP traces URL the standard variables name, or None (tracing off).

    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is used as given; ``OTEL_EXPORTER_OTLP_ENDPOINT`` is
    a base, to which ``/v1/traces`` is appended (as the OTLP exporter specification says).
    ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn it off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    url = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if url:
        return url
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if base:
        return base.rstrip("/") + "/v1/traces"
    return None


def request_attributes(call: Call) -> dict[str, Any]:
    """What is known of a request when it arrives (pure: table-tested)."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": operation_name(call.kind, call.path),
        "http.request.method": call.method,
        "url.path": call.path,
        "tokenlane.request_id": call.request_id,
        "tokenlane.lane": call.lane.name,
        "tokenlane.stream": call.stream,
    }
    if call.model is not None:
        attrs["gen_ai.request.model"] = call.model
    profile = call.profile
    if profile is not None:
        attrs["tokenlane.prompt_tokens_estimated"] = profile.prompt_tokens_est
        per = profile.n * profile.batch
        if profile.output_tokens is not None and per > 0:
            # output_tokens is max_tokens x n x batch: the request's own value back.
            attrs["gen_ai.request.max_tokens"] = profile.output_tokens // per
        if profile.n != 1:
            attrs["gen_ai.request.choice.count"] = profile.n
    return attrs


def outcome_attributes(call: Call) -> dict[str, Any]:
    """What is known of a request when it ends (pure: table-tested)."""
    attrs: dict[str, Any] = {
        "http.response.status_code": call.status,
        "tokenlane.queue_wait_s": call.queue_wait_s,
        "tokenlane.retries": call.retries,
        "tokenlane.content_chunks": call.content_chunks,
    }
    if call.pool is not None:
        attrs["tokenlane.pool"] = call.pool
    if call.replica is not None:
        attrs["tokenlane.replica"] = call.replica.name
    if call.ttft_s is not None:
        attrs["gen_ai.response.time_to_first_chunk"] = call.ttft_s
    if call.disconnected:
        attrs["tokenlane.client_disconnected"] = True
    usage = call.usage
    if usage:
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(prompt, int):
            attrs["gen_ai.usage.input_tokens"] = prompt
        if isinstance(completion, int):
            attrs["gen_ai.usage.output_tokens"] = completion
    seams = getattr(call.continuation, "seams", None)
    if seams:
        attrs["tokenlane.continuations"] = len(seams)
    reasons = call.finish_reasons
    if reasons is None:  # a continuable stream: its splice read every chunk
        finish = getattr(call.continuation, "finish_reason", None)
        reasons = [finish] if isinstance(finish, str) else None
    if reasons:
        attrs["gen_ai.response.finish_reasons"] = list(reasons)
    if call.error is not None:
        attrs["error.type"] = _error_type(call.status)
    return attrs


def _error_type(status: int) -> str:
    return str(status) if status >= 400 else "_OTHER"


def attempt_outcome(attempt: Attempt, exc: BaseException | None) -> dict[str, Any]:
    """How an attempt ended, as attributes (pure: table-tested). ``exc`` is what ended it."""
    attrs: dict[str, Any] = {"tokenlane.phase": attempt.phase.name.lower()}
    if attempt.interrupted is not None:
        attrs["tokenlane.ejection_reason"] = attempt.interrupted
    if isinstance(exc, RetryableFailure):
        attrs["error.type"] = str(exc.reason)
        attrs["tokenlane.retryable"] = exc.retry
    elif isinstance(exc, asyncio.CancelledError):
        attrs["error.type"] = "cancelled"
    elif exc is not None:
        attrs["error.type"] = type(exc).__name__
    return attrs


class Tracer:
    """The hooks the endpoint and the relay call when tracing is on (built by
    ``from_environ``). Spans live on ``Call.trace`` (the SERVER span) and in the relay's
    attempt (the CLIENT span)."""

    def __init__(self, provider: Any, service_name: str) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self._tracer = provider.get_tracer("tokenlane")
        self._propagator = TraceContextTextMapPropagator()
        self._trace = trace
        self._server = trace.SpanKind.SERVER
        self._client = trace.SpanKind.CLIENT
        self._error = trace.Status(trace.StatusCode.ERROR)
        self.service_name = service_name

    def request_started(self, call: Call) -> None:
        """The SERVER span, started at the request's arrival, its parent the client's
        ``traceparent`` (when it sent one)."""
        carrier = {
            k.decode("latin-1"): v.decode("latin-1") for k, v in call.headers if k in TRACE_HEADERS
        }
        parent = self._propagator.extract(carrier) if carrier else None
        start_ns = time.time_ns() - int((now() - call.received_at) * 1e9)
        attrs = request_attributes(call)
        name = attrs["gen_ai.operation.name"]
        if call.model is not None:
            name = f"{name} {call.model}"
        call.trace = self._tracer.start_span(
            name, context=parent, kind=self._server, start_time=start_ns, attributes=attrs
        )

    def request_finished(self, call: Call) -> None:
        span = call.trace
        call.trace = None
        span.set_attributes(outcome_attributes(call))
        for seam in getattr(call.continuation, "seams", None) or ():
            # Each switch to another replica: from, to, at which token, why.
            span.add_event(
                "tokenlane.continuation",
                attributes={f"tokenlane.continuation.{k}": v for k, v in seam.items()},
            )
        if call.ttft_s is not None:
            # The first chunk as a point on the timeline, not only a duration.
            at = time.time_ns() - int((now() - call.received_at - call.ttft_s) * 1e9)
            span.add_event("gen_ai.first_chunk", timestamp=at)
        if call.status >= 500 or call.error is not None:
            span.set_status(self._error)
        span.end()

    def attempt_started(
        self, call: Call, replica: Replica, request: httpx.Request, *, continuation: int = 0
    ) -> Any:
        """A CLIENT span, child of the request's SERVER span, whose context replaces the
        client's trace headers on ``request``. ``continuation``: the seam number (from 1) of
        a stream continued on ``replica``, 0 for an ordinary attempt."""
        parent = self._trace.set_span_in_context(call.trace) if call.trace is not None else None
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": operation_name(call.kind, call.path),
            "server.address": request.url.host,
            "tokenlane.pool": replica.pool,
            "tokenlane.replica": replica.name,
            "tokenlane.attempt": call.retries + 1,
        }
        if continuation:
            attrs["tokenlane.continuation"] = continuation
        if request.url.port is not None:
            attrs["server.port"] = request.url.port
        if call.model is not None:
            attrs["gen_ai.request.model"] = call.model
        name = f"{attrs['gen_ai.operation.name']} {replica.name}"
        span = self._tracer.start_span(name, context=parent, kind=self._client, attributes=attrs)
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        headers = request.headers
        for key in _TRACE_HEADER_NAMES:
            if key in headers:
                del headers[key]
        for key, value in carrier.items():
            headers[key] = value
        return span

    def attempt_finished(
        self,
        span: Any,
        call: Call,
        attempt: Attempt,
        exc: BaseException | None,
        error: str | None = None,
    ) -> None:
        """End an attempt's span: how it ended (``exc``, or ``error`` for a failure the relay
        returned as a value rather than raised)."""
        attrs = attempt_outcome(attempt, exc)
        if error is not None:
            attrs["error.type"] = error
        if exc is None and call.status:
            attrs["http.response.status_code"] = call.status
        span.set_attributes(attrs)
        if "error.type" in attrs or call.status >= 500:
            span.set_status(self._error)
        span.end()

    def shutdown(self) -> None:
        """Export what is buffered, then stop (blocking: call it off the event loop)."""
        self._provider.shutdown()


def from_environ(environ: Mapping[str, str]) -> Tracer | None:
    """A ``Tracer`` exporting over OTLP/HTTP when the standard variables ask for one, else
    None. Without the ``otel`` extra installed, a warning says so and tracing stays off."""
    endpoint = endpoint_from(environ)
    if endpoint is None:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning(
            "OTEL_EXPORTER_OTLP_* is set but OpenTelemetry is not installed "
            "(pip install 'tokenlane[otel]'): tracing is off"
        )
        return None
    service = environ.get("OTEL_SERVICE_NAME", "").strip() or "tokenlane"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    # Batched off the request path: spans are queued, exported by the processor's thread.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    log.info("tracing on: OTLP/HTTP to %s as %s", endpoint, service)
    return Tracer(provider, service)


__all__ = [
    "TRACE_HEADERS",
    "Tracer",
    "attempt_outcome",
    "endpoint_from",
    "from_environ",
    "operation_name",
    "outcome_attributes",
    "request_attributes",
]
