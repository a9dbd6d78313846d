"""What the replica is told about the client, and what the access log tells about refusals.

The gateway appends the peer's address to ``X-Forwarded-For`` and ``Forwarded``, keeping the
incoming values only from ``server.trusted_proxies``; it drops the headers the client's
``Connection:`` names. Its own refusals each leave one access line, and every line says who
produced an error (``error_origin``: gateway or replica; null on success)."""

from __future__ import annotations

import httpx
import pytest

from loadtest.fake_upstream import running
from proxy.edge.connection import GatewayProtocol
from proxy.edge.endpoint import forwarding_headers, without_connection_named
from proxy.gateway import create_app
from proxy.policyfile import build_policy

from .gateway import policy_for, running_gateway, wait_ready
from .servers import serve_app
from .waiting import wait_until

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("peer", "chain", "forwarded", "trusted", "expected"),
    [
        ("10.0.0.9", [], [], False, [(b"x-forwarded-for", b"10.0.0.9"), (b"forwarded", b"for=10.0.0.9")]),
        # an untrusted peer's claims are replaced
        ("10.0.0.9", [b"1.2.3.4"], [b"for=1.2.3.4"], False,
         [(b"x-forwarded-for", b"10.0.0.9"), (b"forwarded", b"for=10.0.0.9")]),
        # a trusted proxy's are kept, the peer appended (several header lines joined in order)
        ("10.0.0.9", [b"1.2.3.4", b"5.6.7.8"], [b"for=1.2.3.4"], True,
         [(b"x-forwarded-for", b"1.2.3.4, 5.6.7.8, 10.0.0.9"),
          (b"forwarded", b"for=1.2.3.4, for=10.0.0.9")]),
        ("::1", [], [], False, [(b"x-forwarded-for", b"::1"), (b"forwarded", b'for="[::1]"')]),
        (None, [b"1.2.3.4"], [], False, []),  # no peer (a Unix socket): nothing to say
    ],
)  # fmt: skip
def test_forwarding_headers(
    peer: str | None,
    chain: list[bytes],
    forwarded: list[bytes],
    trusted: bool,
    expected: list[tuple[bytes, bytes]],
) -> None:
    assert forwarding_headers(peer, chain, forwarded, trusted) == expected


def test_headers_named_in_connection_are_dropped() -> None:
    headers = [(b"x-secret", b"s"), (b"content-type", b"application/json"), (b"x-keep", b"k")]
    assert without_connection_named(headers, b"keep-alive, X-Secret ,") == headers[1:]
    assert without_connection_named(headers, b" , ") == headers


async def _headers_received(trusted: list[str]) -> dict[str, str]:
    async with running() as up:
        policy = policy_for({"p": [up.url]}, server={"trusted_proxies": trusted})
        app = create_app(build_policy(policy), environ={})
        # As `make run` serves (``serve.uvicorn_config``): uvicorn's own proxy-header
        # handling off, so the peer is the socket's.
        async with (
            serve_app(app, http=GatewayProtocol, proxy_headers=False) as url,
            httpx.AsyncClient() as client,
        ):
            await wait_ready(url)
            resp = await client.post(
                url + "/v1/chat/completions",
                json=CHAT,
                headers={
                    "x-forwarded-for": "1.2.3.4",
                    "forwarded": "for=1.2.3.4",
                    "connection": "keep-alive, x-secret",
                    "x-secret": "hop",
                    "x-kept": "end-to-end",
                },
            )
            assert resp.status_code == 200
        return up.stats.headers[-1]


async def test_untrusted_peer_forwarding_claims_are_replaced() -> None:
    got = await _headers_received([])
    assert got["x-forwarded-for"] == "127.0.0.1"
    assert got["forwarded"] == "for=127.0.0.1"
    assert "x-secret" not in got
    assert got["x-kept"] == "end-to-end"


async def test_trusted_proxy_forwarding_claims_are_kept_and_appended() -> None:
    got = await _headers_received(["127.0.0.0/8"])
    assert got["x-forwarded-for"] == "1.2.3.4, 127.0.0.1"
    assert got["forwarded"] == "for=1.2.3.4, for=127.0.0.1"
    assert "x-secret" not in got


async def test_refusals_leave_access_lines_with_their_error_origin(
    access_lines: list[dict[str, object]],
) -> None:
    async with running() as up:
        policy = policy_for({"p": [up.url]}, server={"max_body_bytes": 4096})
        env = {"TOKENLANE_API_KEYS": "sk-good"}
        async with (
            running_gateway(policy, environ=env) as (url, _app),
            httpx.AsyncClient(headers={"authorization": "Bearer sk-good"}) as client,
        ):
            chat = url + "/v1/chat/completions"
            refused = [
                (await client.post(chat, json=CHAT, headers={"authorization": "Bearer bad"})),
                (await client.get(chat)),
                (await client.post(chat, content=b"{not json")),
                (await client.post(chat, json={**CHAT, "pad": "x" * 5000})),
                (await client.get(url + "/no/such/path")),
            ]
            statuses = [r.status_code for r in refused]
            assert statuses == [401, 405, 400, 413, 404]
            ok = await client.post(chat, json=CHAT)
            assert ok.status_code == 200
            up.fail_status = 500
            relayed = await client.post(chat, json=CHAT)
            assert relayed.status_code == 500

            await wait_until(lambda: len(access_lines) >= 7, what="seven access lines")
    by_status: dict[object, list[dict[str, object]]] = {}
    for line in access_lines:
        by_status.setdefault(line["status"], []).append(line)
    for status in statuses:
        (line,) = by_status[status]
        assert line["error_origin"] == "gateway"
        assert line["error"]
        assert line["path"] in ("/v1/chat/completions", "/no/such/path")
    (success,) = by_status[200]
    assert success["error_origin"] is None
    (upstream,) = by_status[500]
    assert upstream["error_origin"] == "replica"
