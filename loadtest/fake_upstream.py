"""A minimal, fast fake vLLM for relay tests and the overhead benchmark.

The simulator (``loadtest/sim``) models an engine; this one models only the wire, as cheaply as
possible, so that a benchmark measures the gateway and not its upstream: raw asyncio, HTTP/1.1
keep-alive, vLLM's chunk format (``tests/fixtures/vllm_chat_stream.txt``). Two modes:

- burst: the whole stream of ``tokens`` chunks in one write;
- paced: one write per token, ``interval_s`` apart, each held back as ``drain()`` holds a
  writer, so a slow reader holds the writer back (backpressure is visible in ``stats``).

It records what it received (headers, bodies) and every connection that closed mid-response.
Faults for relay tests: ``fail_status`` (answer every request with that status),
``first_token_delay_s`` (send the role chunk, then wait), ``garbage`` (answer with something
that is not HTTP), ``cut_after`` (close the connection after that many content chunks),
``close_after_request`` (read the whole request, then close the connection without a word:
``"close"`` with a FIN, ``"reset"`` with a RST). A request may set its own pacing with the
extra body fields ``fake_interval_ms`` and ``fake_token_bytes`` (the gateway forwards unknown
fields unchanged).

A stream that asks for ``return_token_ids`` gets ids where vLLM puts them: the prompt's on the
role chunk (a token per 4 characters of the messages' text, 10 at least, so a long prompt's
first chunk is as long as vLLM's) and one on each content chunk.

``/v1/audio/transcriptions`` and ``/v1/audio/translations`` take a multipart form as vLLM does
and answer ``{"text": ...}``, or, when the form has ``stream=true``, an SSE stream of
``tokens`` transcription chunks paced like a chat stream (``cut_after`` applies too).

Length: one job, vLLM's wire at the least cost; its modes, faults and endpoints share the one
connection loop and chunk format.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import email
import email.policy
import functools
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
FINGERPRINT = "vllm-fake"  # what vLLM's usage chunk names as its system_fingerprint


@dataclass
class FakeStats:
    requests: int = 0
    disconnects: int = 0  # connections closed by the peer before the response ended
    drain_waits: int = 0  # writes held back by a slow reader (backpressure)
    bytes_written: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)  # JSON, or a form's fields
    raw_bodies: list[bytes] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)  # request targets, query included
    headers: list[dict[str, str]] = field(default_factory=list)
    disconnected_at: list[float] = field(default_factory=list)
    connections: int = 0  # accepted
    streaming: int = 0  # paced chat streams being sent now
    max_streaming: int = 0  # the most at once


def _chunk(
    i: int,
    content: str | None,
    finish: str | None = None,
    ids: list[int] | None = None,
    prompt_ids: list[int] | None = None,
) -> bytes:
    """One chat chunk as vLLM writes it (compact JSON, its keys in vLLM's order:
    ``tests/fixtures/vllm_chat_stream.txt``); ``i == 0`` is the role-only chunk. vLLM writes
    the choice's ``token_ids`` on every other chunk and ``prompt_token_ids`` and
    ``prompt_text`` after the role chunk's choices, null unless the request asked for
    ``return_token_ids``: then ``ids`` and ``prompt_ids`` are theirs."""
    choice: dict[str, Any] = {"index": 0}
    if i == 0:
        choice["delta"] = {"role": "assistant", "content": ""}
    else:
        choice["delta"] = {"content": content} if content is not None else {}
    choice["logprobs"] = None
    choice["finish_reason"] = finish
    if finish is not None:
        choice["stop_reason"] = None
    if i != 0:
        choice["token_ids"] = ids
    obj: dict[str, Any] = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1779182750,
        "model": MODEL,
        "choices": [choice],
    }
    if i == 0:
        obj["prompt_token_ids"] = prompt_ids
        obj["prompt_text"] = None
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def stream_events(
    tokens: int,
    usage: bool = False,
    token_bytes: int = 0,
    token_ids: bool = False,
    prompt_tokens: int = 10,
) -> list[bytes]:
    """The events of a chat stream: role chunk, ``tokens`` content chunks, finish, [DONE];
    with ``token_ids``, the ids vLLM sends for ``return_token_ids`` (``prompt_tokens`` prompt
    ids, one id per content chunk)."""
    if token_ids:
        # Ids of a 150,000-token vocabulary's size, as long on the wire as a real prompt's.
        prompt_ids = [100_000 + i for i in range(prompt_tokens)]
        events = [_chunk(0, None, prompt_ids=prompt_ids)]
    else:
        events = [_chunk(0, None)]
    if token_bytes:
        # Big test streams: one shared event object, so a 100 MB stream costs no memory here.
        big = _chunk(1, "x" * token_bytes, ids=[100] if token_ids else None)
        events += [big] * tokens
    else:
        events += [
            _chunk(i + 1, f" tok{i}", ids=[1000 + i] if token_ids else None) for i in range(tokens)
        ]
    events.append(_chunk(tokens + 1, "", "length", ids=[] if token_ids else None))
    if usage:
        u = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + tokens,
            "completion_tokens": tokens,
        }
        obj = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 1779182750,
            "model": MODEL,
            "choices": [],
            "usage": u,
            "system_fingerprint": FINGERPRINT,
        }
        events.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def events_for(
    tokens: int, usage: bool, token_bytes: int, token_ids: bool, prompt_tokens: int
) -> list[bytes]:
    """A stream's events (``stream_events``), made once per shape and shared: made per request
    (a ``json.dumps`` per chunk) they cost this mock ~0.8 ms a request, which a benchmark would
    count as the gateway's TTFT and which takes the cores the gateway shares. Tests replace
    this to script a replica's answers."""
    if not (token_ids or usage):
        prompt_tokens = 10  # unused: one shape whatever the prompt
    return _events_cached(tokens, usage, token_bytes, token_ids, prompt_tokens)


@functools.lru_cache(maxsize=256)
def _events_cached(
    tokens: int, usage: bool, token_bytes: int, token_ids: bool, prompt_tokens: int
) -> list[bytes]:
    return stream_events(tokens, usage, token_bytes, token_ids, prompt_tokens)


def count_prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt's length in tokens as this mock counts them: a token per 4 characters of
    the messages' text (or the prompt's), 10 at least (a chat template's own tokens)."""
    prompt = body.get("prompt")
    chars = len(prompt) if isinstance(prompt, str) else 0
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        chars += len(content) if isinstance(content, str) else 0
    return max(10, chars // 4)


def _plain(tokens: int) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": " ".join(f"tok{i}" for i in range(tokens)),
                    },
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": tokens,
                "total_tokens": 10 + tokens,
            },
        }
    ).encode()


_MODELS = json.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": MODEL,
                "object": "model",
                "owned_by": "vllm",
                "root": MODEL,
                "max_model_len": 32768,
            }
        ],
    }
).encode()


class FakeUpstream:
    def __init__(self, *, tokens: int = 64, interval_s: float = 0.0, record: bool = True) -> None:
        self.tokens = tokens
        self.interval_s = interval_s
        self.record = record
        self.stats = FakeStats()
        self.fail_status: int | None = None
        self.garbage = False  # answer generation requests with something that is not HTTP
        self.first_token_delay_s = 0.0
        self.cut_after: int | None = None
        self.close_after_request: str | None = None  # "close" | "reset"
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> None:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and close open connections: new connections are refused."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self.stats.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length", "0"))
                body = await reader.readexactly(length) if length else b""
                await self._respond(method, path, headers, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def _metrics(self) -> bytes:
        # Enough of vLLM's scrape for a health checker: it is never stalled, since the
        # generation counter moves with every request answered.
        label = f'{{engine="0",model_name="{MODEL}"}}'
        return (
            f"vllm:num_requests_running{label} 0.0\n"
            f"vllm:num_requests_waiting{label} 0.0\n"
            f"vllm:kv_cache_usage_perc{label} 0.0\n"
            f"vllm:prompt_tokens_total{label} {10.0 * self.stats.requests}\n"
            f"vllm:generation_tokens_total{label} {float(self.stats.requests)}\n"
        ).encode()

    async def _respond(
        self, method: str, path: str, headers: dict[str, str], raw: bytes, w: asyncio.StreamWriter
    ) -> None:
        if path == "/health":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        if path == "/v1/models":
            w.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d"
                b"\r\n\r\n%s" % (len(_MODELS), _MODELS)
            )
            return
        if path == "/metrics":
            text = self._metrics()
            w.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(text), text)
            )
            return
        self.stats.requests += 1
        ctype = headers.get("content-type", "")
        if ctype.startswith("multipart/form-data"):
            body: dict[str, Any] = form_fields(raw, ctype)
        else:
            body = json.loads(raw) if raw else {}
        if self.record:
            self.stats.targets.append(path)
            self.stats.bodies.append(body)
            self.stats.raw_bodies.append(raw)
            self.stats.headers.append(headers)
        if self.close_after_request is not None:
            if self.close_after_request == "reset":
                # Linger 0: close() sends a RST instead of a FIN.
                sock = w.transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()
            return
        if self.garbage:
            w.write(b"SSH-2.0-OpenSSH_9.2\r\n")
            w.transport.close()
            return
        if self.fail_status is not None:
            payload = json.dumps(
                {
                    "error": {
                        "message": "fake failure",
                        "type": "Error",
                        "param": None,
                        "code": self.fail_status,
                    }
                }
            ).encode()
            w.write(
                b"HTTP/1.1 %d Fail\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (self.fail_status, len(payload), payload)
            )
            return
        if path.startswith("/v1/audio/"):
            await self._transcription(body, w)
            return
        tokens = int(body.get("max_tokens") or self.tokens)
        if not body.get("stream"):
            payload = _plain(tokens)
            w.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d"
                b"\r\n\r\n%s" % (len(payload), payload)
            )
            return
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = events_for(
            tokens,
            usage,
            int(body.get("fake_token_bytes") or 0),
            body.get("return_token_ids") is True,
            count_prompt_tokens(body),
        )
        interval = float(body.get("fake_interval_ms", self.interval_s * 1000)) / 1000
        paced = interval > 0 or "fake_interval_ms" in body
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        if not paced and not self.first_token_delay_s and self.cut_after is None:
            data = b"".join(events)
            w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
            return
        stats = self.stats
        stats.streaming += 1
        stats.max_streaming = max(stats.max_streaming, stats.streaming)
        try:
            if interval > 0 and not self.first_token_delay_s and self.cut_after is None:
                with self._noting_disconnects():
                    await PacedWrites(w.transport, events, interval, stats).done
            else:
                await self._paced(w, events, interval)
        finally:
            stats.streaming -= 1

    async def _paced(self, w: asyncio.StreamWriter, events: list[bytes], interval: float) -> None:
        with self._noting_disconnects():
            for i, event in enumerate(events):
                if i == 1 and self.first_token_delay_s:
                    await asyncio.sleep(self.first_token_delay_s)
                elif i > 1 and event is not events[-1] and interval > 0:
                    await asyncio.sleep(interval)
                if self.cut_after is not None and i > self.cut_after:
                    _cut(w)
                await self._send_chunk(w, event)
            w.write(b"0\r\n\r\n")

    async def _send_chunk(self, w: asyncio.StreamWriter, event: bytes) -> None:
        """One HTTP chunk, drained: a reader that stops reading holds this writer back."""
        w.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.stats.bytes_written += len(event)
        if w.transport.get_write_buffer_size() > 65536:
            self.stats.drain_waits += 1  # above the high-water mark: drain() waits
        await w.drain()
        if w.transport.is_closing():
            raise ConnectionResetError

    @contextlib.contextmanager
    def _noting_disconnects(self) -> Iterator[None]:
        try:
            yield
        except ConnectionError:
            self.stats.disconnects += 1
            self.stats.disconnected_at.append(time.monotonic())
            raise

    async def _transcription(self, form: dict[str, Any], w: asyncio.StreamWriter) -> None:
        """vLLM's transcription answer: whole, or streamed when the form says ``stream=true``."""
        words = [f" tok{i}" for i in range(self.tokens)]
        if form.get("stream") != "true":
            payload = json.dumps({"text": "".join(words).strip()}).encode()
            w.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d"
                b"\r\n\r\n%s" % (len(payload), payload)
            )
            return
        events = [_transcription_chunk(word, None) for word in words]
        events += [_transcription_chunk("", "stop"), b"data: [DONE]\n\n"]
        interval = float(form.get("fake_interval_ms", self.interval_s * 1000)) / 1000
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        with self._noting_disconnects():
            for i, event in enumerate(events):
                if i and interval > 0:
                    await asyncio.sleep(interval)
                if self.cut_after is not None and i >= self.cut_after:
                    _cut(w)
                await self._send_chunk(w, event)
            w.write(b"0\r\n\r\n")


# A paced write that leaves more than this in the transport's buffer waits, as ``drain()``
# waits, until the buffer is down to ``LOW_WATER``: asyncio's stream writer's defaults.
HIGH_WATER = 65536
LOW_WATER = 16384


class PacedWrites:
    """A paced stream written from timer callbacks: the same writes at the same times as
    ``_paced`` (the role and first chunks at once, then one per ``interval``, the last right
    after the one before it, then the body's end), held back the same way by a reader that does
    not read, and ended as a reset when the reader is found gone after a write.

    Why not ``_paced``'s coroutine: an ``asyncio.sleep`` and a ``drain()`` per token cost the
    mock 30–48 µs of CPU a chunk, as much as the gateway it feeds, on the two cores they share
    (``docs/benchmarks.md``, "Workers"). Used where no fault is asked for (no first-token
    delay, no cut). ``loop``: the running loop unless given (a test's clock)."""

    __slots__ = ("done", "events", "i", "interval", "loop", "stats", "transport")

    def __init__(
        self,
        transport: asyncio.WriteTransport,
        events: list[bytes],
        interval: float,
        stats: FakeStats,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.transport = transport
        self.events = events
        self.interval = interval
        self.stats = stats
        self.i = 0  # the next event to write
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.step()

    def step(self) -> None:
        transport = self.transport
        if self.done.done():
            return
        if transport.is_closing():
            self._gone()
            return
        event = self.events[self.i]
        self.i += 1
        transport.write(b"%x\r\n%b\r\n" % (len(event), event))
        self.stats.bytes_written += len(event)
        if transport.get_write_buffer_size() > HIGH_WATER:
            self.stats.drain_waits += 1
            self.loop.call_later(0.001, self._drained)
        else:
            self._next()

    def _drained(self) -> None:
        transport = self.transport
        if transport.is_closing() or transport.get_write_buffer_size() <= LOW_WATER:
            self._next()
        else:
            self.loop.call_later(0.001, self._drained)

    def _next(self) -> None:
        """After a write has drained: as ``_paced``, a reader gone is a reset; no pause before
        the first content chunk, nor before the last."""
        if self.done.done():
            return
        if self.transport.is_closing():
            self._gone()
            return
        i = self.i
        if i == len(self.events):
            self.transport.write(b"0\r\n\r\n")
            self.done.set_result(None)
        elif i > 1 and i != len(self.events) - 1:
            self.loop.call_later(self.interval, self.step)
        else:
            self.loop.call_soon(self.step)

    def _gone(self) -> None:
        self.done.set_exception(ConnectionResetError("the reader went away"))


def _cut(w: asyncio.StreamWriter) -> NoReturn:
    w.transport.abort()
    raise ConnectionResetError("cut by the fake")


def _transcription_chunk(content: str, finish: str | None) -> bytes:
    obj = {
        "id": "trsc-fake",
        "object": "transcription.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"delta": {"content": content}, "finish_reason": finish, "stop_reason": None}],
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def form_fields(raw: bytes, content_type: str) -> dict[str, Any]:
    """The fields of a ``multipart/form-data`` body: text fields as str, files as bytes."""
    message = email.message_from_bytes(
        b"content-type: " + content_type.encode("latin-1") + b"\r\n\r\n" + raw,
        policy=email.policy.HTTP,
    )
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        value: Any = part.get_payload(decode=True)
        name = part.get_param("name", header="content-disposition")
        fields[str(name)] = value if part.get_filename() is not None else value.decode()
    return fields


@contextlib.asynccontextmanager
async def running(**kw: Any) -> AsyncIterator[FakeUpstream]:
    fake = FakeUpstream(**kw)
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="fast fake vLLM (wire only)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--interval-ms", type=float, default=0.0)
    args = parser.parse_args()

    async def run() -> None:
        fake = FakeUpstream(tokens=args.tokens, interval_s=args.interval_ms / 1000, record=False)
        await fake.start(args.port)
        print(fake.url, flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())


if __name__ == "__main__":
    main()
