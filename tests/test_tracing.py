"""OpenTelemetry traces over real sockets: a gateway exporting to a real OTLP/HTTP receiver
started here (a small HTTP server decoding the protobuf ``ExportTraceServiceRequest``), with the
parent links from the client's ``traceparent`` to the SERVER span, its CLIENT span per attempt,
and the ``traceparent`` each replica received; and tracing off when nothing configures it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from loadtest.fake_upstream import MODEL, running
from loadtest.sim.server import run_sim
from loadtest.sim.settings import SimSettings
from proxy.errors import RetryableFailure, RetryReason
from proxy.fleet.fleet import ReplicaState
from proxy.observe import tracing
from proxy.relay.retry import Phase

from .gateway import policy_for, running_gateway
from .waiting import wait_until

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


class Receiver:
    """An OTLP/HTTP traces endpoint: every span posted to /v1/traces, decoded."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.posts = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        receiver.spans.extend(ss.spans)
                receiver.posts += 1
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@contextlib.contextmanager
def receiving() -> Iterator[Receiver]:
    receiver = Receiver()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


def attrs(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(x, x.WhichOneof("value")) for x in v.array_value.values]
        else:
            out[kv.key] = getattr(v, kind)
    return out


def tree(spans: list[Any], client_span: str) -> str:
    """The trace as an indented tree from the client's span (``pytest -s`` prints it)."""
    keep = ("tokenlane.", "gen_ai.response.finish_reasons", "gen_ai.usage.", "error.type")
    kids: dict[str, list[Any]] = {}
    for s in sorted(spans, key=lambda s: s.start_time_unix_nano):
        kids.setdefault(s.parent_span_id.hex(), []).append(s)
    lines = [f"client span {client_span} (trace {CLIENT_TRACE})"]

    def walk(parent: str, depth: int) -> None:
        for s in kids.get(parent, []):
            kind = {SERVER: "SERVER", CLIENT: "CLIENT"}.get(s.kind, str(s.kind))
            shown = {k: v for k, v in attrs(s).items() if k.startswith(keep)}
            events = [e.name for e in s.events]
            lines.append(f"{'  ' * depth}└ {kind} {s.name} {shown} events={events}")
            walk(s.span_id.hex(), depth + 1)

    walk(client_span, 1)
    return "\n".join(lines)


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


async def test_a_retried_request_is_one_trace_from_client_to_each_replica() -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with receiving() as receiver:
        async with running(tokens=5) as good, running(tokens=5) as busy:
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SERVICE_NAME": "gw-test"}
            policy = policy_for({"p": [good.url, busy.url]})
            async with running_gateway(policy, environ=env) as (url, app):
                assert app.gateway.tracer is not None
                fleet = app.gateway.fleet
                await wait_until(
                    lambda: all(r.state is ReplicaState.HEALTHY for r in fleet.replicas()),
                    what="both replicas healthy",
                )
                busy.fail_status = 503  # busy from now on: retried on the other replica
                async with httpx.AsyncClient(timeout=10) as client:
                    # Round robin advances once per request: one of two starts on `busy`.
                    for i in range(2):
                        r = await client.post(
                            url + "/v1/chat/completions",
                            json=body,
                            headers={
                                "traceparent": traceparent(CLIENT_TRACE, f"{i + 1:016x}"),
                                "tracestate": "vendor=abc",
                            },
                        )
                        assert r.status_code == 200
            # The gateway's stop flushed its batch: every span is here now.
        spans = list(receiver.spans)
    servers = [s for s in spans if s.kind == SERVER]
    clients = [s for s in spans if s.kind == CLIENT]
    assert len(servers) == 2 and len(clients) == 3
    by_parent: dict[bytes, list[Any]] = {}
    for c in clients:
        by_parent.setdefault(c.parent_span_id, []).append(c)
    [retried] = [s for s in servers if len(by_parent.get(s.span_id, [])) == 2]
    [plain] = [s for s in servers if s is not retried]
    print("\n" + tree(spans, retried.parent_span_id.hex()))
    # The client's traceparent is the SERVER span's parent.
    for s in servers:
        assert s.trace_id.hex() == CLIENT_TRACE
        assert s.parent_span_id.hex() in ("0000000000000001", "0000000000000002")
    a = attrs(retried)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.usage.output_tokens"] == 5
    assert isinstance(a["gen_ai.usage.input_tokens"], int)
    assert list(a["gen_ai.response.finish_reasons"]) == ["length"]  # max_tokens reached
    assert a["gen_ai.response.time_to_first_chunk"] > 0
    assert a["tokenlane.lane"] == "all" and a["tokenlane.pool"] == "p"
    assert a["tokenlane.retries"] == 1 and attrs(plain)["tokenlane.retries"] == 0
    assert a["tokenlane.queue_wait_s"] >= 0
    assert a["http.response.status_code"] == 200
    assert [e.name for e in retried.events] == ["gen_ai.first_chunk"]
    # One CLIENT span per attempt, in order: the busy replica's failed, the good one's served.
    first, second = sorted(by_parent[retried.span_id], key=lambda s: s.start_time_unix_nano)
    assert attrs(first)["tokenlane.replica"] == busy.url.removeprefix("http://")
    assert attrs(first)["error.type"] == "upstream_5xx"
    assert attrs(first)["tokenlane.attempt"] == 1
    assert attrs(second)["tokenlane.replica"] == good.url.removeprefix("http://")
    assert attrs(second)["tokenlane.attempt"] == 2
    assert "error.type" not in attrs(second)
    for c in clients:
        assert c.trace_id.hex() == CLIENT_TRACE
    # What each replica received: the CLIENT span's context, not the client's, and the
    # client's tracestate kept.
    seen = {
        (h["traceparent"], h.get("tracestate"))
        for up in (good, busy)
        for h, t in zip(up.stats.headers, up.stats.targets, strict=True)
        if t == "/v1/chat/completions"
    }
    assert seen == {(traceparent(CLIENT_TRACE, c.span_id.hex()), "vendor=abc") for c in clients}


async def test_a_continued_stream_is_one_trace_with_a_span_per_replica() -> None:
    """A stream cut on ``a`` and finished on ``b``: the SERVER span carries the seam (an event
    and a count) and the finish reason; one CLIENT span per replica, the second marked as the
    continuation, and ``b`` received that span's context."""
    settings = SimSettings(step_fixed_s=0.001, decode_per_seq_s=0.0, prefill_per_token_s=0.0,
                           request_overhead_s=0.0)  # fmt: skip
    body = {
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": 30,
        "temperature": 0,
        "stream": True,
    }
    with receiving() as receiver:
        async with run_sim(settings, name="a") as a, run_sim(settings, name="b") as b:
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
            policy = policy_for(
                {"a": [a.url], "b": [b.url]},
                lanes=[{"name": "all", "pool": "a", "spill_to": "b"}],
                continuation={"enabled": True},
            )
            async with running_gateway(policy, environ=env) as (url, _):
                await a.set_fault({"fault": "cut_close", "after_tokens": 10})
                async with httpx.AsyncClient(timeout=30) as client:
                    r = await client.post(
                        url + "/v1/chat/completions",
                        json=body,
                        headers={"traceparent": traceparent(CLIENT_TRACE, "0000000000000009")},
                    )
                assert r.status_code == 200 and "error" not in r.text
            spans = list(receiver.spans)
            a_name, b_name = a.url.removeprefix("http://"), b.url.removeprefix("http://")
            received = [q["headers"].get("traceparent") for q in b.requests()
                        if q["path"] == "/v1/completions"]  # fmt: skip
    [server] = [s for s in spans if s.kind == SERVER]
    print("\n" + tree(spans, "0000000000000009"))
    first, second = sorted(
        (s for s in spans if s.kind == CLIENT), key=lambda s: s.start_time_unix_nano
    )
    assert first.parent_span_id == second.parent_span_id == server.span_id
    assert attrs(first)["tokenlane.replica"] == a_name
    assert "tokenlane.continuation" not in attrs(first)
    assert attrs(second)["tokenlane.replica"] == b_name
    assert attrs(second)["tokenlane.continuation"] == 1
    assert "error.type" not in attrs(second)
    a_server = attrs(server)
    assert a_server["tokenlane.continuations"] == 1
    assert list(a_server["gen_ai.response.finish_reasons"]) == ["length"]
    [seam] = [e for e in server.events if e.name == "tokenlane.continuation"]
    seam_attrs = {kv.key: kv.value for kv in seam.attributes}
    assert seam_attrs["tokenlane.continuation.from"].string_value == a_name
    assert seam_attrs["tokenlane.continuation.to"].string_value == b_name
    assert seam_attrs["tokenlane.continuation.trigger"].string_value == "eof"
    # b's continuation request carried the continuation's CLIENT span as its parent.
    assert traceparent(CLIENT_TRACE, second.span_id.hex()) in received


async def test_tracing_is_off_without_the_otlp_variables() -> None:
    async with running(tokens=2) as up:
        async with running_gateway(policy_for({"p": [up.url]}), environ={}) as (url, app):
            assert app.gateway.tracer is None
            assert app.gateway.relay.tracer is None
            async with httpx.AsyncClient(timeout=10) as client:
                sent = traceparent(CLIENT_TRACE, CLIENT_SPAN)
                r = await client.post(
                    url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                    headers={"traceparent": sent},
                )
                assert r.status_code == 200
    # Untouched, as before tracing existed.
    assert up.stats.headers[-1]["traceparent"] == sent


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "http://c:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, "http://c:4318/v1/traces"),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/x",
            },
            "http://t:9/x",
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, None),
    ],
)
def test_the_standard_variables_turn_tracing_on(
    environ: dict[str, str], expected: str | None
) -> None:
    assert tracing.endpoint_from(environ) == expected


@pytest.mark.parametrize(
    ("kind", "path", "expected"),
    [
        ("chat", "/v1/chat/completions", "chat"),
        ("completion", "/v1/completions", "text_completion"),
        ("other", "/v1/embeddings", "embeddings"),
        ("other", "/v1/rerank", "rerank"),
        ("other", "/tokenize", "tokenize"),
        ("messages", "/v1/messages", "chat"),
        ("responses", "/v1/responses", "chat"),
        ("other", "/v1/responses/resp_1", "responses.retrieve"),
        ("other", "/v1/responses/resp_1/cancel", "responses.cancel"),
    ],
)
def test_operation_names(kind: str, path: str, expected: str) -> None:
    assert tracing.operation_name(kind, path) == expected


@pytest.mark.parametrize(
    ("interrupted", "exc", "expected"),
    [
        (None, None, {"tokenlane.phase": "content"}),
        (
            "stalled",
            RetryableFailure(RetryReason("replica_ejected"), None, "x"),
            {
                "tokenlane.phase": "content",
                "tokenlane.ejection_reason": "stalled",
                "error.type": "replica_ejected",
                "tokenlane.retryable": True,
            },
        ),
        (
            None,
            asyncio.CancelledError(),
            {"tokenlane.phase": "content", "error.type": "cancelled"},
        ),
        (None, OSError(), {"tokenlane.phase": "content", "error.type": "OSError"}),
    ],
)
def test_attempt_outcomes(
    interrupted: str | None, exc: BaseException | None, expected: Any
) -> None:
    attempt = SimpleNamespace(phase=Phase.CONTENT, interrupted=interrupted)
    assert tracing.attempt_outcome(attempt, exc) == expected  # type: ignore[arg-type]
