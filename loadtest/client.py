"""The load generator's HTTP client: aiohttp, one session, timestamps taken as bytes arrive.

Why aiohttp and not httpx: a load generator must not be the bottleneck it measures, and
aiohttp's client (C parser, one read per socket event) consumes several times more requests
and stream chunks per core than httpx. One ``ClientSession`` serves the whole run with a
connection limit as large as the run's concurrency; aiohttp sets TCP_NODELAY on every
connection, so small request bodies are not held back by Nagle's algorithm.

A streamed response is read as it arrives; every read is timestamped once, and each complete
SSE event in it is parsed. The first event whose delta carries content (text, a tool call or
audio; the role-only first chunk carries none) is the time to first token.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from .stats import (
    CONNECT_ERROR,
    HTTP_ERROR,
    INCOMPLETE,
    OK,
    STREAM_ERROR,
    TIMEOUT,
    RequestResult,
)

HEADERS_OF_INTEREST = ("x-tokenlane-lane", "x-tokenlane-replica", "x-request-id", "retry-after")
ERROR_BODY_LIMIT = 64 * 1024


class SSEDecoder:
    """Incremental SSE framing: feed bytes as they come, get the ``data`` of whole events.

    Events end with a blank line; ``\\r\\n`` line ends are accepted; several ``data:`` lines
    in one event are joined with ``\\n`` as the SSE spec says; comments and other fields are
    ignored.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data
        if b"\r" in buf:
            # A "\r" at the very end stays in the buffer and pairs with the next "\n".
            buf = buf.replace(b"\r\n", b"\n")
        *events, self._buf = buf.split(b"\n\n")
        out: list[bytes] = []
        for event in events:
            if event.startswith(b"data:") and b"\n" not in event:
                out.append(_field_value(event))  # the common case: one data line
                continue
            lines = [_field_value(ln) for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))
        return out

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet complete (non-empty at EOF means a truncated stream)."""
        return self._buf


def _field_value(line: bytes) -> bytes:
    value = line[5:]
    return value[1:] if value.startswith(b" ") else value


def has_content(chunk: Mapping[str, Any]) -> bool:
    """Whether a chat or completions chunk carries generated output (not just the role)."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if delta is not None:
            if delta.get("content") or delta.get("tool_calls") or delta.get("audio"):
                return True
        elif choice.get("text"):  # /v1/completions
            return True
    return False


def chunk_text(chunk: Mapping[str, Any]) -> str:
    """The text a chat or completions chunk carries."""
    out = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        text = (delta or {}).get("content") if delta is not None else choice.get("text")
        if isinstance(text, str):
            out.append(text)
    return "".join(out)


def message_has_content(body: Mapping[str, Any]) -> bool:
    for choice in body.get("choices") or ():
        msg = choice.get("message")
        if msg is not None:
            if msg.get("content") or msg.get("tool_calls") or msg.get("audio"):
                return True
        elif choice.get("text"):
            return True
    return False


def error_text(status: int, body: bytes) -> str:
    """``"<status>: <message>"`` from OpenAI's error shape, vLLM's older flat one, or raw."""
    message: Any = None
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed)
        message = err.get("message") if isinstance(err, dict) else err
    if message is None:
        message = body[:300].decode("utf-8", "replace").strip() or "(empty body)"
    return f"{status}: {message}"[:500]


def _take_usage(result: RequestResult, obj: Mapping[str, Any]) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            result.usage_completion_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            result.usage_prompt_tokens = usage["prompt_tokens"]


class LoadClient:
    """One aiohttp session for a whole run. Use as ``async with LoadClient(url) as client``."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        max_connections: int = 10_000,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._max_connections = max_connections
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> LoadClient:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections,
            limit_per_host=0,
            keepalive_timeout=60,
            ttl_dns_cache=300,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            headers=self._headers,
            # Responses are read raw; compression would only cost client CPU on loopback.
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding",),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("LoadClient used outside 'async with'")
        return self._session

    async def models(self) -> list[str]:
        """Model ids from ``GET /v1/models`` (raises ``aiohttp.ClientError`` on failure)."""
        async with self.session.get(f"{self.base_url}/v1/models") as resp:
            resp.raise_for_status()
            body = await resp.json(content_type=None)
        data = body.get("data") if isinstance(body, dict) else None
        return [m["id"] for m in data or () if isinstance(m, dict) and isinstance(m.get("id"), str)]

    async def send(self, path: str, body: bytes, result: RequestResult) -> RequestResult:
        """POST ``body`` (JSON bytes) to ``path`` and fill ``result``'s measured fields.

        Never raises for what the server or network did: that is recorded in ``outcome``,
        ``status`` and ``error``. Cancellation propagates (and closes the connection).
        """
        started = time.perf_counter()
        got_headers = False
        try:
            async with self.session.post(f"{self.base_url}{path}", data=body) as resp:
                got_headers = True
                result.status = resp.status
                result.headers = {
                    k: resp.headers[k] for k in HEADERS_OF_INTEREST if k in resp.headers
                }
                if resp.status != 200:
                    raw = await resp.content.read(ERROR_BODY_LIMIT)
                    result.e2e_s = time.perf_counter() - started
                    result.outcome = HTTP_ERROR
                    result.error = error_text(resp.status, raw)
                elif resp.content_type == "text/event-stream":
                    await self._read_stream(resp, started, result)
                else:
                    await self._read_plain(resp, started, result)
        except TimeoutError:
            result.outcome = TIMEOUT
            result.error = "client timeout"
            result.e2e_s = time.perf_counter() - started
        except (aiohttp.ClientError, OSError) as exc:
            result.outcome = INCOMPLETE if got_headers else CONNECT_ERROR
            result.error = f"{type(exc).__name__}: {exc}"[:500]
            result.e2e_s = time.perf_counter() - started
        return result

    async def _read_plain(
        self, resp: aiohttp.ClientResponse, started: float, result: RequestResult
    ) -> None:
        raw = await resp.read()
        result.e2e_s = result.ttft_s = time.perf_counter() - started
        try:
            parsed = json.loads(raw)
        except ValueError:
            result.outcome = INCOMPLETE
            result.error = f"response is not JSON: {raw[:200]!r}"
            return
        if not isinstance(parsed, dict):
            result.outcome = INCOMPLETE
            result.error = "response JSON is not an object"
            return
        _take_usage(result, parsed)
        result.content_chunks = 1 if message_has_content(parsed) else 0
        result.outcome = OK

    async def _read_stream(
        self, resp: aiohttp.ClientResponse, started: float, result: RequestResult
    ) -> None:
        decoder = SSEDecoder()
        last_content: float | None = None
        itl = result.itl_s
        done = False
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            for payload in decoder.feed(data):
                if payload == b"[DONE]":
                    done = True
                    continue
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    result.error = f"event is not JSON: {payload[:200]!r}"
                    continue
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk and not chunk.get("choices"):
                    result.error = error_text(200, payload)
                    continue
                if has_content(chunk):
                    if result.text is not None:
                        result.text.append(chunk_text(chunk))
                    result.content_chunks += 1
                    if last_content is None:
                        result.ttft_s = now - started
                    else:
                        itl.append(now - last_content)
                    last_content = now
                _take_usage(result, chunk)
        result.e2e_s = time.perf_counter() - started
        if result.error is not None:
            result.outcome = STREAM_ERROR
        elif not done:
            result.outcome = INCOMPLETE
            result.error = "stream ended without data: [DONE]"
        else:
            result.outcome = OK
