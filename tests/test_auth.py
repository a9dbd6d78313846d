"""Client keys and per-key rate limits: the pure key check, then the gateway over real sockets
(401 in OpenAI's shape, /v1/models guarded, keys kept out of logs and replicas, 429 with
x-ratelimit-* headers, limits off without keys)."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

import httpx
import pytest

from loadtest.fake_upstream import running
from proxy.edge.auth import ClientKeys, bearer_token, key_id

from .gateway import policy_for, running_gateway

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}
KEYS = "sk-alpha-0123456789,sk-beta-9876543210"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def rejections(app: Any, lane: str, reason: str) -> float:
    return app.gateway.metrics.rejections.labels(lane, reason)._value.get()


# ---------------------------------------------------------------------------- pure


def test_identify_returns_the_key_id_for_each_configured_key() -> None:
    keys = ClientKeys.from_env({"K": " sk-a , sk-b,,"}, "K")
    assert len(keys) == 2
    assert keys.identify(b"Bearer sk-a") == key_id("sk-a")
    assert keys.identify(b"bearer   sk-b ") == key_id("sk-b")


@pytest.mark.parametrize(
    "header",
    [None, b"", b"Bearer", b"Bearer ", b"Basic sk-a", b"Bearer sk-", b"Bearer sk-ab", b"sk-a"],
)
def test_identify_refuses_missing_malformed_and_wrong_keys(header: bytes | None) -> None:
    assert ClientKeys(["sk-a", "sk-b"]).identify(header) is None


def test_no_keys_means_auth_is_off() -> None:
    assert not ClientKeys.from_env({}, "TOKENLANE_API_KEYS").enabled
    assert not ClientKeys.from_env({"TOKENLANE_API_KEYS": " , "}, "TOKENLANE_API_KEYS").enabled


def test_identify_compares_against_every_key_even_after_a_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(len(a) + len(b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    keys = ClientKeys(["sk-first", "sk-second", "sk-third"])
    assert keys.identify(b"Bearer sk-first") == key_id("sk-first")
    # All three compared, on equal-length digests whatever the presented key's length.
    assert calls == [64, 64, 64]


def test_key_id_does_not_contain_the_key() -> None:
    kid = key_id("sk-alpha-0123456789")
    assert len(kid) == 12 and "alpha" not in kid


def test_bearer_token_parses_the_scheme_case_insensitively() -> None:
    assert bearer_token(b"BEARER tok") == b"tok"
    assert bearer_token(b"Token tok") is None


# ---------------------------------------------------------------------------- over sockets


async def test_missing_or_wrong_key_gets_401_in_openai_shape() -> None:
    async with running(tokens=3) as up:
        env = {"TOKENLANE_API_KEYS": KEYS}
        async with running_gateway(policy_for({"p": [up.url]}), environ=env) as (url, app):
            before = up.stats.requests
            async with httpx.AsyncClient(timeout=10) as client:
                missing = await client.post(url + "/v1/chat/completions", json=CHAT)
                wrong = await client.post(
                    url + "/v1/chat/completions", json=CHAT, headers=bearer("sk-alpha-012345678")
                )
                ok = await client.post(
                    url + "/v1/chat/completions", json=CHAT, headers=bearer("sk-beta-9876543210")
                )
            for resp in (missing, wrong):
                assert resp.status_code == 401
                err = resp.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["code"] == "invalid_api_key"
                assert "sk-" not in err["message"]
            assert ok.status_code == 200
            assert up.stats.requests - before == 1  # refused requests never reach a replica
            assert rejections(app, "none", "unauthorized") == 2


async def test_models_and_every_v1_path_need_the_key_but_operations_do_not() -> None:
    async with running(tokens=3) as up:
        env = {"TOKENLANE_API_KEYS": KEYS}
        async with running_gateway(policy_for({"p": [up.url]}), environ=env) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                assert (await client.get(url + "/v1/models")).status_code == 401
                assert (await client.get(url + "/v1/models/x")).status_code == 401
                assert (await client.get(url + "/v1/nothing")).status_code == 401
                assert (await client.post(url + "/tokenize", json={})).status_code == 401
                good = bearer("sk-alpha-0123456789")
                models = await client.get(url + "/v1/models", headers=good)
                assert models.status_code == 200 and models.json()["data"]
                assert (await client.get(url + "/v1/nothing", headers=good)).status_code == 404
                for path in ("/health", "/ready", "/metrics"):
                    assert (await client.get(url + path)).status_code == 200


async def test_custom_api_keys_env_is_honoured() -> None:
    async with running(tokens=3) as up:
        policy = policy_for({"p": [up.url]}, server={"api_keys_env": "MY_KEYS"})
        env = {"MY_KEYS": "sk-mine", "TOKENLANE_API_KEYS": "sk-other"}
        async with running_gateway(policy, environ=env) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                r1 = await client.get(url + "/v1/models", headers=bearer("sk-other"))
                r2 = await client.get(url + "/v1/models", headers=bearer("sk-mine"))
    assert (r1.status_code, r2.status_code) == (401, 200)


async def test_client_key_reaches_neither_a_log_line_nor_a_replica(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    key = "sk-alpha-0123456789"
    async with running(tokens=3) as up:
        env = {"TOKENLANE_API_KEYS": KEYS}
        async with running_gateway(policy_for({"p": [up.url]}), environ=env) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                for body in (CHAT, {**CHAT, "stream": True}):
                    resp = await client.post(
                        url + "/v1/chat/completions", json=body, headers=bearer(key)
                    )
                    assert resp.status_code == 200
                await client.post(url + "/v1/chat/completions", json=CHAT, headers=bearer(key[:-1]))
    sent = [h for b, h in zip(up.stats.bodies, up.stats.headers, strict=True) if "messages" in b]
    assert len(sent) == 2
    assert all("authorization" not in h for h in sent)
    assert not any(key[:-1] in str(v) for h in up.stats.headers for v in h.values())
    assert any(r.name == "tokenlane.access" for r in caplog.records)
    assert not any(key[:-1] in r.getMessage() for r in caplog.records)


async def test_request_rate_limit_answers_429_with_openai_headers() -> None:
    async with running(tokens=3) as up:
        policy = policy_for({"p": [up.url]}, rate_limits={"requests_per_min": 3})
        env = {"TOKENLANE_API_KEYS": KEYS}
        async with running_gateway(policy, environ=env) as (url, app):
            async with httpx.AsyncClient(timeout=10) as client:
                a, b = bearer("sk-alpha-0123456789"), bearer("sk-beta-9876543210")
                statuses = [
                    (await client.post(url + "/v1/chat/completions", json=CHAT, headers=a))
                    for _ in range(4)
                ]
                other = await client.post(url + "/v1/chat/completions", json=CHAT, headers=b)
    assert [r.status_code for r in statuses] == [200, 200, 200, 429]
    refused = statuses[-1]
    h = refused.headers
    assert h["x-ratelimit-limit-requests"] == "3"
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"].endswith("s")
    assert 1 <= int(h["retry-after"]) <= 20  # one request comes back every 20 s
    err = refused.json()["error"]
    assert err["type"] == "RateLimitError" and err["code"] == 429
    assert other.status_code == 200  # another key has its own budget
    assert rejections(app, "all", "rate_limited") == 1


async def test_token_rate_limit_counts_prompt_and_output_tokens() -> None:
    async with running(tokens=3) as up:
        policy = policy_for({"p": [up.url]}, rate_limits={"tokens_per_min": 300})
        env = {"TOKENLANE_API_KEYS": KEYS}
        async with running_gateway(policy, environ=env) as (url, app):
            async with httpx.AsyncClient(timeout=10) as client:
                a = bearer("sk-alpha-0123456789")
                body = {**CHAT, "max_tokens": 120}  # ~10 prompt + 120 output tokens each
                codes = [
                    (await client.post(url + "/v1/chat/completions", json=body, headers=a))
                    for _ in range(3)
                ]
                huge = await client.post(
                    url + "/v1/chat/completions", json={**CHAT, "max_tokens": 400}, headers=a
                )
    assert [c.status_code for c in codes] == [200, 200, 429]
    assert codes[2].headers["x-ratelimit-limit-tokens"] == "300"
    assert int(codes[2].headers["x-ratelimit-remaining-tokens"]) < 130
    assert "x-ratelimit-limit-requests" not in codes[2].headers
    assert huge.status_code == 429 and "too large" in huge.json()["error"]["message"]
    assert rejections(app, "all", "rate_limited") == 2


async def test_rate_limits_are_off_without_client_keys() -> None:
    async with running(tokens=3) as up:
        policy = policy_for({"p": [up.url]}, rate_limits={"requests_per_min": 1})
        async with running_gateway(policy) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                codes = [
                    (await client.post(url + "/v1/chat/completions", json=CHAT)).status_code
                    for _ in range(3)
                ]
    assert codes == [200, 200, 200]


RATE_HEADERS = {
    f"x-ratelimit-{what}-{unit}"
    for what in ("limit", "remaining", "reset")
    for unit in ("requests", "tokens")
}


async def test_every_answer_to_a_limited_key_carries_its_rate_limit_headers() -> None:
    async with running(tokens=3) as up:
        limits = {"requests_per_min": 10, "tokens_per_min": 50_000}  # a request back every 6 s
        policy = policy_for({"p": [up.url]}, rate_limits=limits, health={"interval_s": 60})
        env = {"TOKENLANE_API_KEYS": KEYS}
        async with running_gateway(policy, environ=env) as (url, _):
            a = bearer("sk-alpha-0123456789")
            async with httpx.AsyncClient(base_url=url, headers=a, timeout=10) as client:
                answers = [
                    await client.post("/v1/chat/completions", json=CHAT),
                    await client.post("/v1/chat/completions", json={**CHAT, "stream": True}),
                    await client.post("/tokenize", json={"model": CHAT["model"], "prompt": "x"}),
                ]
                up.fail_status = 503  # every replica busy: the gateway's own 503
                answers.append(await client.post("/v1/chat/completions", json=CHAT))
                up.fail_status = None
                await up.stop()  # refused: the gateway's own 502
                answers.append(await client.post("/v1/chat/completions", json=CHAT))
    assert [r.status_code for r in answers] == [200, 200, 200, 503, 502]
    assert answers[1].headers["content-type"].startswith("text/event-stream")
    for r in answers:
        assert RATE_HEADERS <= set(r.headers), r.headers
        assert r.headers["x-ratelimit-limit-requests"] == "10"
        assert r.headers["x-ratelimit-limit-tokens"] == "50000"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    remaining = [int(r.headers["x-ratelimit-remaining-requests"]) for r in answers]
    assert remaining == [9, 8, 7, 6, 5]
    tokens = [int(r.headers["x-ratelimit-remaining-tokens"]) for r in answers]
    assert all(t < 50_000 for t in tokens)


@pytest.mark.parametrize(
    ("environ", "limits"),
    [({}, {"requests_per_min": 10}), ({"TOKENLANE_API_KEYS": KEYS}, {})],
    ids=["no-keys", "keys-without-limits"],
)
async def test_answers_carry_no_rate_limit_headers_without_limits(
    environ: dict[str, str], limits: dict[str, int]
) -> None:
    async with running(tokens=3) as up:
        policy = policy_for({"p": [up.url]}, rate_limits=limits)
        async with running_gateway(policy, environ=environ) as (url, _):
            a = bearer("sk-alpha-0123456789")
            async with httpx.AsyncClient(base_url=url, headers=a, timeout=10) as client:
                answers = [
                    await client.post("/v1/chat/completions", json=CHAT),
                    await client.post("/v1/chat/completions", json={**CHAT, "stream": True}),
                ]
    assert [r.status_code for r in answers] == [200, 200]
    for r in answers:
        assert not any(k.startswith("x-ratelimit-") for k in r.headers), r.headers


async def test_the_openai_sdk_sees_the_rate_limit_headers() -> None:
    import openai

    async with running(tokens=3) as up:
        policy = policy_for({"p": [up.url]}, rate_limits={"requests_per_min": 10})
        env = {"TOKENLANE_API_KEYS": KEYS}
        async with running_gateway(policy, environ=env) as (url, _):
            client = openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="sk-alpha-0123456789", max_retries=0
            )
            raw = await client.chat.completions.with_raw_response.create(
                model=CHAT["model"], messages=CHAT["messages"], max_tokens=2
            )
            await client.close()
    assert raw.headers["x-ratelimit-limit-requests"] == "10"
    assert raw.headers["x-ratelimit-remaining-requests"] == "9"
    assert raw.parse().choices[0].message.content


async def test_an_audio_upload_counts_no_tokens_but_a_json_body_does() -> None:
    # 40 KB of audio is no text: at 4 chars per token it would be 10,000 "tokens", over a
    # whole minute's limit, and refused as too large.
    async with running(tokens=3) as up:
        policy = policy_for({"p": [up.url]}, rate_limits={"tokens_per_min": 1000})
        env = {"TOKENLANE_API_KEYS": KEYS}
        async with running_gateway(policy, environ=env) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                a = bearer("sk-alpha-0123456789")
                audio = await client.post(
                    url + "/v1/audio/transcriptions",
                    headers=a,
                    data={"model": CHAT["model"]},
                    files={"file": ("a.wav", b"\x00" * 40_000, "audio/wav")},
                )
                text = await client.post(
                    url + "/v1/embeddings",
                    headers=a,
                    json={"model": CHAT["model"], "input": "x" * 8_000},
                )
                # vLLM reads these as JSON too: they count like one.
                others = [
                    await client.post(
                        url + "/v1/embeddings",
                        headers={**a, **({"content-type": ctype} if ctype else {})},
                        content=json.dumps({"model": CHAT["model"], "input": "x" * 8_000}),
                    )
                    for ctype in ("application/vnd.api+json", "Application/JSON; charset=utf-8", "")
                ]
    assert audio.status_code == 200
    assert audio.headers["x-ratelimit-remaining-tokens"] == "1000"
    assert text.status_code == 429 and "too large" in text.json()["error"]["message"]
    assert [r.status_code for r in others] == [429, 429, 429]
