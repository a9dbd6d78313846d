"""proxy.relay.sse over vLLM's real streams: the splitter under every way a socket can cut a stream,
and the few facts the relay reads from events (content, error, usage)."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest

from loadtest.fake_upstream import stream_events
from proxy.errors import StreamCut, sse_error_event
from proxy.relay import sse

FIXTURES = Path(__file__).parent / "fixtures"
STREAM_FIXTURES = (
    "vllm_chat_stream.txt",
    "vllm_chat_stream_v0_11.txt",
    "vllm_chat_stream_error.txt",
)


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def events_of(stream: bytes) -> list[bytes]:
    """The oracle: a whole LF stream split at once (every event ends with a blank line)."""
    assert stream.endswith(b"\n\n")
    return stream[:-2].split(b"\n\n")


def feed_all(buf: sse.EventBuffer, chunks: Iterable[bytes]) -> list[bytes]:
    return [event for chunk in chunks for event in buf.feed(chunk)]


def cut(stream: bytes, offsets: Iterable[int]) -> list[bytes]:
    bounds = [0, *sorted(offsets), len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


def fake_stream() -> bytes:
    return b"".join(stream_events(20, usage=True))


def first_event(buf: sse.EventBuffer, chunk: bytes) -> bytes:
    # The relay's way of stopping early: break out of the loop, which drops the generator.
    for event in buf.feed(chunk):
        return event
    raise AssertionError("no complete event")


# ---------------------------------------------------------------------------- EventBuffer


@pytest.mark.parametrize("name", STREAM_FIXTURES)
def test_event_buffer_yields_exactly_the_events_for_a_split_at_every_offset(name: str) -> None:
    stream = fixture(name)
    expected = events_of(stream)
    assert len(expected) >= 5
    for offset in range(len(stream) + 1):
        assert feed_all(sse.EventBuffer(), cut(stream, [offset])) == expected, offset


def test_event_buffer_yields_exactly_the_events_fed_one_byte_at_a_time() -> None:
    stream = fake_stream()
    chunks = [stream[i : i + 1] for i in range(len(stream))]
    assert feed_all(sse.EventBuffer(), chunks) == events_of(stream)


def test_event_buffer_yields_exactly_the_events_for_random_splits() -> None:
    rng = random.Random(20260522)
    streams = [fake_stream(), *(fixture(n) for n in STREAM_FIXTURES)]
    for _ in range(400):
        stream = rng.choice(streams)
        offsets = rng.sample(range(len(stream) + 1), rng.randint(1, 30))
        assert feed_all(sse.EventBuffer(), cut(stream, offsets)) == events_of(stream), offsets


def test_event_buffer_keeps_an_unfinished_event_until_its_blank_line_arrives() -> None:
    buf = sse.EventBuffer()
    assert list(buf.feed(b'data: {"a":1}\n')) == []
    assert list(buf.feed(b"")) == []
    assert list(buf.feed(b"\n")) == [b'data: {"a":1}']
    assert list(buf.feed(b"")) == []


def test_event_buffer_stopped_early_yields_the_rest_with_the_next_feed() -> None:
    stream = fake_stream()
    expected = events_of(stream)
    buf = sse.EventBuffer()
    assert first_event(buf, stream) == expected[0]
    # The rest is pending: a new read after it comes after it.
    assert list(buf.feed(b"data: [DONE]\n\n")) == [*expected[1:], b"data: [DONE]"]


def test_event_buffer_stopped_early_yields_the_rest_when_fed_nothing() -> None:
    stream = fake_stream()
    expected = events_of(stream)
    buf = sse.EventBuffer()
    assert first_event(buf, stream) == expected[0]
    assert list(buf.feed(b"")) == expected[1:]
    assert list(buf.feed(b"")) == []


def test_event_buffer_closed_generator_keeps_what_it_did_not_yield() -> None:
    stream = fixture("vllm_chat_stream.txt")
    expected = events_of(stream)
    buf = sse.EventBuffer()
    gen = buf.feed(stream[:-5])  # the last event ([DONE]) cut short
    assert [next(gen), next(gen)] == expected[:2]
    gen.close()
    assert list(buf.feed(stream[-5:])) == expected[2:]


def test_event_buffer_readers_stopping_at_random_points_lose_and_repeat_nothing() -> None:
    rng = random.Random(7)
    stream = fake_stream()
    expected = events_of(stream)
    for _ in range(200):
        buf = sse.EventBuffer()
        got: list[bytes] = []
        for chunk in cut(stream, rng.sample(range(len(stream)), rng.randint(1, 12))):
            take = rng.randint(1, 3)
            for event in buf.feed(chunk):
                got.append(event)  # a yielded event is the reader's, even the last it takes
                take -= 1
                if take == 0:
                    break
        got += feed_all(buf, [b""])  # the end of the stream: whatever is still pending
        assert got == expected


def test_event_buffer_accepts_crlf_line_ends_split_at_every_offset() -> None:
    lf = fixture("vllm_chat_stream.txt")
    crlf = lf.replace(b"\n", b"\r\n")
    expected = events_of(lf)
    assert feed_all(sse.EventBuffer(), [crlf]) == expected
    for offset in range(len(crlf) + 1):
        assert feed_all(sse.EventBuffer(), cut(crlf, [offset])) == expected, offset


def test_event_buffer_joins_a_crlf_split_between_two_feeds() -> None:
    buf = sse.EventBuffer()
    assert list(buf.feed(b'data: {"a":1}\r\n\r')) == []
    assert list(buf.feed(b'\ndata: {"b":2}\r')) == [b'data: {"a":1}']
    assert list(buf.feed(b"\n\r\n")) == [b'data: {"b":2}']


def test_event_buffer_accepts_crlf_after_a_reader_stopped_early() -> None:
    crlf = fixture("vllm_chat_stream_error.txt").replace(b"\n", b"\r\n")
    expected = events_of(fixture("vllm_chat_stream_error.txt"))
    buf = sse.EventBuffer()
    assert first_event(buf, crlf[:-3]) == expected[0]
    assert list(buf.feed(crlf[-3:])) == expected[1:]


# ---------------------------------------------------------------------------- parse_event


def test_parse_event_reads_each_fixture_event_as_its_json() -> None:
    events = events_of(fixture("vllm_chat_stream.txt"))
    objs = [sse.parse_event(e) for e in events]
    assert objs[-1] is sse.DONE
    for event, obj in zip(events[:-1], objs[:-1], strict=True):
        assert obj == json.loads(event[len(b"data: ") :])
        assert obj["object"] == "chat.completion.chunk"


def test_parse_event_reads_the_spaced_error_event() -> None:
    events = events_of(fixture("vllm_chat_stream_error.txt"))
    assert sse.parse_event(events[-2])["error"]["code"] == 500
    assert sse.parse_event(events[-1]) is sse.DONE


def test_parse_event_accepts_data_without_a_space_and_other_fields() -> None:
    assert sse.parse_event(b'data:{"a":1}') == {"a": 1}
    assert sse.parse_event(b'event: message\nid: 3\ndata: {"a":1}') == {"a": 1}
    assert sse.parse_event(b"data:[DONE]") is sse.DONE


def test_parse_event_of_a_comment_only_event_is_none() -> None:
    assert sse.parse_event(b": ping") is None
    assert sse.parse_event(b": keep-alive\n: another") is None
    assert sse.parse_event(b"") is None


def test_parse_event_joins_multi_line_data_with_newlines() -> None:
    assert sse.event_data(b"data: one\ndata: two") == b"one\ntwo"
    assert sse.parse_event(b'data: {"a":\ndata: [1,\ndata: 2]}') == {"a": [1, 2]}
    # The newline is part of the payload: a string split across lines is not valid JSON.
    assert sse.parse_event(b'data: {"a": "x\ndata: y"}') is None


def test_parse_event_of_invalid_json_is_none() -> None:
    assert sse.parse_event(b"data: {not json") is None
    assert sse.parse_event(b'data: {"choices": [}') is None
    assert sse.parse_event(b"data: \xff\xfe") is None


@pytest.mark.parametrize(
    "data",
    [
        b'{"a":1,"a":2}',  # the last of a repeated key
        b"12345678901234567890123456789",  # beyond 64 bits
        b'{"x":NaN,"y":-Infinity}',  # json's extensions, which msgspec refuses
        b'"\\ud800"',  # a lone surrogate
        b"1e400",
        b' {"s":"caf\xc3\xa9"} ',
    ],
)
def test_decode_json_gives_what_json_loads_gives(data: bytes) -> None:
    want = json.loads(data)
    got = sse.decode_json(data)
    assert repr(got) == repr(want)  # repr: NaN != NaN


@pytest.mark.parametrize("data", [b"{not json", b"[1,]", b"", b"\xff"])
def test_decode_json_raises_value_error_for_what_is_not_json(data: bytes) -> None:
    with pytest.raises(ValueError):
        sse.decode_json(data)


# ---------------------------------------------------------------------------- chunk facts


def chunk(delta: dict | None = None, **choice: object) -> dict:
    c: dict = {"index": 0, **choice}
    if delta is not None:
        c["delta"] = delta
    return {"object": "chat.completion.chunk", "choices": [c]}


def test_carries_content_follows_the_fixture_stream() -> None:
    objs = [sse.parse_event(e) for e in events_of(fixture("vllm_chat_stream.txt"))]
    flags = [sse.carries_content(o) for o in objs]
    # Role chunk, content chunks, finish chunk (content ""), usage chunk (no choices), [DONE].
    assert flags[0] is False
    assert all(flags[1:-3])
    assert flags[-3:] == [False, False, False]


@pytest.mark.parametrize(
    "obj",
    [
        chunk({"content": ""}),
        chunk({"content": None}),
        chunk({"role": "assistant"}),
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": []}),
        chunk({}, finish_reason="stop"),
        chunk(text=""),
        {"choices": [], "usage": {"total_tokens": 3}},
        {"choices": "x"},
        {"choices": [None, 3, "x"]},
        {"choices": [{"delta": "content"}]},
        {"error": {"message": "boom"}},
        None,
        sse.DONE,
        "data",
        [chunk({"content": "x"})],
    ],
)
def test_carries_content_is_false_without_content(obj: object) -> None:
    assert sse.carries_content(obj) is False


@pytest.mark.parametrize(
    "obj",
    [
        chunk({"content": "x"}),
        chunk({"role": "assistant", "content": "Hi"}),
        chunk({"reasoning_content": "thinking"}),
        chunk({"reasoning": "thinking"}),
        chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ""}}]}),
        chunk({"audio": {"data": "AAAA"}}),
        chunk(text="x"),  # completions
        {"choices": [{"index": 0, "delta": {"content": ""}}, {"index": 1, "text": "y"}]},
    ],
)
def test_carries_content_is_true_with_content(obj: object) -> None:
    assert sse.carries_content(obj) is True


def test_is_error_only_for_an_error_object_without_choices() -> None:
    error_event = events_of(fixture("vllm_chat_stream_error.txt"))[-2]
    assert sse.is_error(sse.parse_event(error_event)) is True
    assert sse.is_error({"error": "boom"}) is True
    assert sse.is_error(chunk({"content": "x"})) is False
    assert sse.is_error({"error": None, "choices": []}) is False
    assert sse.is_error(sse.DONE) is False
    assert sse.is_error(None) is False
    assert sse.is_error(["error"]) is False


# ---------------------------------------------------------------------------- usage, errors


def test_last_usage_reads_the_usage_chunk_before_done() -> None:
    stream = fixture("vllm_chat_stream.txt")
    usage = {"prompt_tokens": 34, "total_tokens": 42, "completion_tokens": 8}
    assert sse.last_usage(stream) == usage
    assert sse.last_usage(stream[-600:]) == usage  # the relay keeps only a tail
    assert sse.last_usage(fixture("vllm_chat_stream_v0_11.txt")) == usage


def test_last_usage_of_a_long_fake_stream_tail() -> None:
    stream = b"".join(stream_events(300, usage=True))
    tail = stream[-2048:]
    assert sse.last_usage(tail) == {
        "prompt_tokens": 10,
        "completion_tokens": 300,
        "total_tokens": 310,
    }


def test_last_usage_takes_the_last_of_several_usage_chunks() -> None:
    # stream_options.continuous_usage_stats: every chunk carries the usage so far.
    events = [
        json.dumps({"choices": [{"delta": {"content": "x"}}], "usage": {"completion_tokens": n}})
        for n in (1, 2, 3)
    ]
    tail = b"".join(b"data: " + e.encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    assert sse.last_usage(tail) == {"completion_tokens": 3}


def test_last_usage_is_none_without_a_usage_chunk() -> None:
    assert sse.last_usage(b"".join(stream_events(20))) is None
    assert sse.last_usage(fixture("vllm_chat_stream_error.txt")) is None
    assert sse.last_usage(b"") is None
    # A tail that starts inside the usage event cannot be parsed: no guess.
    stream = fixture("vllm_chat_stream.txt")
    assert sse.last_usage(stream[stream.rfind(b'"usage"') - 10 :]) is None
    assert sse.last_usage(b'data: {"choices":[],"usage":null}\n\ndata: [DONE]\n\n') is None


def test_last_usage_reads_a_crlf_tail() -> None:
    crlf = fixture("vllm_chat_stream.txt").replace(b"\n", b"\r\n")
    assert sse.last_usage(crlf) == {"prompt_tokens": 34, "total_tokens": 42, "completion_tokens": 8}


def test_error_event_is_an_openai_error_then_done() -> None:
    raw = sse_error_event(StreamCut("replica went away"))
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    events = list(sse.EventBuffer().feed(raw))
    assert len(events) == 2
    obj = sse.parse_event(events[0])
    assert obj == {
        "error": {
            "message": "replica went away",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }
    assert sse.is_error(obj)
    assert sse.parse_event(events[1]) is sse.DONE


def test_error_event_carries_the_given_code_and_escapes_the_message() -> None:
    err_in = StreamCut('a "quoted"\nline', code=504)
    events = list(sse.EventBuffer().feed(sse_error_event(err_in)))
    err = sse.parse_event(events[0])["error"]
    assert (err["message"], err["type"], err["code"]) == (
        'a "quoted"\nline',
        "ServiceUnavailableError",
        504,
    )


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        # vLLM's end of a stream: the finishing chunk, the usage chunk, [DONE]
        (
            b'ta: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
            b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\ndata: [DONE]\n\n',
            ["length"],
        ),
        # n = 2: each choice ends in its own chunk
        (
            b'data: {"choices":[{"index":1,"delta":{},"finish_reason":"stop"}]}\r\n\r\n'
            b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\r\n\r\n',
            ["stop", "length"],
        ),
        (b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n', []),
        (b"", []),
        (b'"finish_reason":"stop"}]}\n\n', []),  # the tail began mid-event
    ],
)
def test_last_finish_reasons(tail: bytes, expected: list[str]) -> None:
    assert sse.last_finish_reasons(tail) == expected


def test_finish_reasons_of_a_plain_response() -> None:
    answer = {"choices": [{"finish_reason": "stop"}, {"finish_reason": None}, "junk"]}
    assert sse.finish_reasons_of(answer) == ["stop"]
    assert sse.finish_reasons_of({"choices": "x"}) == sse.finish_reasons_of([]) == []


async def test_reads_give_a_reader_that_stopped_early_the_rest_before_the_next_read() -> None:
    """``EventBuffer.reads``: after a read whose events a reader left pending (it stopped at
    the first), an empty read comes for them, then the next read; a pending unfinished event
    waits for the read that ends it."""

    async def two_reads() -> AsyncIterator[bytes]:
        yield b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4"
        yield b"\n\n"

    buf = sse.EventBuffer()
    seen: list[tuple[bytes, list[bytes]]] = []
    async for chunk in buf.reads(two_reads()):
        taken: list[bytes] = []
        for event in buf.feed(chunk):
            taken.append(event)
            if not chunk:
                continue
            break  # the first of a read only: the rest comes with an empty read
        seen.append((chunk, taken))
    assert seen == [
        (b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4", [b"data: 1"]),
        (b"", [b"data: 2", b"data: 3"]),  # "data: 4" is not ended yet: no more empty reads
        (b"\n\n", [b"data: 4"]),
    ]


async def test_reads_ended_or_raised_are_over() -> None:
    """``EventBuffer.reads`` ends for good when its reads end or raise, as a generator does:
    it never asks them again (reads from a connection that went on to serve another request
    would hand over that request's bytes)."""

    class Reads:
        """One read, then the end or an error, then whatever is asked again: a late read."""

        def __init__(self, fail: bool) -> None:
            self.fail = fail
            self.asked = 0

        def __aiter__(self) -> Reads:
            return self

        async def __anext__(self) -> bytes:
            self.asked += 1
            if self.asked == 1:
                return b"data: 1\n\n"
            if self.asked == 2:
                raise ConnectionResetError if self.fail else StopAsyncIteration
            return b"data: late\n\n"

    for fail in (False, True):
        inner = Reads(fail)
        it = sse.EventBuffer().reads(inner)
        assert await it.__anext__() == b"data: 1\n\n"
        with pytest.raises(ConnectionResetError if fail else StopAsyncIteration):
            await it.__anext__()
        with pytest.raises(StopAsyncIteration):
            await it.__anext__()
        assert inner.asked == 2


@pytest.mark.parametrize(
    ("data", "start", "want"),
    [
        (b"data: {}\n\n", 0, 8),
        (b"data: {}\n\ndata: {}\n\n", 10, 18),
        (b"data: {}\n", 0, -1),  # its end may be in the next read
        (b"event: x\ndata: {}\n\n", 0, 17),  # a line end that does not end the event
        (b"\n\n", 0, 0),
        (b"a\nb\nc\n\n", 0, 5),
        (b"a\n\n", 2, -1),  # from the second "\n": the pair is before it
        (b"", 0, -1),
    ],
)
def test_event_end_is_the_first_blank_line(data: bytes, start: int, want: int) -> None:
    assert sse.event_end(data, start) == want == data.find(b"\n\n", start)


def test_event_end_agrees_with_a_two_byte_search() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        data = bytes(rng.choice(b"ab\n") for _ in range(rng.randrange(12)))
        start = rng.randrange(len(data) + 1)
        assert sse.event_end(data, start) == data.find(b"\n\n", start), (data, start)


@pytest.mark.parametrize(
    ("kind", "end", "complete"),
    [
        ("chat", b'data: {"choices":[]}\n\ndata: [DONE]\n\n', True),
        ("chat", b'data: {"choices":[]}\n\n', False),
        ("completions", b"x" * 20_000 + b"data: [DONE]\n\n", True),  # a whole stream, one read
        ("chat", b"data: [DONE]" + b"\n" * 600, True),  # more whitespace than the last bytes
        ("chat", b"data: [DONE]" + b"\n" * 252, True),  # the last bytes cut [DONE] in two
        ("chat", b"x" * 300 + b"data: [DONE]" + b"\n" * 255, True),
        ("chat", b"x" * 300 + b"data: [DONE]" + b"\n" * 244, True),
        ("chat", b"data: [DONE]\n\ndata: {}" + b" " * 300, False),
        ("chat", b"", False),
        ("chat", b"   \n", False),
        ("messages", b"event: message_stop\ndata: {}\n\n" + b" " * 300, True),
        ("messages", b"event: content_block_delta\ndata: {}\n\n", False),
        ("responses", b'event: error\ndata: {"type": "error"}\n\n', True),
    ],
)
def test_stream_complete_looks_at_the_end_only_as_far_as_it_must(
    kind: str, end: bytes, complete: bool
) -> None:
    assert sse.stream_complete(kind, end) is complete


@pytest.mark.parametrize(
    ("data", "part"),
    [(b"abc", b"b"), (b"abc", b"d"), (b"", b""), (b"", b"a"), (b"a\r\nb", b"\r"), (b"x", b"")],
)
def test_contains_is_bytes_in(data: bytes, part: bytes) -> None:
    assert sse.contains(data, part) is (part in data)


def test_stream_complete_of_chat_says_what_stripping_the_whole_end_says() -> None:
    rnd = random.Random(7)
    pieces = [b"x", b" ", b"\n", b"data: [DONE]", b"[DONE]", b"\t", b"]"]
    for _ in range(20_000):
        end = b"".join(rnd.choice(pieces) for _ in range(rnd.randrange(60)))
        end += b"\n" * rnd.randrange(300)
        assert sse.stream_complete("chat", end) is end.rstrip().endswith(sse.DONE), end
