"""The continuation relay's unparsed path (``Splice.learn_template``, ``take_chunk`` and
``take_event``): an ordinary token chunk read without parsing it must note exactly what parsing
it would, and be relayed exactly as ``strip_ids`` would write it; anything else is left to
the parser."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.sim.formats import StreamFormat
from proxy import compiled
from proxy.fleet.replica import make_replica
from proxy.observe.metrics import Metrics
from proxy.policyfile import build_policy
from proxy.relay.call import Attempt, Call
from proxy.relay.continuation import (
    ROLE,
    SCAN,
    TAKE,
    Shapes,
    Splice,
    ids_end,
    match_role,
    plain_ids,
    scan_events,
    strip_ids,
    take_token,
)
from proxy.relay.resume import _TokenRelay
from proxy.relay.sse import EventBuffer

from .gateway import policy_for

BODY: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "stream": True}


def compact(obj: dict[str, Any]) -> bytes:
    # vLLM writes compact JSON with non-ASCII text as itself
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def chat_chunk(
    content: Any, ids: list[int] | None, finish: str | None = None, **extra: Any
) -> bytes:
    delta = {} if content is None else {"content": content}
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": finish}  # fmt: skip
    if ids is not None:
        choice["token_ids"] = ids
    choice.update(extra.pop("choice", {}))
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return compact({**head, "choices": [choice], **extra})


def completion_chunk(text: str, ids: list[int]) -> bytes:
    return compact({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None,
                                 "stop_reason": None, "prompt_token_ids": None,
                                 "token_ids": ids}]})  # fmt: skip


FIRST = {"chat": chat_chunk("Hi", [7]), "completion": completion_chunk("Hi", [7])}


def learned(kind: str = "chat") -> Splice:
    """A stream that has parsed its first token chunk (and learned its template from it)."""
    sp = Splice(kind, BODY, False)
    obj = json.loads(FIRST[kind][6:])
    sp.observe(obj)
    sp.learn_template(FIRST[kind], obj)
    assert sp.head is not None
    return sp


def note(sp: Splice) -> tuple[Any, ...]:
    return sp.ids, sp.text_ids, sp.reasoning_open, sp.finish_reason, sp.tool_call


def both_ways(ev: bytes, kind: str) -> tuple[Any, Any]:
    """(what parsing notes and writes, what the unparsed path notes and writes)."""
    parsed, fast = learned(kind), learned(kind)
    parsed.observe(json.loads(ev[6:]))
    found = fast.take_chunk(ev + b"\n\n", True)
    assert found is not None, ev
    out = found[0][:-2]  # what goes to the client
    return (note(parsed), strip_ids(ev)), (note(fast), out)


@pytest.mark.parametrize(
    ("event", "kind", "taken"),
    [
        (chat_chunk(" word", [12]), "chat", (True, [7, 12])),
        (chat_chunk("", [12, 13]), "chat", (False, [7, 12, 13])),  # a character's first bytes
        (chat_chunk("", []), "chat", (False, [7])),
        (completion_chunk(" a", [5]), "completion", (True, [7, 5])),
        (completion_chunk("", [5]), "completion", (False, [7, 5])),
        # left to the parser:
        (chat_chunk(None, [1]), "chat", None),  # no text key (a None delta)
        (chat_chunk("x", [1], "stop"), "chat", None),  # finished
        (chat_chunk("x", [1], "abort"), "chat", None),
        (chat_chunk("x", None), "chat", None),  # no ids
        (chat_chunk("x", [1], prompt_token_ids=[1, 2]), "chat", None),
        (chat_chunk("x", [1], usage={"prompt_tokens": 1}), "chat", None),
        (chat_chunk("x", [1], system_fingerprint="fp"), "chat", None),
        (chat_chunk("x", [1], choice={"delta": {"content": "x", "tool_calls": []}}), "chat", None),
        (chat_chunk("x", [1], choice={"delta": {"reasoning_content": "hm"}}), "chat", None),
        (chat_chunk('say "x"', [1]), "chat", None),  # a quote in the text
        (chat_chunk("x\\", [1]), "chat", None),  # a backslash at its end
        (b'data: {"error":{"message":"x","code":500}}', "chat", None),
        (b"data: [DONE]", "chat", None),
        (b": keep-alive", "chat", None),
        (chat_chunk("x", [1]).replace(b"[1]", b"[1, 2]"), "chat", None),
        (chat_chunk("x", [1]).replace(b"[1]", b"[1,,2]"), "chat", None),
        (chat_chunk("x", [1]).replace(b"[1]", b"[1,]"), "chat", None),
        (chat_chunk("x", [1]).replace(b"[1]", b'["a"]'), "chat", None),
        (chat_chunk("x", [1]).replace(b"[1]", b"[007]"), "chat", None),  # not JSON
        (chat_chunk("x", [1]).replace(b"[1]", b"[" + b"9" * 5000 + b"]"), "chat", None),
        (chat_chunk("x", [1]).replace(b"[1]", b"[1," + b"9" * 5000 + b"]"), "chat", None),
        (chat_chunk("x", [1]).replace(b'"created":1', b'"created":2'), "chat", None),
    ],
)
def test_only_ordinary_token_chunks_go_unparsed(event: bytes, kind: str, taken: Any) -> None:
    sp = learned(kind)
    found = sp.take_chunk(event + b"\n\n", False)
    if taken is None:
        assert found is None
        assert sp.ids == [7]  # nothing noted: the parser notes it
        return
    assert found is not None
    assert found[0] == event + b"\n\n"  # relayed as it came: the client asked for the ids
    assert (found[1], sp.ids) == taken


def test_a_token_with_text_is_taken_alone_and_one_without_is_left_to_take_chunk() -> None:
    """``take_token`` (the relay's every token) notes what ``take_chunk`` notes of a chunk
    with text and makes only the event; a chunk without text, or anything that is not one
    token chunk, it leaves untouched."""
    sp = learned()  # [7], parsed
    plain = chat_chunk(" b", [9, 10]) + b"\n\n"
    assert sp.take_token(plain, True) == strip_ids(plain[:-2]) + b"\n\n"
    assert (sp.ids, sp.text_ids) == ([7, 9, 10], 3)
    assert sp.take_token(plain, False) is plain  # the client asked for the ids: as it came
    assert (sp.ids, sp.text_ids) == ([7, 9, 10, 9, 10], 5)
    assert sp.lists[1:] == [bytearray(b"9,10,9,10")]  # token after token: one bytearray
    no_text = chat_chunk("", [240]) + b"\n\n"
    others = [no_text, plain[:-1], plain + plain, chat_chunk("", [], "stop") + b"\n\n"]
    for other in others:
        assert sp.take_token(other, True) is None, other
    assert (sp.ids, sp.text_ids) == ([7, 9, 10, 9, 10], 5)  # nothing noted
    assert sp.take_chunk(no_text, True) == (strip_ids(no_text[:-2]) + b"\n\n", False)
    assert (sp.ids, sp.text_ids) == ([7, 9, 10, 9, 10, 240], 5)
    # After a token without text, the next with text starts a bytearray of its own: the
    # shown ids end where a list does.
    assert sp.take_token(chat_chunk("🙂", [128]) + b"\n\n", True) is not None
    assert (sp.ids, sp.text_ids) == ([7, 9, 10, 9, 10, 240, 128], 7)
    assert sp.take_token(plain, True) is not None
    assert (sp.ids, sp.text_ids) == ([7, 9, 10, 9, 10, 240, 128, 9, 10], 9)  # read again: grown
    assert Splice("chat", BODY, False).take_token(plain, True) is None  # no template yet


def test_two_events_in_one_read_are_not_one_token_chunk_but_each_is_one() -> None:
    sp = learned()
    two = chat_chunk("a", [1]) + b"\n\n" + chat_chunk("b", [2]) + b"\n\n"
    assert sp.take_chunk(two, False) is None
    assert sp.ids == [7]
    for ev in two.split(b"\n\n")[:2]:
        assert sp.take_event(ev, False) == (ev + b"\n\n", True)
    assert sp.ids == [7, 1, 2]


def test_ids_noted_as_they_came_read_the_same_at_any_point() -> None:
    """``Splice`` keeps each chunk's ids as it came and decodes them when read (at a seam):
    a read between notes sees every note before it, parsed or not."""
    sp = learned()  # [7], parsed
    assert (sp.ids, sp.text_ids) == ([7], 1)
    assert sp.take_chunk(chat_chunk("", [240, 159]) + b"\n\n", True) is not None  # no text
    assert (sp.ids, sp.text_ids) == ([7, 240, 159], 1)
    parsed = json.loads(chat_chunk("", [152])[6:])
    sp.observe(parsed)  # parsed, no text either
    parsed["choices"][0]["token_ids"].append(0)  # the caller's object: noted as it was
    assert (sp.ids, sp.text_ids) == ([7, 240, 159, 152], 1)
    assert sp.take_chunk(chat_chunk("🙂", [128]) + b"\n\n", True) is not None
    assert (sp.ids, sp.text_ids) == ([7, 240, 159, 152, 128], 5)
    sp.ids.append(1)  # a copy: what is read cannot change what was noted
    assert sp.ids == [7, 240, 159, 152, 128]
    read = b"".join(chat_chunk(f" {i}", [i, i + 1]) + b"\n\n" for i in (20, 30))
    assert sp.take_run(read, 0, True) is not None
    assert (sp.ids, sp.text_ids) == ([7, 240, 159, 152, 128, 20, 21, 30, 31], 9)
    assert sp.take_chunk(chat_chunk("", [240]) + b"\n\n", True) is not None
    assert sp.text_ids == 9
    sp.observe(json.loads(chat_chunk("", [], "length")[6:]))  # the finish: no ids, all shown
    assert (sp.ids[-1], sp.text_ids) == (240, 10)


def test_a_read_that_stops_before_its_events_end_is_not_a_token_chunk() -> None:
    """Its ``\\n\\n`` may be in the next read: taken now, the event would end twice."""
    sp = learned()
    assert sp.take_chunk(chat_chunk("a", [1]), True) is None
    assert sp.take_chunk(chat_chunk("a", [1]) + b"\n", True) is None
    assert sp.ids == [7]


@pytest.mark.parametrize(
    "first",
    [
        chat_chunk("", [], choice={"delta": {"role": "assistant", "content": ""}}),  # role chunk
        chat_chunk("x", [1], "stop"),
        chat_chunk('a "quote"', [1]),
        chat_chunk("x", [1], usage={"prompt_tokens": 1}),
        chat_chunk("x", [1], choice={"logprobs": {"content": []}}),
    ],
)
def test_no_template_is_learned_from_other_chunks(first: bytes) -> None:
    sp = Splice("chat", BODY, False)
    sp.learn_template(first, json.loads(first[6:]))
    assert sp.head is None


def test_the_simulators_chunks_are_learned_and_read_unparsed() -> None:
    """The simulator writes chunks as vLLM does (loadtest/sim/formats.py)."""
    for kind in ("chat", "completion"):
        w = StreamFormat(
            kind, "r1", 1, "m", "fp", include_usage=False, continuous_usage=False, token_ids=True
        )
        first = w.token(0, "Hi", 3, 1, ids=[7], prompt_ids=None).encode()
        second = w.token(0, " there", 3, 2, ids=[8, 9]).encode()
        sp = Splice(kind, BODY, False)
        sp.learn_template(first[:-2], json.loads(first[6:-2]))
        assert sp.take_chunk(second, True) is not None, kind


# Text that looks like the keys and bytes the unparsed path looks for.
TRICKY = st.sampled_from(['"token_ids":[1]', '"finish_reason":null', '"error"', "\\", '"',
                          '"},"logprobs":null', "]}]}", "]", ",", "é", "🙂", "\n"])  # fmt: skip
TEXT = st.lists(st.one_of(st.text(max_size=5), TRICKY), max_size=6).map("".join)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(text=TEXT, ids=st.lists(st.integers(0, 2**31), max_size=4))
def test_the_unparsed_path_notes_and_writes_what_parsing_does(text: str, ids: list[int]) -> None:
    for ev, kind in ((chat_chunk(text, ids), "chat"), (completion_chunk(text, ids), "completion")):
        if learned(kind).take_chunk(ev + b"\n\n", True) is None:
            assert '"' in text or text.endswith("\\"), text  # only these are left to parsing
            continue
        parsed, fast = both_ways(ev, kind)
        assert fast == parsed


# ------------------------------------------------------------------- runs (Splice.take_run)


def relayed(
    sp: Splice, read: bytes, runs: bool, strip: bool = True
) -> tuple[bytes, tuple[Any, ...]]:
    """What ``Resumer.relay``'s loop writes and notes for one read, taking runs or not; an
    event the unparsed path declines is written as it came (the parser's part, not tested
    here)."""
    events = EventBuffer()
    out: list[bytes] = []
    for ev in events.feed(read):
        if (token := sp.take_event(ev, strip)) is None:
            out.append(ev + b"\n\n")
            continue
        out.append(token[0])
        if runs and (run := sp.take_run(*events.pending(), strip)) is not None:
            out.append(run[0])
            events.advance(run[1])
    return b"".join(out), note(sp)


OTHER = st.sampled_from([
    chat_chunk("x", [1], "stop"),
    chat_chunk("", [3, 4]),  # a character's first bytes: no text
    chat_chunk("", []),
    chat_chunk('a "quote"', [5]),
    chat_chunk("x", [1]).replace(b"[1]", b"[007]"),
    chat_chunk("x", [1]).replace(b"[1]", b"[1," + b"9" * 40 + b"]"),
    chat_chunk("x", [1]).replace(b'"created":1', b'"created":2'),
    b": keep-alive",
])  # fmt: skip
TOKEN = st.builds(chat_chunk, TEXT, st.lists(st.integers(0, 2**31), max_size=3))


COMPLETION_TOKEN = st.builds(completion_chunk, TEXT, st.lists(st.integers(0, 2**31), max_size=3))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    events=st.lists(st.one_of(TOKEN, TOKEN, TOKEN, OTHER), max_size=12),
    strip=st.booleans(),
    crlf=st.booleans(),
)
def test_a_run_notes_and_writes_what_its_events_one_by_one_do(
    events: list[bytes], strip: bool, crlf: bool
) -> None:
    read = b"".join(ev + b"\n\n" for ev in events) + b"data: {"  # and an unfinished event
    if crlf:  # as other servers may end lines; the buffer reads them as "\n"
        read = read.replace(b"\n", b"\r\n")
    ways = [relayed(learned(), read, runs, strip) for runs in (True, False)]
    assert ways[0] == ways[1]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(events=st.lists(st.one_of(COMPLETION_TOKEN, COMPLETION_TOKEN, OTHER), max_size=12))
def test_a_completions_run_notes_and_writes_what_its_events_one_by_one_do(
    events: list[bytes],
) -> None:
    read = b"".join(ev + b"\n\n" for ev in events)
    ways = [relayed(learned("completion"), read, runs) for runs in (True, False)]
    assert ways[0] == ways[1]


def test_a_run_takes_the_token_chunks_up_to_the_first_other_event() -> None:
    tokens = [chat_chunk(f" t{i}", [10 + i]) for i in range(5)]
    finish = chat_chunk("", [], "length")
    read = b"".join(ev + b"\n\n" for ev in [*tokens, finish, b"data: [DONE]"])
    sp = learned()
    run = sp.take_run(read, 0, True)
    assert run is not None
    assert run[1] == read.index(finish)  # it stops where the finish begins
    assert run[0] == b"".join(strip_ids(ev) + b"\n\n" for ev in tokens)
    assert (sp.ids, sp.text_ids) == ([7, 10, 11, 12, 13, 14], 6)
    assert sp.take_run(read, run[1], True) is None  # the finish is the parser's
    assert sp.ids == [7, 10, 11, 12, 13, 14]


@pytest.mark.parametrize(
    "bad",
    [
        chat_chunk("x", [1]).replace(b"[1]", b"[007]"),
        chat_chunk("x", [1]).replace(b"[1]", b"[1," + b"9" * 5000 + b"]"),
        chat_chunk("x", [1]).replace(b"[1]", b"[1" + b"0" * 18 + b"]"),  # 19 digits
        chat_chunk("x", [1]).replace(b"[1]", b"[1,02]"),
        chat_chunk("x", [1]).replace(b"[1]", b"[1,,2]"),
        chat_chunk("x", [1]).replace(b"[1]", b"[1,]"),
        chat_chunk("x", [1]).replace(b"[1]", b"[,1]"),
        chat_chunk("x", [1]).replace(b"[1]", b"[1 ]"),
        chat_chunk("", [2]),
    ],
)
def test_a_run_ends_before_a_chunk_that_is_not_plainly_one(bad: bytes) -> None:
    good = chat_chunk(" a", [1])
    read = good + b"\n\n" + good + b"\n\n" + bad + b"\n\n" + good + b"\n\n"
    sp = learned()
    run = sp.take_run(read, 0, False)
    assert run == (read[: 2 * len(good) + 4], 2 * len(good) + 4)
    assert sp.ids == [7, 1, 1]
    assert sp.take_run(read, run[1], False) is None
    assert sp.ids == [7, 1, 1]


@pytest.mark.parametrize(
    "end",
    [b"]}]}\n", b"]}]}\r\n\r\n", b"]}]\n\n", b"]}]}}\n\n", b"]]}}\n\n", b"]}]}\n \n", b"]"],
)
def test_a_run_ends_at_an_event_whose_end_is_not_the_token_chunks(end: bytes) -> None:
    good = chat_chunk(" a", [1])
    odd = chat_chunk(" b", [2])[: -len(b"]}]}")] + end
    read = good + b"\n\n" + odd
    sp = learned()
    assert sp.take_run(read, 0, False) == (good + b"\n\n", len(good) + 2)
    assert sp.ids == [7, 1]


def test_a_run_takes_ids_at_the_edges_of_plain() -> None:
    """Zeros alone, 18 digits, several ids: plain, as vLLM writes them (``plain_ids``)."""
    edges = [[0], [0, 0, 10], [10**17, 999_999_999_999_999_999], []]
    events = [chat_chunk(f" e{i}", ids) for i, ids in enumerate(edges)]
    read = b"".join(ev + b"\n\n" for ev in events)
    sp = learned()
    run = sp.take_run(read, 0, False)
    assert run == (read, len(read))
    assert sp.ids == [7, 0, 0, 0, 10, 10**17, 999_999_999_999_999_999]


# ---------------------------------------------------------------- plain ids (ids_end)

# The rule as a regular expression, to hold the scan to: each id 1 to 18 digits, no leading
# zero, one comma between two (an empty list is plain).
PLAIN = re.compile(rb"(?:(?:0|[1-9][0-9]{0,17})(?:,(?:0|[1-9][0-9]{0,17}))*)?")


@pytest.mark.parametrize(
    ("ids", "end"),
    [
        (b"", 0), (b"0", 1), (b"7", 1), (b"0,0,10", 6), (b"9" * 18, 18), (b"1,22]", 4),
        (b"1" + b"0" * 18, -1), (b"007", -1), (b"1,02", -1), (b"1,,2", -1), (b"1,", -1),
        (b",1", -1), (b"1 ]", 1),
    ],
)  # fmt: skip
def test_ids_end_finds_where_plain_ids_end(ids: bytes, end: int) -> None:
    assert ids_end(ids, 0, len(ids)) == end


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.binary(max_size=48).map(lambda b: bytes(b"0123456789,"[x % 11] for x in b)))
def test_plain_ids_is_the_rule(ids: bytes) -> None:
    assert plain_ids(ids) is (PLAIN.fullmatch(ids) is not None)


class _Writer:
    """The server's direct body writer, recording what it is given."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def start(self, send: Any, message: Any) -> bool:
        return False

    def direct(self) -> bool:
        return True

    def write_body(self, data: bytes) -> bool:
        self.written.append(data)
        return True

    def end(self, data: bytes) -> bool:
        self.written.append(data)
        return True


def _token_relay(
    wants_usage: bool, shapes: Shapes | None = None, role: bytes | None = None
) -> tuple[Any, Splice, _Writer]:
    """An eligible stream's pump handler after its start, as ``Resumer.relay`` makes it."""
    policy = build_policy(policy_for({"p": ["http://127.0.0.1:9"]}))
    call = Call(request_id="r", kind="chat", path="/v1/chat/completions", body=b"{}",
                headers=[], stream=True, model="m", lane=policy.lanes[0], profile=None,
                wants_usage=wants_usage, received_at=0.0)  # fmt: skip
    replica = make_replica("p", policy.pools["p"].replicas[0], {})
    sp = Splice("chat", BODY, wants_usage, shapes)
    if role is None:
        role = chat_chunk("", [], prompt_token_ids=[1, 2])
    sp.observe(json.loads(role[6:]))  # the role chunk
    writer = _Writer()
    call.body_writer = writer
    flow = _TokenRelay(call, Attempt(replica, None), Metrics(), sp, EventBuffer(), strip=True)
    flow.started()
    return flow, sp, writer


def test_the_pump_handler_notes_and_writes_single_events_that_decide_nothing() -> None:
    """After the start, a read that is one event the relay's loop would only note and relay
    is written from the connection's callback (the loop's task is not woken): an ordinary
    token chunk unparsed, and parsed ones: a text holding a quote (no template for it), the
    finish, the usage. What the loop decides on is handed back untouched: [DONE], an error,
    the engine's abort, a comment, two events in one read that are not token chunks."""
    flow, sp, writer = _token_relay(wants_usage=True)
    quoted = chat_chunk('say "hi"', [7]) + b"\n\n"  # no template yet: parsed, and learns none
    first = chat_chunk(" a", [8]) + b"\n\n"  # parsed: the template is learned from it
    plain = chat_chunk(" b", [9]) + b"\n\n"  # unparsed (take_chunk)
    finish = chat_chunk("", [], "stop") + b"\n\n"
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    last = compact({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                    "model": "m", "choices": [], "usage": usage}) + b"\n\n"  # fmt: skip
    for chunk in (quoted, first, plain, finish, last):
        assert flow(chunk) is None, chunk
    assert writer.written == [
        strip_ids(c[:-2]) + b"\n\n" for c in (quoted, first, plain, finish, last)
    ]
    assert b'"token_ids":[' not in b"".join(writer.written)  # the client did not ask
    assert sp.ids == [7, 8, 9] and sp.text_ids == 3 and sp.finish_reason == "stop"
    assert sp.head is not None and flow.call.usage == usage
    assert flow.call.content_chunks == 3  # the three texts, as the loop counts them
    handed_back = [
        b"data: [DONE]\n\n",
        b'data: {"error":{"message":"engine died","type":"Error","param":null,"code":500}}\n\n',
        chat_chunk("", [], "abort") + b"\n\n",
        b": keep-alive\n\n",
        finish + last,
        plain[:-1],  # not a whole event yet
    ]
    for chunk in handed_back:
        assert flow(chunk) == chunk, chunk
    assert sp.ids == [7, 8, 9] and sp.finish_reason == "stop" and len(writer.written) == 5


def _of_stream(chunk: bytes, n: int) -> bytes:
    """``chunk`` as stream ``n`` sends it: its own id and created."""
    return chunk.replace(b'"chatcmpl-1"', b'"chatcmpl-%d"' % n).replace(
        b'"created":1,', b'"created":%d,' % (1000 + n)
    )


def test_a_stream_takes_its_first_token_unparsed_with_a_template_made_from_the_last() -> None:
    """The template learned by one stream is kept without its id and created (``Shapes``):
    the next stream of the model makes its own from its role chunk, and its first token goes
    unparsed. A chunk of another stream (another id) does not match it."""
    shapes = Shapes()
    role = chat_chunk("", [], prompt_token_ids=[1, 2])
    flow, sp, _ = _token_relay(False, shapes, role)
    assert sp.head is None  # nothing kept yet: the first token is parsed, and learned
    first = chat_chunk(" a", [8]) + b"\n\n"
    assert flow(first) is None and sp.head is not None and not sp.guessed
    flow2, sp2, writer2 = _token_relay(False, shapes, _of_stream(role, 2))
    assert sp2.guessed and sp2.head == _of_stream(sp.head, 2) and sp2.tail == sp.tail
    assert sp2.take_token(first, True) is None  # stream 1's chunk: its id is not stream 2's
    mine = _of_stream(first, 2)
    assert flow2(mine) is None
    assert writer2.written == [strip_ids(mine[:-2]) + b"\n\n"]
    assert (sp2.ids, sp2.text_ids, sp2.guessed) == ([8], 1, False)
    # Another model, or an id a writer escapes: nothing made.
    other = _of_stream(role, 3).replace(b'"model":"m"', b'"model":"m2"')
    assert _token_relay(False, shapes, other)[1].head is None
    quoted = _of_stream(role, 4).replace(b'"chatcmpl-4"', b'"chat\\"cmpl"')
    assert json.loads(quoted[6:])["id"] == 'chat"cmpl'
    assert _token_relay(False, shapes, quoted)[1].head is None


HEAD = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
HEAD += b'"choices":[{"index":0,"delta":{"content":"'
TAIL = b'"},"logprobs":null,"finish_reason":null,"token_ids":['


@pytest.mark.parametrize(
    ("head", "chunk_id", "created", "kept"),
    [
        (HEAD, "chatcmpl-1", 1, True),
        (HEAD, "chatcmpl-2", 1, False),  # the head is not of this id
        (HEAD, "chatcmpl-1", 2, False),  # nor of this created
        (HEAD, "chatcmpl-1", True, False),  # a bool is no created
        (HEAD, "chatcmpl-1", 1.0, False),
        (HEAD.replace(b"chatcmpl-1", b'chat\\"1'), 'chat"1', 1, False),  # escaped
        (HEAD.replace(b"chatcmpl-1", b"chat\\u00011"), "chat\x011", 1, False),
        (HEAD.replace(b'"created":1,', b'"created": 1,'), "chatcmpl-1", 1, False),
        (HEAD.replace(b'"created":1,', b'"created":1.0,'), "chatcmpl-1", 1, False),
        (HEAD.replace(b'"created":1,', b'"created":10,'), "chatcmpl-1", 1, False),
        (HEAD.replace(b'"model":"m"', b'"model":"m","created":1'), "chatcmpl-1", 1, False),
        (b"data: " + HEAD[7:], "chatcmpl-1", 1, False),  # the id not first
        (HEAD.replace(b'"model":"m"', b'"model":"m","id":"x"'), "chatcmpl-1", 1, False),  # two
        (HEAD.replace(b'"m"', b'"' + b"m" * 5000 + b'"'), "chatcmpl-1", 1, False),  # too big
    ],
)
def test_a_template_is_kept_only_with_its_id_first_and_its_one_created(
    head: bytes, chunk_id: Any, created: Any, kept: bool
) -> None:
    shapes = Shapes()
    model = "m" * 5000 if b"m" * 5000 in head else "m"
    finishes = [(TAIL.replace(b"null", b'"stop"'), "stop")]
    shapes.learn("chat", model, chunk_id, created, head, TAIL, finishes)
    made = shapes.made("chat", model, "chatcmpl-9", 9)
    if not kept:
        assert made is None
        return
    assert made is not None and made[2] is finishes  # the finish tails go with the template
    assert made[:2] == (HEAD.replace(b"chatcmpl-1", b"chatcmpl-9").replace(b":1,", b":9,"), TAIL)
    # A new stream's id a writer would escape, or a created that is no int: nothing made.
    for bad_id, bad_created in [('a"b', 9), ("a\\b", 9), ("a\nb", 9), ("\ud800", 9),
                                ("x", True), ("x", "9"), (None, 9)]:  # fmt: skip
        assert shapes.made("chat", "m", bad_id, bad_created) is None, (bad_id, bad_created)
    assert shapes.made("completion", "m", "x", 9) is None  # another kind
    assert shapes.made("chat", "é", "x", 9) is None  # another model
    assert shapes.made("chat", "m", "é-1", 9) is not None  # UTF-8, as vLLM writes it


def test_templates_kept_are_bounded() -> None:
    shapes = Shapes()
    for i in range(300):
        shapes.learn("chat", f"m{i}", "chatcmpl-1", 1, HEAD, TAIL, [])
    assert shapes.made("chat", "m299", "x", 2) is not None
    assert shapes.made("chat", "m0", "x", 2) is None  # the memory started over past 256


def test_a_made_template_no_chunk_matches_is_replaced_by_the_streams_own() -> None:
    """A replica that writes its chunks otherwise (here its keys in another order) matches
    no made template: its first token is parsed and the stream learns its own, which is kept
    for the next stream in its place."""
    shapes = Shapes()
    role = chat_chunk("", [], prompt_token_ids=[1, 2])
    flow, sp, _ = _token_relay(False, shapes, role)
    assert flow(chat_chunk(" a", [8]) + b"\n\n") is None
    other = {"object": "chat.completion.chunk", "id": "chatcmpl-5", "created": 1005, "model": "m",
             "choices": [{"index": 0, "delta": {"content": " b"}, "logprobs": None,
                          "finish_reason": None, "token_ids": [9]}]}  # fmt: skip
    theirs = compact(other) + b"\n\n"
    flow5, sp5, writer5 = _token_relay(False, shapes, _of_stream(role, 5))
    assert sp5.guessed
    assert sp5.take_token(theirs, True) is None
    assert flow5(theirs) is None  # parsed, noted, and its template learned
    assert (sp5.ids, sp5.text_ids, sp5.guessed) == ([9], 1, False)
    assert sp5.head is not None and sp5.head.startswith(b'data: {"object"')
    assert writer5.written == [strip_ids(theirs[:-2]) + b"\n\n"]
    assert sp5.take_token(theirs, True) is not None  # the next token: unparsed
    # Its template has no id first, so it is not kept; the earlier one stays.
    assert _token_relay(False, shapes, _of_stream(role, 6))[1].head == _of_stream(sp.head, 6)


def test_token_chunks_that_came_in_one_read_go_out_in_one_write_and_the_rest_is_handed_back() -> (
    None
):
    """Tokens that arrived together (the replica's socket read once for several) are taken
    as the loop takes a burst (``take_run``): noted, ids hidden, written once, counted as one
    content write; the events after them (the finish, [DONE]) are handed back to the loop,
    and so is a read whose first event is not a token chunk."""
    flow, sp, writer = _token_relay(wants_usage=False)
    assert flow(chat_chunk(" a", [8]) + b"\n\n") is None  # the template is learned
    tokens = [chat_chunk(f" t{i}", [10 + i]) + b"\n\n" for i in range(3)]
    assert flow(b"".join(tokens)) is None
    assert writer.written[1:] == [b"".join(strip_ids(t[:-2]) + b"\n\n" for t in tokens)]
    assert sp.ids == [8, 10, 11, 12] and sp.text_ids == 4
    assert flow.call.content_chunks == 2
    finish = chat_chunk("", [], "stop") + b"\n\n"
    tail = finish + b"data: [DONE]\n\n"
    more = chat_chunk(" u", [20]) + b"\n\n"
    assert flow(more + tail) == tail  # the token written, the rest to the loop
    assert writer.written[2:] == [strip_ids(more[:-2]) + b"\n\n"]
    assert sp.ids == [8, 10, 11, 12, 20] and sp.finish_reason is None
    assert flow(finish + more) == finish + more  # a finish first: the loop's to take
    half = more[:-1]
    assert flow(more + half) == half  # a whole token, then one still coming
    assert sp.ids == [8, 10, 11, 12, 20, 20] and len(writer.written) == 4


# ---------------------------------------------------------------- the scan in C (_tokenscan.c)


def test_the_compiled_build_scans_in_c() -> None:
    if compiled.status.startswith("compiled"):
        assert SCAN is not scan_events  # the C module came with the build
        assert TAKE is not take_token
        assert ROLE is not match_role
    else:
        assert SCAN is scan_events
        assert TAKE is take_token
        assert ROLE is match_role


def _c_scan() -> Any:
    if SCAN is scan_events:
        pytest.skip(f"no C scan: the gateway runs {compiled.status}")
    return SCAN


TEMPLATES = {
    "chat": (FIRST["chat"][: FIRST["chat"].index(b'"Hi"') + 1],
             FIRST["chat"][FIRST["chat"].index(b'"Hi"') + 3 : FIRST["chat"].rindex(b"[") + 1]),
    "completion": (
        FIRST["completion"][: FIRST["completion"].index(b'"Hi"') + 1],
        FIRST["completion"][
            FIRST["completion"].index(b'"Hi"') + 3 : FIRST["completion"].rindex(b"[") + 1
        ],
    ),
}  # fmt: skip
TEXTS = [b"", b" a", b"tok12", b'x\\"y', b"q\\", b'"', b"\\\\", "é".encode(), b"a]}]}"]
IDS = [b"", b"1", b"0", b"12,13", b"007", b"1,", b",1", b"1,,2", b"9" * 18, b"9" * 19, b"1 ,2"]
ENDS = [b"", b"]}]}\n\n", b"]}]}\n", b"]}]}\r\n\r\n", b"]}]\n\n", b"]}]}}\n\n"]


def _event(rng: random.Random, head: bytes, tail: bytes) -> bytes:
    # Mostly a token chunk (the second of each list), so that runs of several are met often.
    text, ids, end = (rng.choice(x) if rng.random() < 0.4 else x[1] for x in (TEXTS, IDS, ENDS))
    ev = head + text + tail + ids + end
    if rng.random() < 0.1:  # a byte changed anywhere: head, tail, or the end
        i = rng.randrange(len(ev))
        ev = ev[:i] + bytes([rng.randrange(256)]) + ev[i + 1 :]
    if rng.random() < 0.05:
        ev = ev[: rng.randrange(len(ev) + 1)]  # cut short
    return ev


def _read(rng: random.Random, head: bytes, tail: bytes, counts: list[int]) -> list[bytes]:
    """The events of one read: as many as one of ``counts`` says."""
    return [_event(rng, head, tail) for _ in range(rng.choice(counts))]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_c_scan_gives_what_the_python_scan_gives(kind: str) -> None:
    native = _c_scan()
    head, tail = TEMPLATES[kind]
    rng = random.Random(13)
    for _ in range(30_000):
        events = _read(rng, head, tail, [1, 1, 2, 3, 8])
        data = b"".join(events)
        start = rng.choice([0, 0, len(events[0]), rng.randrange(len(data) + 2)])
        for strip in (False, True):
            for single in (False, True):
                args = (data, start, head, tail, strip, single)
                assert native(*args) == scan_events(*args), args


def _c_take() -> Any:
    if TAKE is take_token:
        pytest.skip(f"no C take: the gateway runs {compiled.status}")
    return TAKE


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_c_take_gives_and_notes_what_the_python_take_does(kind: str) -> None:
    native = _c_take()
    head, tail = TEMPLATES[kind]
    rng = random.Random(17)
    for _ in range(30_000):
        data = b"".join(_read(rng, head, tail, [1, 1, 1, 2]))
        # Noted before: nothing, a parsed chunk's list, a scanned chunk's bytes, a taken
        # token's bytearray (which the next one's ids extend).
        before = rng.choice([[], [[1]], [b"1"], [bytearray(b"1,2")]])
        for strip in (False, True):
            noted_c: list[Any] = [bytearray(x) if isinstance(x, bytearray) else x for x in before]
            noted_py: list[Any] = [bytearray(x) if isinstance(x, bytearray) else x for x in before]
            got = native(data, head, tail, strip, noted_c)
            assert got == take_token(data, head, tail, strip, noted_py), (data, strip)
            assert noted_c == noted_py, (data, strip)
            assert [type(x) for x in noted_c] == [type(x) for x in noted_py]
            if got is not None and not strip:
                assert got is data  # nothing made when nothing is stripped


@settings(max_examples=2_000, deadline=None)
@given(
    data=st.binary(max_size=300), head=st.binary(max_size=8), tail=st.binary(max_size=8),
    strip=st.booleans(),
)  # fmt: skip
def test_the_c_take_takes_any_bytes_as_python_does(
    data: bytes, head: bytes, tail: bytes, strip: bool
) -> None:
    native = _c_take()
    noted_c: list[Any] = []
    noted_py: list[Any] = []
    got = native(data, head, tail, strip, noted_c)
    assert got == take_token(data, head, tail, strip, noted_py)
    assert noted_c == noted_py


def test_the_c_take_refuses_what_is_not_bytes_or_a_list() -> None:
    native = _c_take()
    head, tail = TEMPLATES["chat"]
    event = head + b"x" + tail + b"1]}]}\n\n"
    assert native(event, head, tail, True, []) is not None
    for bad in (
        (event.decode(), head, tail, True, []),
        (bytearray(event), head, tail, True, []),
        (event, head, tail, True, ()),  # the ids go into a list
        (event, head, tail, True),
    ):
        with pytest.raises(TypeError):
            native(*bad)


@pytest.mark.parametrize("bad_at", [None, 0, 127, 128, 129, 250])
def test_the_c_scan_takes_a_run_longer_than_it_keeps(bad_at: int | None) -> None:
    # The C scan keeps a read's first 128 events between its passes and matches the rest
    # again: a run of 300, or one ended by a bad event about there, as the Python scan.
    native = _c_scan()
    head, tail = TEMPLATES["chat"]
    events = [head + b" t%d" % i + tail + b"%d" % i + b"]}]}\n\n" for i in range(300)]
    if bad_at is not None:
        events[bad_at] = events[bad_at].replace(b"]}]}", b"]}]")
    data = b"".join(events)
    for strip in (False, True):
        got = native(data, 0, head, tail, strip, False)
        assert got == scan_events(data, 0, head, tail, strip, False)
        assert got is None if bad_at == 0 else got[2] == len(b"".join(events[:bad_at]))


@settings(max_examples=2_000, deadline=None)
@given(
    data=st.binary(max_size=300), start=st.integers(-2, 310), head=st.binary(max_size=8),
    tail=st.binary(max_size=8), strip=st.booleans(), single=st.booleans(),
)  # fmt: skip
def test_the_c_scan_takes_any_bytes_as_python_does(
    data: bytes, start: int, head: bytes, tail: bytes, strip: bool, single: bool
) -> None:
    # Whatever it is given, no read outside the bytes: the two agree (or both find nothing).
    native = _c_scan()
    assert native(data, start, head, tail, strip, single) == scan_events(
        data, start, head, tail, strip, single
    )


def test_the_c_scan_refuses_what_is_not_bytes() -> None:
    native = _c_scan()
    with pytest.raises(TypeError):
        native("text", 0, b"h", b"[", True, True)
    with pytest.raises(TypeError):
        native(b"x", 0, b"h")
    with pytest.raises(TypeError):
        native(bytearray(b"x"), 0, b"h", b"[", True, True)  # exact bytes, as the relay reads
    # A start past any size, or before 0, finds nothing, as in Python.
    for start in (2**70, -(2**70), 2**63 - 1):
        assert native(b"x", start, b"h", b"[", True, True) is None
        assert scan_events(b"x", start, b"h", b"[", True, True) is None


# ------------------------------------------- a first chunk of a kept shape in C (``ROLE``)

# A role chunk as the benchmark's mock and as vLLM write it, cut around what differs: the
# id, the created and the prompt's ids (``Splice.learn_role`` keeps the rest).
ROLE_SHAPES = [
    (b'","object":"chat.completion.chunk","created":', b',"model":"m","prompt_token_ids":[',
     b'],"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
     b'"finish_reason":null}]}'),
    (b'","object":"chat.completion.chunk","created":',
     b',"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
     b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":[',
     b'],"prompt_text":null}'),
]  # fmt: skip
ROLE_IDS = ["chatcmpl-1", "", "é-ü", 'a"b', "a\\b", "tab\tx", "x" * 40]
CREATEDS = [b"1", b"0", b"1779182750", b"01", b"9" * 18, b"9" * 19, b"", b"-1", b"1.5"]
PROMPTS = [b"1,2,3", b"", b"7", b"1]", b"[1", b'1"', b"1\n2", b"1, 2"]


def _c_role() -> Any:
    if ROLE is match_role:
        pytest.skip(f"no C role: the gateway runs {compiled.status}")
    return ROLE


def _role_event(rng: random.Random, shape: tuple[bytes, bytes, bytes]) -> bytes:
    before, between, after = shape
    chunk_id = rng.choice(ROLE_IDS).encode() if rng.random() < 0.5 else b"chatcmpl-1"
    if rng.random() < 0.05:
        chunk_id = b"\xff\xfe"  # not UTF-8
    created = rng.choice(CREATEDS) if rng.random() < 0.4 else b"1779182750"
    prompt = rng.choice(PROMPTS) if rng.random() < 0.4 else b"1,2,3"
    ev = b'data: {"id":"' + chunk_id + before + created + between + prompt + after
    if rng.random() < 0.1:  # a byte changed anywhere
        i = rng.randrange(len(ev))
        ev = ev[:i] + bytes([rng.randrange(256)]) + ev[i + 1 :]
    if rng.random() < 0.05:
        ev = ev[: rng.randrange(len(ev) + 1)]  # cut short
    return ev


def test_match_role_finds_what_differs_between_two_streams() -> None:
    before, between, after = ROLE_SHAPES[1]
    ev = b'data: {"id":"chatcmpl-9' + before + b"1779182750" + between + b"4,5" + after
    got = match_role(ev, before, between, after)
    assert got is not None
    chunk_id, created, q, digits_end, start = got
    assert (chunk_id, created) == ("chatcmpl-9", 1779182750)
    assert ev[q : q + 1] == b'"' and ev[digits_end : digits_end + len(between)] == between
    assert ev[start : len(ev) - len(after)] == b"4,5"
    # Another model's shape, a created with a leading zero, ids with a quote: not one.
    assert match_role(ev.replace(b'"m"', b'"n"'), before, between, after) is None
    assert match_role(ev.replace(b"1779182750", b"0177918275"), before, between, after) is None
    assert match_role(ev.replace(b"4,5", b'4,"5'), before, between, after) is None


@pytest.mark.parametrize("shape", ROLE_SHAPES)
def test_the_c_role_gives_what_the_python_role_gives(shape: tuple[bytes, bytes, bytes]) -> None:
    native = _c_role()
    rng = random.Random(29)
    found = 0
    for _ in range(30_000):
        ev = _role_event(rng, shape)
        got = native(ev, *shape)
        assert got == match_role(ev, *shape), ev
        if got is not None:  # ``==`` would take True for 1: the id a str, the rest ints
            assert [type(x) for x in got] == [str, int, int, int, int]
            found += 1
    assert 3_000 < found < 29_000  # both ways met often


@settings(max_examples=2_000, deadline=None)
@given(
    event=st.binary(max_size=200), before=st.binary(max_size=6), between=st.binary(max_size=6),
    after=st.binary(max_size=6), prefix=st.booleans(),
)  # fmt: skip
def test_the_c_role_takes_any_bytes_as_python_does(
    event: bytes, before: bytes, between: bytes, after: bytes, prefix: bool
) -> None:
    native = _c_role()
    if prefix:
        event = b'data: {"id":"' + event
    assert native(event, before, between, after) == match_role(event, before, between, after)


def test_the_c_role_refuses_what_is_not_bytes() -> None:
    native = _c_role()
    before, between, after = ROLE_SHAPES[0]
    ev = b'data: {"id":"c' + before + b"1" + between + b"2" + after
    assert native(ev, before, between, after) == (
        "c",
        1,
        14,
        len(b'data: {"id":"c') + len(before) + 1,
        len(ev) - len(after) - 1,
    )
    for bad in ((ev.decode(), before, between, after), (bytearray(ev), before, between, after),
                (ev, before, between)):  # fmt: skip
        with pytest.raises(TypeError):
            native(*bad)
