"""The simulator's realtime transcription WebSocket (``/v1/realtime``) over real sockets, with
the ``websockets`` client: vLLM's events (``tests/fixtures/vllm_realtime_session.jsonl``) key
for key, a transcription whose text is its deltas, vLLM's error events on an open socket, the
API key, a dead engine, and a client that leaves mid-transcription."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from loadtest.sim.server import ENGINE_DEAD_MESSAGE, run_sim

from .gateway import policy_for, running_gateway
from .servers import FAST_SIM
from .waiting import TIMEOUT_S, wait_until

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_realtime_session.jsonl"
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def _shape(obj: Any) -> Any:
    """The keys of a JSON value, recursively (fixture values are made up)."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    return None


def _fixture() -> list[dict[str, Any]]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines()]


def _vllm_shapes() -> dict[str, Any]:
    """The shape of each event type vLLM's server sends, from the fixture."""
    shapes: dict[str, Any] = {}
    for line in _fixture():
        if line["dir"] == "server":
            shape = _shape(line["event"])
            assert shapes.setdefault(line["event"]["type"], shape) == shape
    return shapes


def _audio(seconds: float, start: int = 0) -> str:
    """Base64 PCM16, 16 kHz mono: a 220 Hz tone."""
    n = int(16_000 * seconds)
    samples = [int(3000 * math.sin(2 * math.pi * 220 * (start + i) / 16_000)) for i in range(n)]
    return base64.b64encode(struct.pack(f"<{n}h", *samples)).decode()


async def _recv(ws: ClientConnection) -> dict[str, Any]:
    """The next event; the deadline is a backstop against a hang, not a claim about speed."""
    raw = await asyncio.wait_for(ws.recv(decode=True), TIMEOUT_S)
    assert isinstance(raw, str)
    event: dict[str, Any] = json.loads(raw)
    return event


async def _send(ws: ClientConnection, event: dict[str, Any]) -> None:
    await ws.send(json.dumps(event))


async def _utterance(ws: ClientConnection, chunks: int = 5) -> list[dict[str, Any]]:
    """One utterance as vLLM's example client sends it; the events up to the done (or error)."""
    await _send(ws, {"type": "input_audio_buffer.commit"})
    for k in range(chunks):
        await _send(ws, {"type": "input_audio_buffer.append", "audio": _audio(0.1, k * 1600)})
    await _send(ws, {"type": "input_audio_buffer.commit", "final": True})
    events: list[dict[str, Any]] = []
    while not events or events[-1]["type"] not in ("transcription.done", "error"):
        events.append(await _recv(ws))
    return events


@pytest.fixture
async def sim():
    async with run_sim(FAST_SIM, name="t") as s:
        yield s


def _url(sim: Any) -> str:
    return sim.url.replace("http://", "ws://", 1) + "/v1/realtime"


@pytest.fixture
async def ws(sim: Any) -> AsyncIterator[ClientConnection]:
    async with websockets.connect(_url(sim), open_timeout=TIMEOUT_S) as conn:
        yield conn


async def test_the_session_is_created_first_as_vllm_sends_it(ws: ClientConnection) -> None:
    created = await _recv(ws)
    assert _shape(created) == _vllm_shapes()["session.created"]
    assert created["type"] == "session.created"
    assert created["id"].startswith("sess-") and len(created["id"]) == 5 + 32
    assert isinstance(created["created"], int)


async def test_a_transcription_is_its_deltas_then_done_as_vllm_sends_them(
    sim: Any, ws: ClientConnection
) -> None:
    await _recv(ws)  # session.created
    await _send(ws, {"type": "session.update", "model": MODEL})  # no answer, as in vLLM
    events = await _utterance(ws)
    *deltas, done = events
    shapes = _vllm_shapes()
    assert deltas and all(e["type"] == "transcription.delta" for e in deltas), events
    assert done["type"] == "transcription.done", events
    for e in events:
        assert _shape(e) == shapes[e["type"]], e
    assert done["text"] == "".join(e["delta"] for e in deltas)
    assert done["text"].strip(), "some delta carries words"
    usage = done["usage"]
    # One token per 80 ms frame, each its own delta (most of them padding: "").
    assert usage["completion_tokens"] == len(deltas) >= 0.5 / 0.08
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] is None

    # The socket stays open for the next utterance; the same audio gives the same words.
    again = await _utterance(ws)
    assert again[-1]["type"] == "transcription.done"
    assert again[-1]["text"] == done["text"]
    assert sim.stats()["requests_by_path"] == {"/v1/realtime": 1}
    assert sim.stats()["completed"] == 2  # each utterance ran in the engine


async def test_an_unknown_model_gets_vllms_error_event(ws: ClientConnection) -> None:
    await _recv(ws)
    await _send(ws, {"type": "session.update", "model": "whisper-1"})
    error = await _recv(ws)
    assert _shape(error) == _vllm_shapes()["error"]
    assert error == {
        "type": "error",
        "error": "The model `whisper-1` does not exist.",
        "code": "model_not_found",
    }
    # Not validated: a commit is refused.
    await _send(ws, {"type": "input_audio_buffer.commit"})
    assert (await _recv(ws))["code"] == "model_not_validated"


async def test_invalid_json_gets_vllms_error_event_and_the_socket_stays_open(
    ws: ClientConnection,
) -> None:
    await _recv(ws)
    await ws.send('{"type": "session.update"')
    error = await _recv(ws)
    assert _shape(error) == _vllm_shapes()["error"]
    assert error == {"type": "error", "error": "Invalid JSON", "code": "invalid_json"}
    await _send(ws, {"type": "session.update", "model": MODEL})
    assert (await _utterance(ws, chunks=1))[-1]["type"] == "transcription.done"


@pytest.mark.parametrize(
    ("event", "code", "message"),
    [
        ({"type": "input_audio_buffer.clear"}, "unknown_event",
         "Unknown event type: input_audio_buffer.clear"),
        ({"model": MODEL}, "unknown_event", "Unknown event type: None"),
        ({"type": "session.update"}, "invalid_event", "Missing required field: model"),
        ({"type": "input_audio_buffer.commit", "final": True}, "model_not_validated",
         "Model not validated. Make sure to validate the model by sending a session.update event."),
        ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "invalid_audio",
         "Invalid audio data"),
        ({"type": "input_audio_buffer.append", "audio": "AA=="}, "invalid_audio",
         "Invalid audio data"),  # an odd number of bytes is no PCM16
        ({"type": "input_audio_buffer.append"}, "processing_error",
         "1 validation error for InputAudioBufferAppend\naudio\n  Field required"),
        ([], "processing_error", "'list' object has no attribute 'get'"),
    ],
)  # fmt: skip
async def test_a_bad_event_gets_vllms_error_event(
    ws: ClientConnection, event: Any, code: str, message: str
) -> None:
    await _recv(ws)
    await ws.send(json.dumps(event))
    error = await _recv(ws)
    assert _shape(error) == _vllm_shapes()["error"]
    assert error["type"] == "error" and error["code"] == code
    assert error["error"].startswith(message)


async def test_a_dead_engine_fails_the_transcription_with_a_processing_error(
    sim: Any, ws: ClientConnection
) -> None:
    await _recv(ws)
    await _send(ws, {"type": "session.update", "model": MODEL})
    await sim.set_fault({"fault": "engine_dead"})
    events = await _utterance(ws, chunks=1)
    assert events == [{"type": "error", "error": ENGINE_DEAD_MESSAGE, "code": "processing_error"}]


async def test_the_api_key_is_checked_before_the_upgrade() -> None:
    async with run_sim(FAST_SIM, name="k", api_key="sk-sim") as sim:
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(_url(sim), open_timeout=TIMEOUT_S):
                pass
        assert refused.value.response.status_code == 401
        assert json.loads(refused.value.response.body or b"") == {"error": "Unauthorized"}
        headers = {"Authorization": "Bearer sk-sim"}
        async with websockets.connect(
            _url(sim), additional_headers=headers, open_timeout=TIMEOUT_S
        ) as ws:
            assert (await _recv(ws))["type"] == "session.created"


async def test_a_client_that_leaves_ends_the_session_and_its_engine_request(sim: Any) -> None:
    # Slow steps: the transcription is still running when the client goes.
    await sim.set_fault({"fault": "slow", "factor": 50})
    async with websockets.connect(_url(sim), open_timeout=TIMEOUT_S) as ws:
        await _recv(ws)
        await _send(ws, {"type": "session.update", "model": MODEL})
        await _send(ws, {"type": "input_audio_buffer.commit"})
        await _send(ws, {"type": "input_audio_buffer.append", "audio": _audio(10.0)})
        await _send(ws, {"type": "input_audio_buffer.commit", "final": True})
        assert (await _recv(ws))["type"] == "transcription.delta"
    # The close handshake completed (no hang); the server aborted the request in the engine.
    await wait_until(lambda: sim.stats()["aborted"] == 1, what="the request aborted")
    assert sim.stats()["running"] == 0 and sim.stats()["waiting"] == 0
    assert sim.stats()["completed"] == 0


async def test_a_session_through_the_gateway_is_the_simulators_own(sim: Any) -> None:
    """The gateway's realtime relay in front of the simulator: the same events, both ways."""
    async with running_gateway(policy_for({"p": [sim.url]})) as (url, _):
        gw = url.replace("http://", "ws://", 1) + "/v1/realtime"
        async with websockets.connect(gw, open_timeout=TIMEOUT_S) as conn:
            assert (await _recv(conn))["type"] == "session.created"
            await _send(conn, {"type": "session.update", "model": MODEL})
            events = await _utterance(conn)
    done = events[-1]
    assert done["type"] == "transcription.done", events
    deltas = [e["delta"] for e in events if e["type"] == "transcription.delta"]
    assert deltas and done["text"] == "".join(deltas)
    assert _shape(done) == _vllm_shapes()["transcription.done"]
