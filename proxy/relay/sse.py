"""Reading vLLM's server-sent events without changing them.

The relay forwards upstream bytes as they come; it only *looks* at events while it holds the
start of a stream (to find the first chunk that carries content, or an error event before it)
and at the tail (for ``usage``). Events are ``data: <json>\\n\\n``; vLLM writes chunks as compact
JSON but error events with spaces, so events are parsed, never matched byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from typing import Any, Final

import msgspec

DONE: Final = b"[DONE]"
# msgspec decodes a vLLM chunk ~15x faster than ``json.loads`` (0.7 against 9-12 µs here for
# a 200-byte chunk; loadtest/bench_parse.py): that is most of what a continuable stream pays
# per event. It is strict where ``json`` is lenient (NaN, lone surrogates, 1e400): whatever it
# refuses is decoded again by ``json``, so the objects are the ones ``json.loads`` gives.
_DECODER: Final = msgspec.json.Decoder()
# Its ``decode``, bound once: compiled, ``_DECODER.decode(data)`` looks the method up by name on
# every call.
_DECODE: Final = _DECODER.decode
_DELTA_CONTENT_KEYS: Final = ("content", "reasoning_content", "reasoning", "tool_calls", "audio")


def _find(data: bytes, sub: bytes, start: int, end: int) -> int:
    return data.find(sub, start, end)


def _rfind(data: bytes, sub: bytes, start: int, end: int) -> int:
    return data.rfind(sub, start, end)


Search = Callable[[bytes, bytes, int, int], int]


def _native_search() -> tuple[Search, Search]:
    """``bytes.find`` and ``bytes.rfind`` as plain functions, in C when the compiled build is
    in use (``proxy/compiled.py`` finds ``proxy.relay._bytesearch`` in it), else these.
    Compiled, ``data.find(...)`` is a method call whose arguments a format string parses back:
    about 1,500 instructions a call, where the C function costs a few hundred (callgrind);
    an eligible stream's first events search some thirty times a request."""
    try:
        from proxy.relay._bytesearch import find, rfind
    except ImportError:
        return _find, _rfind
    return find, rfind


# FIND(data, sub, start, end): ``data.find(sub, start, end)``; RFIND: ``data.rfind(...)``. For
# exact bytes only (the C functions refuse a bytearray or memoryview with a TypeError): what the
# relay searches is a socket's read, its slices and joins.
_SEARCH: Final = _native_search()
FIND: Final = _SEARCH[0]
RFIND: Final = _SEARCH[1]


def event_end(data: bytes, start: int) -> int:
    """Where the first event from ``start`` ends (its "\\n\\n"), or -1. Searched a line end
    at a time: a one-byte search is a ``memchr``, a two-byte one a scan that costs 12 µs over
    a 13 KB chunk (a 2,048-token prompt's ids) here against 0.4 µs; vLLM's events are one
    line."""
    n = len(data)
    i = FIND(data, b"\n", start, n)
    while 0 <= i < n - 1:
        if data[i + 1] == 0x0A:
            return i
        i = FIND(data, b"\n", i + 2, n)
    return -1


def contains(data: bytes, part: bytes) -> bool:
    """``part in data``, without its cost: CPython's ``in`` on bytes first tries ``part`` as
    an int, and builds and drops a TypeError before it searches (2,400 instructions a test,
    counted with callgrind: five tests a request cost 2 % of its CPU); ``find`` searches at
    once (``FIND``: in C, without a method call)."""
    return FIND(data, part, 0, len(data)) >= 0


class EventBuffer:
    """Splits a byte stream into complete SSE events; keeps the unfinished rest."""

    __slots__ = ("_data", "_start")

    def __init__(self) -> None:
        self._data = b""
        self._start = 0  # what is pending is self._data[self._start:]

    @property
    def empty(self) -> bool:
        """Nothing pending: the next chunk starts an event."""
        return self._start >= len(self._data)

    @property
    def ready(self) -> bool:
        """A complete event is pending."""
        return event_end(self._data, self._start) >= 0

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """The complete events so far, one at a time: a reader that stops early (at the first
        content) does not pay for splitting, or copying, the rest of a large read.

        What was not taken is kept when the generator ends or is closed (a ``for`` loop left
        with ``break`` closes it): finish with one generator before feeding the next chunk.
        (``push`` and ``next_event`` are the same without a generator: the relay's loops use
        them, since compiled code iterates a generator through the generic protocol.)"""
        self.push(chunk)
        while (event := self.next_event()) is not None:
            yield event

    def push(self, chunk: bytes) -> None:
        """Add ``chunk``; its complete events are then taken one at a time (``next_event``)."""
        rest = self._data[self._start :] if self._start < len(self._data) else b""
        data = rest + chunk if rest else chunk
        # vLLM ends events with "\n\n"; accept "\r\n\r\n" as other servers may send it.
        # Looking for the one byte is a memchr; looking for b"\r\n" in a buffer full of "\n"
        # costs 12 µs per 14 KB read.
        if contains(data, b"\r"):
            data = data.replace(b"\r\n", b"\n")
        # The position lives on the buffer, so that a reader may take several events at once
        # between two of them (``pending``, ``advance``).
        self._data = data
        self._start = 0

    def next_event(self) -> bytes | None:
        """The next complete event, or None (what is left stays pending)."""
        data = self._data
        start = self._start
        end = event_end(data, start)
        if end < 0:
            return None
        self._start = end + 2
        return data[start:end]

    def reads(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        """``chunks``, and an empty read before the next whenever complete events are left
        pending (a reader that stopped early, at its first content): those are taken before
        more is read."""
        return _Reads(self, chunks.__aiter__())

    def pending(self) -> tuple[bytes, int]:
        """The buffered bytes and where what was not yet taken starts in them."""
        return self._data, self._start

    def advance(self, to: int) -> None:
        """Mark what is before ``to`` (an event's end, in ``pending``'s bytes) as taken."""
        self._start = to


class _Reads:
    """``EventBuffer.reads``; a class, not an async generator, so that a reader leaving early
    leaves nothing for the event loop to close (``proxy/relay/upstream.py``'s ``_Reads``)."""

    __slots__ = ("_buffer", "_chunks")

    def __init__(self, buffer: EventBuffer, chunks: AsyncIterator[bytes]) -> None:
        self._buffer = buffer
        self._chunks: AsyncIterator[bytes] | None = chunks

    def __aiter__(self) -> _Reads:
        return self

    async def __anext__(self) -> bytes:
        chunks = self._chunks
        if chunks is None:
            raise StopAsyncIteration  # over for good once it ended or raised, as a generator
        if self._buffer.ready:
            return b""
        try:
            return await chunks.__anext__()
        except BaseException:
            self._chunks = None
            raise


def decode_json(data: bytes) -> Any:
    """``json.loads(data)``, faster; raises ``ValueError`` for what is not JSON."""
    try:
        return _DECODE(data)
    except msgspec.DecodeError:
        return json.loads(data)


def event_data(event: bytes) -> bytes | None:
    """The payload of an event's ``data:`` lines (joined by newlines), or None for comments."""
    if event.startswith(b"data: ") and FIND(event, b"\n", 0, len(event)) < 0:
        return event[6:]  # vLLM's one line: no split, no join
    lines = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(lines)


def parse_event(event: bytes) -> Any:
    """The JSON object in an event; ``DONE`` for ``[DONE]``; None when there is none."""
    data = event_data(event)
    if data is None:
        return None
    # A chunk's JSON object is told from [DONE] by its first byte, without ``strip``'s call.
    if not (data and data[0] == 0x7B) and data.strip() == DONE:  # "{"
        return DONE
    try:
        return decode_json(data)
    except ValueError:
        return None


# Typed events (Anthropic Messages, OpenAI Responses) that carry generated content: text,
# tool-call input, reasoning, audio. Anthropic's deltas are ``content_block_delta`` events
# whose ``delta`` holds the text (``text``, ``partial_json``, ``thinking``).
_CONTENT_EVENTS: Final = frozenset(
    {
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.refusal.delta",
        "response.audio.delta",
        "response.audio.transcript.delta",
        "response.custom_tool_call_input.delta",
        "response.mcp_call_arguments.delta",
        "response.code_interpreter_call_code.delta",
    }
)
_ANTHROPIC_DELTA_KEYS: Final = ("text", "partial_json", "thinking")
# Typed events that end a stream as failed before any content.
_ERROR_EVENTS: Final = frozenset({"error", "response.failed"})


def _typed_content(obj: dict[str, Any]) -> bool:
    etype = obj.get("type")
    if etype == "content_block_delta":
        delta = obj.get("delta")
        if isinstance(delta, dict):
            return any(delta.get(key) for key in _ANTHROPIC_DELTA_KEYS)
        return False
    if etype in _CONTENT_EVENTS:
        return bool(obj.get("delta"))
    return False


def carries_content(obj: Any) -> bool:
    """True when a chunk carries text, a tool call or audio: the moment TTFT is measured.
    Chat and completions chunks carry it in ``choices``; the typed events of the Messages and
    Responses APIs by their ``type``."""
    if not isinstance(obj, dict):
        return False
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return "type" in obj and _typed_content(obj)
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        text = choice.get("text")  # completions
        if isinstance(text, str) and text:
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for key in _DELTA_CONTENT_KEYS:
                if delta.get(key):
                    return True
    return False


# How each API's stream ends when the replica finished it (an error event is an end too).
_ENDS: Final[dict[str, tuple[bytes, ...]]] = {
    "messages": (b"message_stop", b"event: error"),
    "responses": (
        b"response.completed",
        b"response.incomplete",
        b"response.failed",
        b"event: error",
    ),
}


def stream_complete(kind: str, end: bytes) -> bool:
    """Whether a stream's last bytes hold its end: ``[DONE]`` for chat and completions, the
    API's closing event for Messages and Responses. A stream without it was cut short."""
    markers = _ENDS.get(kind)
    if markers is None:
        # The last bytes, not the whole: ``end`` may be a whole stream read at once, and
        # stripping it copied it (14 KB for 64 tokens).
        last = end[-256:].rstrip()
        if len(last) < len(DONE) and len(end) > 256:
            last = end.rstrip()  # the end may be further back than the last bytes
        return last.endswith(DONE)
    return any(contains(end, m) for m in markers)


def is_error(obj: Any) -> bool:
    """An error event: vLLM's ``{"error": {...}}``, Anthropic's ``{"type": "error", ...}``,
    a Responses stream's ``error`` or ``response.failed``."""
    if not isinstance(obj, dict) or "choices" in obj:
        return False
    return "error" in obj or obj.get("type") in _ERROR_EVENTS


def usage_of(obj: Any) -> dict[str, Any] | None:
    """An answer's (or event's) ``usage`` in chat's words (``prompt_tokens``,
    ``completion_tokens``): Messages and Responses count ``input_tokens`` and
    ``output_tokens``, a Responses event nests it in its ``response``, and a Messages stream
    sends it in ``message_delta`` (and the prompt's in ``message_start``'s ``message``)."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        inner = obj.get("response") or obj.get("message")
        usage = inner.get("usage") if isinstance(inner, dict) else None
        if not isinstance(usage, dict):
            return None
    if "output_tokens" in usage and "completion_tokens" not in usage:
        out = usage.get("output_tokens")
        return {
            **usage,
            "prompt_tokens": usage.get("input_tokens"),
            "completion_tokens": out,
            "total_tokens": (usage.get("input_tokens") or 0) + (out or 0),
        }
    return usage


def response_id(obj: Any) -> str | None:
    """The id of a created Responses-API response: the answer's own, or the one a stream's
    ``response.created`` event carries."""
    if not isinstance(obj, dict):
        return None
    if obj.get("object") == "response":
        rid = obj.get("id")
    elif obj.get("type") == "response.created" and isinstance(obj.get("response"), dict):
        rid = obj["response"].get("id")
    else:
        return None
    return rid if isinstance(rid, str) and rid else None


def finish_reasons_of(obj: Any) -> list[str]:
    """The non-null ``finish_reason`` of each choice of a response or chunk object."""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        return []
    return [
        c["finish_reason"]
        for c in choices
        if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)
    ]


def last_finish_reasons(tail: bytes) -> list[str]:
    """Every choice's ``finish_reason`` from the last events of a stream (vLLM sends each in
    the choice's last chunk, just before the usage chunk and ``[DONE]``)."""
    if contains(tail, b"\r"):
        tail = tail.replace(b"\r\n", b"\n")
    reasons: list[str] = []
    for event in tail.split(b"\n\n"):
        if contains(event, b'"finish_reason"'):  # a partial first event parses to None
            reasons.extend(finish_reasons_of(parse_event(event.strip())))
    return reasons


def last_usage(tail: bytes) -> dict[str, Any] | None:
    """``usage`` from the last events of a stream (vLLM sends it just before ``[DONE]``)."""
    if contains(tail, b"\r"):  # as EventBuffer does: accept CRLF line ends
        tail = tail.replace(b"\r\n", b"\n")
    n = len(tail)
    idx = RFIND(tail, b'"usage"', 0, n)
    if idx < 0:
        return None
    start = RFIND(tail, b"data:", 0, idx)
    end = FIND(tail, b"\n\n", idx, n)
    if start < 0:
        return None
    obj = parse_event(tail[start : end if end >= 0 else len(tail)])
    return usage_of(obj)


def error_message(obj: Any) -> str:
    """The message of an error event's object (``{"error": {...}}``, a Responses ``error``
    event's own ``message``, a ``response.failed``'s ``response.error``), at most 200 chars."""
    if not isinstance(obj, dict):
        return str(obj)[:200]
    err = obj.get("error")
    if err is None:
        inner = obj.get("response")
        err = inner.get("error") if isinstance(inner, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message", ""))[:200]
    return str(err)[:200]
