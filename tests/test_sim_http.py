"""The simulator over real sockets: vLLM's formats, errors and the observability endpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.sim.server import run_sim
from loadtest.sim.settings import SimSettings

from .servers import FAST_SIM
from .waiting import wait_until

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}


def _fixture_events(name: str) -> list[Any]:
    text = (FIXTURES / name).read_text()
    return [_event(block) for block in text.split("\n\n") if block.strip()]


def _event(block: str) -> Any:
    assert block.startswith("data: "), block
    data = block[len("data: ") :]
    return data if data == "[DONE]" else json.loads(data)


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[httpx.Response, list]:
    async with client.stream("POST", url, json=body) as resp:
        raw = (await resp.aread()).decode()
    assert raw.endswith("\n\n")
    return resp, [_event(b) for b in raw.split("\n\n") if b]


def _shape(obj: Any) -> Any:
    """The keys of a JSON value, recursively (values are made up in fixtures)."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(v) for v in obj[:1]]
    return None


@pytest.fixture
async def sim():
    async with run_sim(FAST_SIM, name="t") as s:
        yield s


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=10) as c:
        yield c


async def test_chat_stream_has_the_fixture_events_and_shapes(sim, client):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    resp, events = await _stream(client, sim.url + "/v1/chat/completions", body)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    fixture = _fixture_events("vllm_chat_stream.txt")
    assert events[-1] == "[DONE]"
    role, first, *tokens, finish, usage_chunk, _ = events
    f_role, f_first, *_, f_finish, f_usage, _ = fixture
    assert _shape(role) == _shape(f_role)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert _shape(first) == _shape(f_first)
    assert all(_shape(t) == _shape(f_first) for t in tokens)
    assert set(finish["choices"][0]) == set(f_finish["choices"][0])
    assert finish["choices"][0]["finish_reason"] == "length"
    assert _shape(usage_chunk) == _shape(f_usage) and usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 8 == len(tokens) + 2
    ids = {e["id"] for e in events[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")


async def test_chat_stream_without_usage_option_ends_with_fingerprint_and_no_usage(sim, client):
    _, events = await _stream(client, sim.url + "/v1/chat/completions", {**CHAT, "stream": True})
    finish = events[-2]
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["system_fingerprint"].startswith("vllm-")
    assert not any("usage" in e for e in events[:-1])
    assert len(events) == 1 + 8 + 1  # role, 8 tokens (the last one finishes), [DONE]


async def test_chat_plain_response_has_fixture_fields_and_usage(sim, client):
    resp = await client.post(sim.url + "/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    fixture = json.loads((FIXTURES / "vllm_chat_nonstream.json").read_text())
    data = resp.json()
    assert _shape(data) == _shape(fixture)
    assert data["usage"]["completion_tokens"] == 8
    count = (await client.post(sim.url + "/tokenize", json={"messages": CHAT["messages"]})).json()
    assert data["usage"]["prompt_tokens"] == count["count"]


async def test_completion_stream_and_plain_answers_agree(sim, client):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5}
    plain = (await client.post(sim.url + "/v1/completions", json=body)).json()
    assert plain["object"] == "text_completion" and plain["id"].startswith("cmpl-")
    assert set(plain["choices"][0]) >= {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    _, events = await _stream(client, sim.url + "/v1/completions", {**body, "stream": True})
    chunks = events[:-1]
    assert len(chunks) == 5 and all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_completion_takes_token_id_prompts_and_counts_them(sim, client):
    body = {"prompt": list(range(100, 140)), "max_tokens": 3}
    data = (await client.post(sim.url + "/v1/completions", json=body)).json()
    assert data["usage"] == {"prompt_tokens": 40, "total_tokens": 43, "completion_tokens": 3,
                             "prompt_tokens_details": None}  # fmt: skip
    batch = {"prompt": ["first prompt", "second one"], "max_tokens": 2, "n": 2}
    data = (await client.post(sim.url + "/v1/completions", json=batch)).json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert data["usage"]["completion_tokens"] == 8


async def test_n_choices_stream_with_their_own_indexes(sim, client):
    body = {**CHAT, "n": 3, "stream": True, "max_tokens": 4}
    _, events = await _stream(client, sim.url + "/v1/chat/completions", body)
    roles = [e for e in events[:-1] if "role" in e["choices"][0]["delta"]]
    assert sorted(e["choices"][0]["index"] for e in roles) == [0, 1, 2]
    finishes = [e for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert sorted(e["choices"][0]["index"] for e in finishes) == [0, 1, 2]


async def test_stop_string_ends_the_answer_with_its_stop_reason(sim, client):
    full = (await client.post(sim.url + "/v1/chat/completions",
                              json={**CHAT, "max_tokens": 60})).json()  # fmt: skip
    text = full["choices"][0]["message"]["content"]
    stop = text.split()[5]
    data = (await client.post(sim.url + "/v1/chat/completions",
                              json={**CHAT, "max_tokens": 60, "stop": [stop]})).json()  # fmt: skip
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["message"]["content"] == text[: text.index(stop)]


async def test_no_max_tokens_answer_ends_naturally_and_deterministically(sim, client):
    body = {"messages": CHAT["messages"]}
    a = (await client.post(sim.url + "/v1/chat/completions", json=body)).json()
    b = (await client.post(sim.url + "/v1/chat/completions", json=body)).json()
    assert a["choices"][0]["finish_reason"] == "stop"
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    s = SimSettings()
    assert s.natural_len_min <= a["usage"]["completion_tokens"] <= s.natural_len_max


async def test_x_request_id_names_the_completion(sim, client):
    resp = await client.post(sim.url + "/v1/chat/completions", json=CHAT,
                             headers={"X-Request-Id": "abc123"})  # fmt: skip
    assert resp.json()["id"] == "chatcmpl-abc123"


@pytest.mark.parametrize(
    ("body", "status", "err_type", "param", "text"),
    [
        ({"model": MODEL}, 400, "Bad Request", "body.messages", "Field required"),
        ({**CHAT, "max_tokens": "many"}, 400, "Bad Request", "body.max_tokens", "valid integer"),
        ({**CHAT, "max_tokens": 0}, 400, "BadRequestError", "max_tokens", "at least 1"),
        ({**CHAT, "max_tokens": 40000}, 400, "BadRequestError", "input_tokens",
         "maximum context length"),
        ({**CHAT, "priority": 3}, 400, "BadRequestError", "priority", "not enabled"),
        ({**CHAT, "stream_options": {"include_usage": True}}, 400, "BadRequestError",
         "stream_options", "stream=True"),
    ],
)  # fmt: skip
async def test_bad_requests_get_vllm_error_bodies(sim, client, body, status, err_type, param, text):
    resp = await client.post(sim.url + "/v1/chat/completions", json=body)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (err_type, param, status)
    assert text in error["message"]


async def test_unknown_model_gets_the_fixture_404(sim, client):
    resp = await client.post(sim.url + "/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
    assert resp.status_code == 404
    assert resp.json() == json.loads((FIXTURES / "vllm_error_404_model.json").read_text())


async def test_context_length_error_matches_the_fixture_wording(client):
    async with run_sim(FAST_SIM.replace(max_model_len=1024)) as s:
        resp = await client.post(s.url + "/v1/completions",
                                 json={"prompt": list(range(1000)), "max_tokens": 256})  # fmt: skip
    fixture = json.loads((FIXTURES / "vllm_error_400.json").read_text())["error"]
    error = resp.json()["error"]
    pattern = re.sub(r"\d+", r"\\d+", re.escape(fixture["message"]))
    assert resp.status_code == 400 and re.fullmatch(pattern, error["message"])
    assert (error["type"], error["param"]) == (fixture["type"], fixture["param"])


async def test_api_key_guards_v1_only_with_vllms_401(client):
    async with run_sim(FAST_SIM, api_key="sekret") as s:
        denied = await client.post(s.url + "/v1/chat/completions", json=CHAT)
        wrong = await client.get(s.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        ok = await client.post(s.url + "/v1/chat/completions", json=CHAT,
                               headers={"Authorization": "Bearer sekret"})  # fmt: skip
        health = await client.get(s.url + "/health")
    assert denied.status_code == wrong.status_code == 401
    assert denied.json() == {"error": "Unauthorized"}
    assert ok.status_code == 200 and health.status_code == 200


async def test_models_health_ping_and_tokenize_answer_like_vllm(client):
    async with run_sim(FAST_SIM, model=["a/one", "b/two"]) as s:
        models = (await client.get(s.url + "/v1/models")).json()
        health = await client.get(s.url + "/health")
        ping = await client.post(s.url + "/ping")
        tok = (await client.post(s.url + "/tokenize", json={"prompt": "Hello world"})).json()
        other = await client.post(s.url + "/v1/chat/completions", json={**CHAT, "model": "b/two"})
        missing = await client.get(s.url + "/nope")
    fixture = json.loads((FIXTURES / "vllm_models.json").read_text())
    assert _shape(models) == _shape(fixture)
    assert [m["id"] for m in models["data"]] == ["a/one", "b/two"]
    assert models["data"][0]["max_model_len"] == 32768
    assert (health.status_code, health.content, ping.status_code) == (200, b"", 200)
    assert tok == {"count": 2, "max_model_len": 32768, "tokens": tok["tokens"], "token_strs": None}
    assert other.json()["model"] == "b/two"
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}


def _metric_families(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (vllm:\S+) (\w+)$", text, flags=re.M))


def _buckets(text: str, name: str) -> list[str]:
    return re.findall(rf'^{re.escape(name)}_bucket{{[^}}]*le="([^"]+)"', text, flags=re.M)


async def test_metrics_have_vllm_v1_names_types_labels_and_buckets(sim, client):
    await client.post(sim.url + "/v1/chat/completions", json=CHAT)
    resp = await client.get(sim.url + "/metrics")
    text = resp.text
    assert resp.headers["content-type"].startswith("text/plain; version=")
    fixture = (FIXTURES / "vllm_metrics_v1.txt").read_text()
    ours, theirs = _metric_families(text), _metric_families(fixture)
    needed = [
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:request_success_total", "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:num_preemptions_total",
    ]  # fmt: skip
    for name in needed:
        assert ours[name] == theirs[name], name
    for name, kind in ours.items():
        assert theirs.get(name) == kind, name  # nothing vLLM would not export
        if kind == "histogram":
            assert _buckets(text, name) == _buckets(fixture, name), name
    label = f'{{engine="0",model_name="{MODEL}"}}'
    assert f"vllm:generation_tokens_total{label} 8.0" in text
    success = f'engine="0",finished_reason="length",model_name="{MODEL}"'
    assert f"vllm:request_success_total{{{success}}} 1.0" in text


async def test_repeated_prefix_raises_the_prefix_cache_hit_counter(sim, client):
    shared = " ".join(["shared system prompt words"] * 100)
    for question in ("first question?", "second question?"):
        body = {"messages": [{"role": "system", "content": shared},
                             {"role": "user", "content": question}], "max_tokens": 2}  # fmt: skip
        assert (await client.post(sim.url + "/v1/chat/completions", json=body)).status_code == 200
    text = (await client.get(sim.url + "/metrics")).text
    hits = float(re.search(r"^vllm:prefix_cache_hits_total\S* (\S+)$", text, re.M).group(1))
    assert hits >= 16 * 20  # the shared system prompt's full blocks


async def test_request_log_keeps_headers_and_parsed_bodies(sim, client):
    await client.post(sim.url + "/v1/chat/completions", json=CHAT,
                      headers={"X-Request-Id": "r-1", "Authorization": "Bearer k"})  # fmt: skip
    await client.get(sim.url + "/health")
    log = (await client.get(sim.url + "/sim/requests?path=/v1/chat/completions")).json()
    [entry] = log["requests"]
    assert entry["body"] == CHAT and entry["path"] == "/v1/chat/completions"
    assert entry["headers"]["x-request-id"] == "r-1"
    assert entry["headers"]["authorization"] == "Bearer k"
    assert isinstance(entry["arrived_at"], float)
    stats = (await client.get(sim.url + "/sim/stats")).json()
    assert stats["requests_received"] == 2 and stats["completed"] == 1
    assert stats["requests_by_path"] == {"/v1/chat/completions": 1, "/health": 1}
    await client.delete(sim.url + "/sim/requests")
    assert (await client.get(sim.url + "/sim/requests")).json() == {"requests": []}


async def test_client_disconnect_aborts_the_request_in_the_engine(client):
    async with run_sim(FAST_SIM.replace(step_fixed_s=0.01)) as s:
        body = {**CHAT, "max_tokens": 5000, "stream": True}
        async with client.stream("POST", s.url + "/v1/chat/completions", json=body) as resp:
            async for _ in resp.aiter_bytes():
                break  # the first token arrived: the request is running
            assert s.engine.num_running == 1
        await wait_until(
            lambda: s.stats()["disconnects"] == 1 and s.engine.num_running == 0,
            what="the simulator hears the disconnect and aborts",
        )
        stats = s.stats()
        text = (await client.get(s.url + "/metrics")).text
    assert stats["disconnects"] == 1 and stats["running"] == 0 and stats["aborted"] == 1
    assert s.engine.scheduler.pool.in_use == 0
    assert re.search(r'finished_reason="abort"[^\n]* 1\.0', text)


async def test_continuous_usage_rides_on_every_chunk(sim, client):
    body = {**CHAT, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    _, events = await _stream(client, sim.url + "/v1/chat/completions", body)
    completions = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert completions == [0, 1, 2, 3, 3]  # role, three tokens, the final usage chunk


async def test_completion_echo_returns_the_prompt_first(sim, client):
    body = {"prompt": "Say it again", "max_tokens": 2, "echo": True}
    data = (await client.post(sim.url + "/v1/completions", json=body)).json()
    assert data["choices"][0]["text"].startswith("Say it again")
    assert data["usage"]["completion_tokens"] == 2


async def test_build_app_serves_on_any_server_but_refuses_socket_faults(client):
    from loadtest.sim.server import build_app
    from tests.servers import serve_app

    sim, app = build_app(FAST_SIM)
    async with serve_app(app) as url:
        ok = await client.post(url + "/v1/chat/completions", json=CHAT)
        refuse = await client.post(url + "/sim/fault", json={"fault": "refuse", "duration_s": 1})
        slow = await client.post(url + "/sim/fault", json={"fault": "slow", "factor": 2})
    assert ok.status_code == 200 and sim.stats()["completed"] == 1
    assert refuse.status_code == 400 and "socket" in refuse.json()["error"]["message"]
    assert slow.status_code == 200
