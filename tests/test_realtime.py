"""The realtime WebSocket relay: its pure parts (close codes, the headers a replica gets)."""

from __future__ import annotations

import pytest

from proxy.edge.realtime import close_code_for, upstream_headers


@pytest.mark.parametrize(
    ("code", "sent"),
    [(1000, 1000), (1001, 1001), (4000, 4000), (1005, 1011), (1006, 1011), (None, 1011)],
)
def test_a_close_without_a_code_is_passed_on_as_a_failure(code: int | None, sent: int) -> None:
    assert close_code_for(code) == sent


def test_the_replica_gets_the_clients_headers_without_its_connection_or_credentials() -> None:
    headers = [
        (b"host", b"gw:8080"),
        (b"upgrade", b"websocket"),
        (b"connection", b"Upgrade"),
        (b"sec-websocket-key", b"abc"),
        (b"sec-websocket-version", b"13"),
        (b"authorization", b"Bearer sk-client"),
        (b"x-api-key", b"sk-client"),
        (b"openai-beta", b"realtime=v1"),
        (b"traceparent", b"00-1-2-01"),
    ]
    out = upstream_headers(headers, "rid-1", "sk-replica")
    assert out == [
        (b"openai-beta", b"realtime=v1"),
        (b"traceparent", b"00-1-2-01"),
        (b"x-request-id", b"rid-1"),
        (b"authorization", b"Bearer sk-replica"),
    ]
    assert (b"authorization", b"Bearer sk-replica") not in upstream_headers(headers, "r", None)
