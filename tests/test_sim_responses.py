"""The simulator's ``/v1/responses`` over real sockets, with the official ``openai`` SDK as the
client: vLLM's shapes (``tests/fixtures/vllm_responses_*``), the store, background runs,
cancel, errors, and a fault acting on a Responses stream as on chat."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtest.sim.responses_api import ResponseStore, Stored
from loadtest.sim.server import run_sim

from .servers import FAST_SIM
from .waiting import wait_until

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def _shape(obj: Any) -> Any:
    """The keys of a JSON value, recursively (values are made up in fixtures)."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(v) for v in obj[:1]]
    return None


def _sse(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """(event line, data) of each SSE event, checking the framing vLLM's api_router writes."""
    events = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        events.append((head[len("event: ") :], json.loads(data[len("data: ") :])))
    return events


def _collapse(kinds: list[str]) -> list[str]:
    """Event types with runs of text deltas counted once (answers differ in length)."""
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]


@pytest.fixture
async def sim():
    async with run_sim(FAST_SIM, name="t") as s:
        yield s


@pytest.fixture
async def client(sim):
    async with openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=10) as c:
        yield c


async def test_plain_response_has_the_fixture_fields(sim, client, http):
    resp = await client.responses.create(model=MODEL, input="Say hello in five words.")
    assert resp.status == "completed" and resp.object == "response"
    assert resp.id.startswith("resp_") and resp.output[0].id.startswith("msg_")
    assert resp.output_text and resp.output[0].content[0].type == "output_text"
    u = resp.usage
    assert u.input_tokens == 39 and u.total_tokens == u.input_tokens + u.output_tokens
    raw = (await http.get(f"{sim.url}/v1/responses/{resp.id}")).json()  # stored by default
    fixture = json.loads((FIXTURES / "vllm_responses_nonstream.json").read_text())
    assert _shape(raw) == _shape(fixture)
    assert raw["max_output_tokens"] == fixture["max_output_tokens"]  # the context's rest
    entry = sim.requests(path="/v1/responses")[-1]
    assert entry["body"]["input"] == "Say hello in five words."


async def test_stream_sends_the_fixture_events_in_order(sim, client, http):
    fixture = _sse((FIXTURES / "vllm_responses_stream.txt").read_text())
    body = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 4, "stream": True}
    async with http.stream("POST", sim.url + "/v1/responses", json=body) as resp:
        raw = (await resp.aread()).decode()
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    ours = _sse(raw)
    assert [k for k, _ in ours] == [d["type"] for _, d in ours]  # event line names the type
    assert [d["sequence_number"] for _, d in ours] == list(range(len(ours)))
    assert _collapse([k for k, _ in ours]) == _collapse([k for k, _ in fixture])
    ends = zip(ours[:4] + ours[-4:], fixture[:4] + fixture[-4:], strict=True)
    for (_, mine), (_, theirs) in ends:
        assert _shape(mine) == _shape(theirs), mine["type"]
    completed = ours[-1][1]["response"]
    assert completed["status"] == "incomplete" and completed["usage"]["output_tokens"] == 4
    assert "[DONE]" not in raw
    # The SDK reads the same stream.
    stream = await client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4,
                                           stream=True)  # fmt: skip
    kinds = [event.type async for event in stream]
    assert _collapse(kinds) == _collapse([k for k, _ in fixture])


async def test_previous_response_id_continues_the_conversation(sim, client):
    first = await client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8)
    second = await client.responses.create(
        model=MODEL, input="And another one?", previous_response_id=first.id, max_output_tokens=8
    )
    assert second.previous_response_id == first.id
    # The earlier prompt and answer come first, so the new prompt is longer and its head is in
    # the prefix cache.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16


async def test_get_returns_the_stored_response(client):
    made = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=5)
    got = await client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()


async def test_background_runs_then_get_shows_it_completed(client):
    made = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=6,
                                         background=True)  # fmt: skip
    assert made.status == "queued" and made.output == [] and made.usage is None

    async def status() -> str:
        return (await client.responses.retrieve(made.id)).status

    await wait_until(lambda: _is(status, "incomplete"), what="background response done")
    done = await client.responses.retrieve(made.id)
    assert done.usage is not None and done.usage.output_tokens == 6 and done.output_text


async def _is(status, wanted: str) -> bool:
    return await status() == wanted


async def test_cancel_stops_a_background_run_and_refuses_a_finished_one(sim, client):
    await sim.set_fault({"fault": "stall"})  # the run can start but never finish
    made = await client.responses.create(model=MODEL, input="Hi", background=True)
    cancelled = await client.responses.cancel(made.id)
    assert cancelled.status == "cancelled"
    assert (await client.responses.retrieve(made.id)).status == "cancelled"
    await sim.set_fault(None)
    await wait_until(lambda: sim.engine.num_running + sim.engine.num_waiting == 0,
                     what="the cancelled run left the engine")  # fmt: skip
    assert (await client.responses.retrieve(made.id)).status == "cancelled"

    done = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.cancel(done.id)
    assert info.value.body == {"message": "Cannot cancel a synchronous response.",
                               "type": "invalid_request_error", "param": "response_id",
                               "code": 400}  # fmt: skip


@pytest.mark.parametrize("how", ["get", "cancel", "previous"])
async def test_unknown_ids_get_vllms_404(sim, http, how):
    fixture = json.loads((FIXTURES / "vllm_responses_error_404.json").read_text())
    rid = "resp_0123456789abcdef0123456789abcdef"
    if how == "get":
        resp = await http.get(f"{sim.url}/v1/responses/{rid}")
    elif how == "cancel":
        resp = await http.post(f"{sim.url}/v1/responses/{rid}/cancel")
    else:
        body = {"model": MODEL, "input": "Hi", "previous_response_id": rid}
        resp = await http.post(f"{sim.url}/v1/responses", json=body)
    assert resp.status_code == 404 and resp.json() == fixture


async def test_sdk_raises_not_found_for_an_unknown_id(client):
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_missing")


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ({"model": MODEL}, "body.input", "Field required"),
        ({"model": MODEL, "input": 7}, "body.input", "valid string"),
        ({"model": MODEL, "input": "x", "background": True, "store": False}, "body", "background"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_tokens", "at least 1"),
    ],
)
async def test_bad_bodies_get_vllms_400(sim, http, body, param, text):
    resp = await http.post(sim.url + "/v1/responses", json=body)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["code"] == 400
    assert error["param"] == param and text in error["message"]


async def test_unstored_responses_are_not_kept(sim, client, http):
    made = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    assert (await http.get(f"{sim.url}/v1/responses/{made.id}")).status_code == 404


async def test_stall_leaves_a_responses_stream_silent_until_lifted(sim, client, http):
    await sim.set_fault({"fault": "stall", "after_tokens": 3})
    events: list[str] = []

    async def read() -> None:
        stream = await client.responses.create(model=MODEL, input="Tell me a story.",
                                               max_output_tokens=20, stream=True)  # fmt: skip
        async for event in stream:
            events.append(event.type)

    reader = asyncio.create_task(read())
    await wait_until(lambda: events.count("response.output_text.delta") == 3 and sim.engine.stalled,
                     what="3 deltas, then the engine frozen")  # fmt: skip
    seen = len(events)
    # The server still answers, and the frozen request has made no progress.
    assert (await http.get(sim.url + "/v1/models")).status_code == 200
    (frozen,) = [r for r in sim.engine.scheduler.running]
    assert frozen.num_output == 3 and len(events) == seen and not reader.done()
    await sim.set_fault(None)
    await asyncio.wait_for(reader, 30)
    assert events.count("response.output_text.delta") == 20 and events[-1] == "response.completed"


def test_the_store_keeps_the_newest_responses():
    store = ResponseStore(size=2)
    for i in range(3):
        store.put(f"r{i}", Stored({"status": "completed", "output": []}, []))
    assert len(store) == 2 and store.get("r0") is None and store.get("r2") is not None


@pytest.mark.parametrize(("fault", "dropped"), [("cut_close", False), ("cut_error", True)])
async def test_cut_faults_end_a_responses_stream_after_k_tokens(sim, http, fault, dropped):
    await sim.set_fault({"fault": fault, "after_tokens": 3})
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 20, "stream": True}
    raw, error = "", None
    try:
        async with http.stream("POST", sim.url + "/v1/responses", json=body) as resp:
            async for text in resp.aiter_text():
                raw += text
    except httpx.RemoteProtocolError as exc:  # vLLM's Responses stream drops on an error
        error = exc
    kinds = [k for k, _ in _sse(raw)]
    assert kinds.count("response.output_text.delta") == 3 and "response.completed" not in kinds
    assert (error is not None) == dropped
