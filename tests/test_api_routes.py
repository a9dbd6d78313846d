"""vLLM's other routes through the gateway, over real sockets against the fake upstream: each
reaches a replica unchanged (method, path, query, body), GET routes included; CORS answers a
browser's preflight only when configured; ``x-api-key`` is a client key and is never relayed;
the gateway's own errors on the Messages paths are in Anthropic's shape with ``retry-after``;
and a request naming a stored response the gateway does not know gets vLLM's 404."""

from __future__ import annotations

import httpx
import pytest

from loadtest.fake_upstream import MODEL, FakeUpstream, running

from .gateway import policy_for, running_gateway

POST_ROUTES = [
    "/score",
    "/rerank",
    "/v2/rerank",
    "/v2/embed",
    "/classify",
    "/pooling",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/chat/completions/batch",
    "/invocations",
    "/v1/messages/count_tokens",
]
GET_ROUTES = ["/ping", "/version", "/tokenizer_info"]


def last_request(up: FakeUpstream) -> tuple[str, bytes, dict[str, str]]:
    st = up.stats
    return st.targets[-1], st.raw_bodies[-1], st.headers[-1]


async def test_every_other_vllm_route_is_relayed_unchanged() -> None:
    async with running(tokens=2) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                for i, path in enumerate(POST_ROUTES):
                    body = b'{"model": "%s", "input": ["a", "b"], "x": %d}' % (MODEL.encode(), i)
                    resp = await client.post(
                        url + path + "?probe=1",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                    assert resp.status_code == 200, (path, resp.text)
                    target, raw, _ = last_request(up)
                    assert (target, raw) == (path + "?probe=1", body)
                for path in GET_ROUTES:
                    resp = await client.get(url + path)
                    assert resp.status_code == 200, (path, resp.text)
                    target, raw, _ = last_request(up)
                    assert (target, raw) == (path, b"")
                # vLLM's /ping also takes POST (SageMaker); /version does not.
                assert (await client.post(url + "/ping")).status_code == 200
                resp = await client.post(url + "/version")
                assert resp.status_code == 405
                assert resp.json()["error"]["type"] == "MethodNotAllowed"


async def test_a_preflight_is_answered_only_when_cors_is_configured() -> None:
    preflight = {
        "origin": "https://app.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type, authorization",
    }
    async with running(tokens=2) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.options(url + "/v1/chat/completions", headers=preflight)
                assert resp.status_code == 405  # today's behaviour: no CORS
                assert "access-control-allow-origin" not in resp.headers
        policy = policy_for({"p": [up.url]}, server={"cors_allowed_origins": ["*"]})
        async with running_gateway(policy) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.options(url + "/v1/chat/completions", headers=preflight)
                assert resp.status_code == 200
                assert resp.headers["access-control-allow-origin"] == "*"
                assert "POST" in resp.headers["access-control-allow-methods"]
                assert "authorization" in resp.headers["access-control-allow-headers"].lower()
                resp = await client.post(
                    url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                    headers={"origin": "https://app.example"},
                )
                assert resp.status_code == 200
                assert resp.headers["access-control-allow-origin"] == "*"
                # A stream's start too: the middleware's send takes it, not the server's writer.
                resp = await client.post(
                    url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "stream": True},
                    headers={"origin": "https://app.example"},
                )  # fmt: skip
                assert resp.status_code == 200 and "data: [DONE]" in resp.text
                assert resp.headers["access-control-allow-origin"] == "*"
                # Continuable, so its burst's parts were held and given to the middleware's
                # send: every token once, in order, and the ids the client did not ask for
                # nulled. (That the parts are joined for a send is held by
                # test_continuation's burst test, which runs without the server's writer.)
                text = resp.text
                assert text.index('"content":" tok0"') < text.index('"content":" tok1"')
                assert text.count(" tok0") == 1 and '"token_ids":[' not in text
        policy = policy_for({"p": [up.url]}, server={"cors_allowed_origins": ["https://a.example"]})
        async with running_gateway(policy) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.options(url + "/v1/chat/completions", headers=preflight)
                assert resp.status_code == 400  # an origin not allowed: Starlette's refusal
                ok = {**preflight, "origin": "https://a.example"}
                resp = await client.options(url + "/v1/chat/completions", headers=ok)
                assert resp.status_code == 200
                assert resp.headers["access-control-allow-origin"] == "https://a.example"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
async def test_x_api_key_is_a_client_key_and_is_never_relayed(path: str) -> None:
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    async with running(tokens=2) as up:
        env = {"TOKENLANE_API_KEYS": "sk-good"}
        async with running_gateway(policy_for({"p": [up.url]}), environ=env) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.post(url + path, json=body, headers={"x-api-key": "sk-good"})
                assert resp.status_code == 200, resp.text
                _, _, seen = last_request(up)
                assert "x-api-key" not in seen and "authorization" not in seen
                before = up.stats.requests
                resp = await client.post(url + path, json=body, headers={"x-api-key": "sk-bad"})
                assert resp.status_code == 401
                resp = await client.get(url + "/v1/models", headers={"x-api-key": "sk-good"})
                assert resp.status_code == 200
                assert up.stats.requests == before


async def test_the_gateways_own_errors_on_messages_paths_are_anthropic_shaped() -> None:
    async with running(tokens=2) as up:
        env = {"TOKENLANE_API_KEYS": "sk-good"}
        async with running_gateway(policy_for({"p": [up.url]}), environ=env) as (url, app):
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.post(url + "/v1/messages", json={"messages": []})
                assert resp.status_code == 401
                assert resp.json()["type"] == "error"
                assert resp.json()["error"]["type"] == "authentication_error"
                key = {"x-api-key": "sk-good"}
                resp = await client.post(
                    url + "/v1/messages", json={"messages": [], "model": MODEL}, headers=key
                )
                assert resp.status_code == 400  # max_tokens is required there
                assert resp.json()["error"] == {
                    "type": "invalid_request_error",
                    "message": "`max_tokens` is required",
                }
                resp = await client.post(
                    url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": []},
                    headers=key,
                )  # fmt: skip
                assert resp.status_code == 200  # relayed: the replica counts
                # Every replica out: the gateway's fast 503, in the SDK's shape, with retry-after.
                for replica in app.gateway.fleet.replicas():
                    app.gateway.fleet.operator_eject(replica)
                body = {
                    "model": MODEL,
                    "max_tokens": 3,
                    "messages": [{"role": "user", "content": "hi"}],
                }
                resp = await client.post(url + "/v1/messages", json=body, headers=key)
                assert resp.status_code == 503
                assert resp.json()["error"]["type"] == "overloaded_error"
                assert int(resp.headers["retry-after"]) >= 1
                resp = await client.post(
                    url + "/v1/chat/completions", json=body, headers=key
                )  # the same refusal in OpenAI's shape on chat
                assert resp.status_code == 503 and "message" in resp.json()["error"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        (
            "POST",
            "/v1/responses",
            {"model": MODEL, "input": "hi", "previous_response_id": "resp_x"},
        ),
        ("GET", "/v1/responses/resp_x", None),
        ("POST", "/v1/responses/resp_x/cancel", None),
        ("GET", "/v1/responses/resp_x/input_items", None),
    ],
)
async def test_an_unknown_stored_response_is_vllms_404(
    method: str, path: str, body: dict[str, str] | None
) -> None:
    async with running(tokens=2) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                before = up.stats.requests
                resp = await client.request(method, url + path, json=body)
                assert resp.status_code == 404
                assert resp.json()["error"]["message"] == "Response with id 'resp_x' not found."
                assert up.stats.requests == before  # no replica was asked


async def test_requests_are_counted_by_api_and_logged_with_it() -> None:
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    async with running(tokens=2) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                assert (await client.post(url + "/v1/messages", json=body)).status_code == 200
                assert (
                    await client.post(url + "/v1/chat/completions", json=body)
                ).status_code == 200
                assert (await client.get(url + "/version")).status_code == 200
                page = (await client.get(url + "/metrics")).text
    counts = {
        line.split('api="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith("tokenlane_api_requests_total{")
    }
    assert counts == {
        "chat": 1, "completion": 0, "messages": 1, "responses": 0, "realtime": 0, "other": 1
    }  # fmt: skip
