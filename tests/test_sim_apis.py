"""The simulator's Anthropic Messages API and vLLM's other routes over real sockets: shapes of
``tests/fixtures/vllm_messages_*`` (the official ``anthropic`` SDK as one client), token counts
that agree with the generation, vLLM's errors, faults acting on a Messages stream as on chat,
and the pooling family, ``/invocations``, ``/tokenizer_info`` and the batch chat route."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from loadtest.sim.server import run_sim
from loadtest.sim.settings import SimSettings

from .waiting import wait_until

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
FAST = SimSettings(step_fixed_s=0.001, decode_per_seq_s=0.0, prefill_per_token_s=0.000001,
                   request_overhead_s=0.0)  # fmt: skip
HELLO = [{"role": "user", "content": "Say hello."}]


def _shape(obj: Any) -> Any:
    """The keys and JSON types of a value, recursively (fixture values are made up)."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(v) for v in obj[:1]]
    return type(obj).__name__ if obj is not None else None


def _sse(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event, checking vLLM's ``event:``/``data:`` framing."""
    assert raw.endswith("\n\n")
    events = []
    for block in raw[:-2].split("\n\n"):
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        name, payload = head[len("event: ") :], json.loads(data[len("data: ") :])
        assert payload["type"] == name
        events.append((name, payload))
    return events


def _collapse(names: list[str]) -> list[str]:
    """Event names with runs counted once (answers differ in length)."""
    return [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]


@pytest.fixture
async def sim():
    async with run_sim(FAST, name="t") as s:
        yield s


@pytest.fixture
async def client(sim):
    async with anthropic.AsyncAnthropic(base_url=sim.url, api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=30) as c:
        yield c


# -- Messages ---------------------------------------------------------------------------------


async def test_plain_message_has_the_fixture_shape(sim, client, http):
    fixture = json.loads((FIXTURES / "vllm_messages_nonstream.json").read_text())
    body = {"model": MODEL, "max_tokens": 64, "messages": HELLO}
    raw = await http.post(sim.url + "/v1/messages", json=body)
    assert raw.status_code == 200 and raw.headers["content-type"] == "application/json"
    data = raw.json()
    assert _shape(data) == _shape(fixture) and list(data) == list(fixture)
    assert data["id"].startswith("chatcmpl-") and data["stop_reason"] in ("end_turn", "max_tokens")

    message = await client.messages.create(model=MODEL, max_tokens=64, messages=HELLO)
    assert message.type == "message" and message.role == "assistant"
    assert (
        message.content[0].type == "text" and message.content[0].text == data["content"][0]["text"]
    )
    assert message.usage.input_tokens == data["usage"]["input_tokens"]
    logged = sim.requests(path="/v1/messages")
    assert len(logged) == 2 and logged[-1]["body"]["max_tokens"] == 64


async def test_stream_events_come_in_the_fixtures_order(sim, client, http):
    fixture = _sse((FIXTURES / "vllm_messages_stream.txt").read_text())
    body = {"model": MODEL, "max_tokens": 12, "messages": HELLO, "stream": True}
    async with http.stream("POST", sim.url + "/v1/messages", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
        raw = (await resp.aread()).decode()
    events = _sse(raw)
    assert _collapse([n for n, _ in events]) == _collapse([n for n, _ in fixture])
    assert "data: [DONE]" not in raw
    for (name, data), (_, expected) in zip(events[:2] + events[-3:], fixture[:2] + fixture[-3:],
                                           strict=True):  # fmt: skip
        assert _shape(data) == _shape(expected), name
    deltas = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "max_tokens"} and final["usage"]["output_tokens"] == 12

    # The SDK reads the same stream into the same message.
    async with client.messages.stream(model=MODEL, max_tokens=12, messages=HELLO) as stream:
        message = await stream.get_final_message()
    assert message.content[0].text == "".join(deltas) and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 12


async def test_usage_input_tokens_equal_count_tokens(client):
    body: dict[str, Any] = {
        "model": MODEL,
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
                {"type": "text", "text": "Summarise."},
            ]},
        ],
        "tools": [{"name": "weather", "description": "Weather by city",
                   "input_schema": {"properties": {"city": {"type": "string"}}}}],
    }  # fmt: skip
    counted = await client.messages.count_tokens(**body)
    message = await client.messages.create(max_tokens=5, **body)
    assert counted.input_tokens == message.usage.input_tokens > 50
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    bare = await client.messages.count_tokens(model=MODEL, messages=HELLO)
    assert bare.input_tokens < counted.input_tokens


async def test_count_tokens_has_the_fixture_shape(sim, http):
    fixture = json.loads((FIXTURES / "vllm_messages_count_tokens.json").read_text())
    resp = await http.post(sim.url + "/v1/messages/count_tokens",
                           json={"model": MODEL, "messages": HELLO})  # fmt: skip
    assert resp.status_code == 200 and _shape(resp.json()) == _shape(fixture)
    n = resp.json()["input_tokens"]
    assert resp.json()["context_management"] == {"original_input_tokens": n}


async def test_errors_come_in_vllms_shapes(sim, client, http):
    validation = json.loads((FIXTURES / "vllm_messages_error_400_validation.json").read_text())
    resp = await http.post(sim.url + "/v1/messages", json={"model": MODEL, "messages": HELLO})
    assert resp.status_code == 400 and _shape(resp.json()) == _shape(validation)
    assert resp.json()["error"]["param"] == validation["error"]["param"]
    resp = await http.post(sim.url + "/v1/messages", content=b"{not json",
                           headers={"content-type": "application/json"})  # fmt: skip
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "Bad Request"

    translated = json.loads((FIXTURES / "vllm_messages_error_400.json").read_text())
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model=MODEL, max_tokens=40_000, messages=HELLO, timeout=30)
    assert _shape(info.value.body) == _shape(translated)
    assert "maximum context length" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="nope", max_tokens=5, messages=HELLO)
    assert missing.value.body == {"type": "error", "error": {
        "type": "NotFoundError", "message": "The model `nope` does not exist."}}  # fmt: skip


async def test_a_stall_leaves_a_messages_stream_silent_until_lifted(sim, client, http):
    await sim.set_fault({"fault": "stall", "after_tokens": 3})
    kinds: list[str] = []

    async def read() -> None:
        stream = await client.messages.create(model=MODEL, max_tokens=20, messages=HELLO,
                                              stream=True)  # fmt: skip
        async for event in stream:
            kinds.append(event.type)

    reader = asyncio.create_task(read())
    await wait_until(lambda: kinds.count("content_block_delta") == 3 and sim.engine.stalled,
                     what="3 deltas, then the engine frozen")  # fmt: skip
    seen = len(kinds)
    assert (await http.get(sim.url + "/v1/models")).status_code == 200
    (frozen,) = list(sim.engine.scheduler.running)
    assert frozen.num_output == 3 and len(kinds) == seen and not reader.done()
    await sim.set_fault(None)
    await asyncio.wait_for(reader, 30)
    assert kinds.count("content_block_delta") == 20 and kinds[-1] == "message_stop"


@pytest.mark.parametrize("fault", ["cut_error", "cut_close", "cut_abort"])
async def test_cuts_act_on_a_messages_stream(sim, http, fault):
    await sim.set_fault({"fault": fault, "after_tokens": 2})
    body = {"model": MODEL, "max_tokens": 10, "messages": HELLO, "stream": True}
    resp = await http.post(sim.url + "/v1/messages", json=body)
    events = _sse(resp.text)
    names = [n for n, _ in events]
    assert names.count("content_block_delta") <= 2 and names[0] == "message_start"
    if fault == "cut_error":  # the chat error event fails vLLM's converter: internal_error
        assert names[-1] == "error" and events[-1][1]["error"]["type"] == "internal_error"
        assert "validation errors for ChatCompletionStreamResponse" in resp.text
    elif fault == "cut_close":
        assert "message_stop" not in names and "message_delta" not in names
    else:  # aborted in the engine: vLLM's finish_reason "abort" has no stop_reason
        assert names[-2:] == ["message_delta", "message_stop"]
        assert events[-2][1]["delta"] == {"stop_reason": None}
        assert events[-2][1]["usage"]["output_tokens"] == 2


# -- the other routes -------------------------------------------------------------------------


async def _post(http: httpx.AsyncClient, sim: Any, path: str, body: Any) -> Any:
    resp = await http.post(sim.url + path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _envelope(data: dict[str, Any], prefix: str) -> None:
    assert data["id"].startswith(prefix + "-") and data["object"] == "list"
    assert data["model"] == MODEL and isinstance(data["created"], int)
    u = data["usage"]
    assert u["completion_tokens"] == 0 and u["total_tokens"] == u["prompt_tokens"] > 0


async def test_embeddings_are_deterministic_unit_vectors(sim, http):
    data = await _post(http, sim, "/v1/embeddings", {"model": MODEL, "input": ["a cat", "a dog"]})
    _envelope(data, "embd")
    first, second = (d["embedding"] for d in data["data"])
    assert [d["object"] for d in data["data"]] == ["embedding", "embedding"]
    assert len(first) == 16 and abs(sum(x * x for x in first) - 1) < 1e-4 and first != second
    again = await _post(http, sim, "/v1/embeddings", {"input": "a cat", "dimensions": 8})
    assert len(again["data"][0]["embedding"]) == 8
    b64 = await _post(http, sim, "/v1/embeddings", {"input": "a cat", "encoding_format": "base64"})
    assert isinstance(b64["data"][0]["embedding"], str)
    same = await _post(http, sim, "/v1/embeddings", {"input": ["a cat"]})
    assert same["data"][0]["embedding"] == first


async def test_pooling_classify_and_cohere_embed(sim, http):
    pooled = await _post(http, sim, "/pooling", {"input": "hello"})
    _envelope(pooled, "pool")
    assert pooled["data"][0]["object"] == "pooling" and len(pooled["data"][0]["data"]) == 16
    classified = await _post(http, sim, "/classify", {"input": ["good", "bad"]})
    _envelope(classified, "classify")
    item = classified["data"][0]
    assert set(item) == {"index", "label", "probs", "num_classes"} and item["num_classes"] == 2
    assert abs(sum(item["probs"]) - 1) < 1e-4 and item["label"] in ("LABEL_0", "LABEL_1")
    cohere = await _post(http, sim, "/v2/embed", {"model": MODEL, "texts": ["hi"],
                                                  "embedding_types": ["float", "ubinary"]})  # fmt: skip
    assert cohere["id"].startswith("embd-") and cohere["texts"] == ["hi"]
    assert set(cohere["embeddings"]) == {"float", "ubinary"}
    assert cohere["meta"] == {"api_version": {"version": "2"}, "tokens": {"input_tokens": 1}}


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
async def test_score(sim, http, path):
    data = await _post(http, sim, path, {"model": MODEL, "queries": "the red fox",
                                         "documents": ["the red fox", "a blue whale"]})  # fmt: skip
    _envelope(data, "score")
    scores = [d["score"] for d in data["data"]]
    assert [d["object"] for d in data["data"]] == ["score", "score"] and scores[0] > scores[1]
    pairs = await _post(http, sim, path, {"text_1": ["a", "b"], "text_2": ["c", "d"]})
    assert len(pairs["data"]) == 2
    resp = await http.post(sim.url + path, json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert resp.status_code == 400


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
async def test_rerank(sim, http, path):
    docs = ["a blue whale", "the red fox", "red"]
    data = await _post(http, sim, path, {"model": MODEL, "query": "the red fox",
                                         "documents": docs, "top_n": 2})  # fmt: skip
    assert data["id"].startswith("score-") and data["model"] == MODEL
    assert data["usage"]["prompt_tokens"] == data["usage"]["total_tokens"] > 0
    results = data["results"]
    assert len(results) == 2 and results[0]["index"] == 1
    assert results[0]["document"] == {"text": "the red fox", "multi_modal": None}
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]


async def test_invocations_dispatch_by_body(sim, http):
    chat = await _post(http, sim, "/invocations", {"messages": HELLO, "max_tokens": 3})
    assert chat["object"] == "chat.completion"
    completion = await _post(http, sim, "/invocations", {"prompt": "Once", "max_tokens": 3})
    assert completion["object"] == "text_completion"
    embedded = await _post(http, sim, "/invocations", {"input": "x"})
    assert embedded["data"][0]["object"] == "embedding"
    reranked = await _post(http, sim, "/invocations", {"query": "x", "documents": ["x"]})
    assert "results" in reranked
    resp = await http.post(sim.url + "/invocations", json={"nothing": 1})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("Cannot find suitable handler for request.")


async def test_tokenizer_info(sim, http):
    resp = await http.get(sim.url + "/tokenizer_info")
    assert resp.status_code == 200
    info = resp.json()
    assert info["tokenizer_class"].endswith("Qwen2TokenizerFast")
    assert info["eos_token"] == "<|im_end|>"


async def test_batch_chat_answers_one_choice_per_conversation(sim, http):
    body = {"model": MODEL, "max_tokens": 4,
            "messages": [HELLO, [{"role": "user", "content": "Count to three."}]]}  # fmt: skip
    data = await _post(http, sim, "/v1/chat/completions/batch", body)
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    assert data["usage"]["completion_tokens"] == 8
    resp = await http.post(sim.url + "/v1/chat/completions/batch", json={**body, "stream": True})
    assert resp.status_code == 400
