"""Pass-through endpoints (docs/http.md, "Endpoints") over real sockets: a streamed transcription reaches the
client event by event, a multipart upload reaches the replica byte for byte, a whole answer
keeps its length, a client that leaves closes the upstream, and a body cut by the replica
reaches the client cut, never looking whole."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from loadtest.fake_upstream import MODEL, FakeUpstream, running

from .gateway import content_of, policy_for, running_gateway
from .waiting import wait_until

AUDIO = b"RIFF\x00\x01\x02\x03WAVEfmt \r\n--not-a-boundary\r\n" + bytes(range(256)) * 40
WHISPER = "openai/whisper-large-v3"


def transcription_form(**fields: str) -> dict[str, object]:
    """httpx arguments for a multipart transcription request, as the OpenAI SDK sends it."""
    return {"data": {"model": WHISPER, **fields}, "files": {"file": ("a.wav", AUDIO, "audio/wav")}}


async def test_a_streamed_transcription_arrives_before_upstream_sends_its_last() -> None:
    async with running(tokens=10, interval_s=0.1) as up:  # an event every 100 ms: ~1 s
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                before = up.stats.bytes_written
                written_at_first = None
                texts = []
                async with client.stream(
                    "POST", url + "/v1/audio/transcriptions", **transcription_form(stream="true")
                ) as resp:
                    assert resp.status_code == 200
                    assert resp.headers["content-type"].startswith("text/event-stream")
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            if written_at_first is None:
                                written_at_first = up.stats.bytes_written - before
                            texts.append(content_of(line))
                written = up.stats.bytes_written - before
    assert written_at_first is not None
    # Relayed whole, everything would arrive once upstream sent its last; relayed as it comes,
    # the first event arrives while most are still to be sent (counted in bytes, not in time,
    # which a paused machine stretches).
    assert written_at_first < written / 2, (written_at_first, written)
    assert "".join(texts) == "".join(f" tok{i}" for i in range(10))


async def test_a_multipart_upload_and_its_boundary_reach_the_replica_unchanged() -> None:
    async with running(tokens=4) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            request = httpx.Request(
                "POST", url + "/v1/audio/translations", **transcription_form(language="de")
            )
            sent = request.read()
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.send(request)
    assert resp.status_code == 200
    assert resp.json() == {"text": "tok0 tok1 tok2 tok3"}
    st = up.stats
    [(seen, raw, form)] = [
        (h, r, b)
        for t, h, r, b in zip(st.targets, st.headers, st.raw_bodies, st.bodies, strict=True)
        if t == "/v1/audio/translations"
    ]
    assert seen["content-type"] == request.headers["content-type"]  # boundary included
    assert raw == sent
    assert form["file"] == AUDIO and form["language"] == "de"


async def test_a_whole_passthrough_answer_keeps_its_content_length() -> None:
    async with running(tokens=4) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.post(
                    url + "/v1/embeddings", json={"model": MODEL, "input": "x"}
                )
    assert resp.status_code == 200
    assert int(resp.headers["content-length"]) == len(resp.content)
    assert "transfer-encoding" not in resp.headers


async def test_client_disconnect_mid_passthrough_closes_the_upstream_within_a_second() -> None:
    # A 30 s stream: closed within the bound below, it was the client's leaving that closed it.
    async with running(tokens=600, interval_s=0.05) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, app):
            async with httpx.AsyncClient(timeout=10) as client:
                async with client.stream(
                    "POST", url + "/v1/audio/transcriptions", **transcription_form(stream="true")
                ) as resp:
                    n = 0
                    async for line in resp.aiter_lines():
                        n += line.startswith("data: {")
                        if n >= 3:
                            break
                closed_at = time.monotonic()
            await wait_until(lambda: up.stats.disconnects, what="upstream hears the disconnect")
            assert up.stats.disconnects == 1
            # Nominally within milliseconds; the slack is for a paused machine.
            assert up.stats.disconnected_at[0] - closed_at < 5.0
            replica = next(app.gateway.fleet.replicas())
            await wait_until(lambda: replica.in_flight == 0, what="the replica's slot freed")
            assert replica.in_flight == 0


async def test_a_transcription_stream_cut_by_the_replica_ends_with_an_error_event() -> None:
    async with running(tokens=10, interval_s=0.02) as up:
        async with running_gateway(policy_for({"p": [up.url]}, health={"interval_s": 60})) as (
            url,
            _,
        ):
            up.cut_after = 3
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.post(
                    url + "/v1/audio/transcriptions", **transcription_form(stream="true")
                )
    assert resp.status_code == 200
    events = [e for e in resp.text.split("\n\n") if e.strip()]
    assert [content_of(e) for e in events[:3]] == [" tok0", " tok1", " tok2"]
    assert events[-1] == "data: [DONE]"
    assert set(json.loads(events[-2][len("data: ") :])["error"]) == {
        "message", "type", "param", "code",
    }  # fmt: skip


class _CutBodyUpstream(FakeUpstream):
    """A replica that starts a plain (not SSE) answer and closes the connection halfway."""

    chunked = False

    async def _respond(
        self, method: str, path: str, headers: dict[str, str], raw: bytes, w: asyncio.StreamWriter
    ) -> None:
        if path != "/v1/embeddings":
            return await super()._respond(method, path, headers, raw, w)
        part = b'{"object":"list","data":[{"embedding":[0.1,0.2,'
        if self.chunked:
            w.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(part), part)
            )
        else:
            w.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(part) * 2, part)
            )
        await w.drain()
        await asyncio.sleep(0.1)
        w.transport.abort()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_plain_passthrough_body_cut_by_the_replica_reaches_the_client_cut(
    chunked: bool,
) -> None:
    up = _CutBodyUpstream()
    up.chunked = chunked
    await up.start()
    try:
        async with running_gateway(policy_for({"p": [up.url]}, health={"interval_s": 60})) as (
            url,
            _,
        ):
            async with httpx.AsyncClient(timeout=10) as client:
                async with client.stream(
                    "POST", url + "/v1/embeddings", json={"model": MODEL, "input": "x"}
                ) as resp:
                    assert resp.status_code == 200
                    received = b""
                    # A JSON body cannot carry an error event: the client must see it incomplete
                    # (never as a whole body with something appended).
                    with pytest.raises(httpx.RemoteProtocolError):
                        async for part in resp.aiter_raw():
                            received += part
    finally:
        await up.stop()
    assert received == b'{"object":"list","data":[{"embedding":[0.1,0.2,'
