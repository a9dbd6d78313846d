"""A stream's first chunk and its finish read without parsing them (``Splice.take_known``):
when their bytes are those an earlier stream's parsed ones had (``learn_role``,
``learn_finish``) but for what differs from stream to stream, they must note exactly what
parsing them notes and go to the client exactly as the parsed path writes them; anything
else is left to the parser."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from proxy.policyfile import build_policy
from proxy.relay import sse
from proxy.relay.call import Call
from proxy.relay.continuation import Shapes, Splice
from proxy.relay.resume import _noted

from .gateway import policy_for

BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}],
                        "stream": True}  # fmt: skip


def compact(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def role_chunk(
    chunk_id: str, created: int, prompt: list[int], *, vllm: bool = True, model: str = "m",
    fingerprint: str | None = None, delta: dict[str, Any] | None = None,
    token_ids: list[int] | None = None,
) -> bytes:  # fmt: skip
    """A chat stream's first chunk as vLLM writes it with ``return_token_ids`` (its prompt's
    ids after the choices, ``vllm``) or as the benchmark's mock does (before them)."""
    choice: dict[str, Any] = {"index": 0, "delta": delta or {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}  # fmt: skip
    if token_ids is not None:
        choice["token_ids"] = token_ids
    top: dict[str, Any] = {"id": chunk_id, "object": "chat.completion.chunk",
                           "created": created, "model": model}  # fmt: skip
    if not vllm:
        top["prompt_token_ids"] = prompt
    top["choices"] = [choice]
    if vllm:
        top["prompt_token_ids"] = prompt
        top["prompt_text"] = None
    if fingerprint is not None:
        top["system_fingerprint"] = fingerprint
    return compact(top)


def token_chunk(chunk_id: str, created: int, text: str, ids: list[int], **choice: Any) -> bytes:
    c: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                         "finish_reason": None, **choice, "token_ids": ids}  # fmt: skip
    return compact({"id": chunk_id, "object": "chat.completion.chunk", "created": created,
                    "model": "m", "choices": [c]})  # fmt: skip


def finish_chunk(chunk_id: str, created: int, reason: str, text: str = "", ids: Any = ()) -> bytes:
    return token_chunk(chunk_id, created, text, list(ids), finish_reason=reason, stop_reason=None)


def stream(chunk_id: str, created: int, prompt: list[int], reason: str = "stop") -> list[bytes]:
    return [
        role_chunk(chunk_id, created, prompt),
        token_chunk(chunk_id, created, " a", [5]),
        token_chunk(chunk_id, created, " b", [6, 7]),
        finish_chunk(chunk_id, created, reason, " c", [8]),
        b"data: [DONE]",
    ]


def _call() -> Call:
    policy = build_policy(policy_for({"p": ["http://127.0.0.1:9"]}))
    return Call(request_id="r", kind="chat", path="/v1/chat/completions", body=b"{}",
                headers=[], stream=True, model="m", lane=policy.lanes[0], profile=None,
                wants_usage=False, received_at=0.0)  # fmt: skip


def one_event(sp: Splice, ev: bytes, strip: bool, known: bool) -> tuple[str, Any]:
    """``Resumer.relay``'s way with one event split from a read, without its I/O: (which way
    it went, what the client gets and whether it carries content)."""
    if (token := sp.take_event(ev, strip)) is not None:
        return "token", token
    if known and (k := sp.take_known(ev, strip)) is not None:
        return "known", k
    obj, shown = sp.parse(ev)
    if obj is sse.DONE:
        return "done", (b"data: [DONE]\n\n", False)
    if not isinstance(obj, dict) or sse.is_error(obj) or sp.observe(obj) is not None:
        return "decided", None  # what the loop decides on: never taken unparsed
    return "parsed", _noted(_call(), sp, ev, shown, obj, strip)


def state(sp: Splice) -> tuple[Any, ...]:
    return (sp.id, sp.created, sp.model, sp.system_fingerprint, sp.prompt_ids, sp.ids,
            sp.text_ids, sp.reasoning_open, sp.finish_reason, sp.tool_call, sp.malformed,
            sp.head, sp.tail, sp.guessed, list(sp.finishes))  # fmt: skip


def taught(events: list[bytes], body: dict[str, Any] = BODY, *more: list[bytes]) -> Shapes:
    """Shapes that have seen a stream of ``events`` (and one of each of ``more``), relayed
    as the loop relays them."""
    shapes = Shapes()
    for one in (events, *more):
        sp = Splice("chat", body, False, shapes)
        for ev in one:
            one_event(sp, ev, True, True)
    return shapes


def both_ways(
    teach: list[bytes], events: list[bytes], body: dict[str, Any] = BODY,
    *more: list[bytes],
) -> tuple[list[str], list[Any], list[Any]]:  # fmt: skip
    """A stream of ``events`` after one of ``teach``: relayed with the known events taken
    unparsed and with every one parsed, from shapes taught alike; (the ways the first went,
    what each relay wrote, each noted state after every event)."""
    strip = body.get("return_token_ids") is not True
    fast = Splice("chat", body, False, taught(teach, body, *more))
    slow = Splice("chat", body, False, taught(teach, body, *more))
    ways: list[str] = []
    wrote: list[Any] = [[], []]
    for ev in events:
        way, got = one_event(fast, ev, strip, True)
        _, expected = one_event(slow, ev, strip, False)
        ways.append(way)
        wrote[0].append(got)
        wrote[1].append(expected)
        assert state(fast) == state(slow), (way, ev)
    return ways, wrote[0], wrote[1]


@pytest.mark.parametrize("vllm", [True, False])
@pytest.mark.parametrize("wants_ids", [False, True])
def test_the_next_streams_first_chunk_and_finish_go_unparsed_and_note_what_a_parse_does(
    vllm: bool, wants_ids: bool
) -> None:
    """After one stream, the next of the model takes its first chunk (its own id, created and
    prompt ids; vLLM's layout and the mock's) and its finish without parsing them, noting and
    writing what parsing them does; its tokens go unparsed from the first (``Shapes.made``)."""
    body = {**BODY, "return_token_ids": True} if wants_ids else BODY
    first = stream("chatcmpl-1", 1, [1, 2, 3])
    fp = "vllm-0.21" if vllm else None
    first[0] = role_chunk("chatcmpl-1", 1, [1, 2, 3], vllm=vllm, fingerprint=fp)
    nxt = stream("chatcmpl-é2", 1779182750, list(range(100, 400)))
    nxt[0] = role_chunk("chatcmpl-é2", 1779182750, list(range(100, 400)), vllm=vllm,
                        fingerprint=fp)  # fmt: skip
    ways, fast, slow = both_ways(first, nxt, body)
    assert ways == ["known", "token", "token", "known", "done"]
    assert fast == slow
    assert (b'"token_ids":[' in b"".join(w[0] for w in fast)) is wants_ids
    sp = Splice("chat", body, False, taught(first, body))
    for ev in nxt:
        one_event(sp, ev, not wants_ids, True)
    assert sp.prompt_ids == list(range(100, 400)) and sp.ids == [5, 6, 7, 8]
    assert (sp.id, sp.created, sp.finish_reason, sp.text_ids) == ("chatcmpl-é2", 1779182750,
                                                                  "stop", 4)  # fmt: skip


def test_the_first_stream_parses_them_and_learns_only_from_what_notes_nothing_else() -> None:
    """With nothing met before, both are parsed. A first chunk that carries text, ids or a
    tool call teaches no shape; nor does a request that names no model."""
    ways, fast, slow = both_ways([], stream("chatcmpl-1", 1, [1]))
    assert ways == ["parsed", "parsed", "token", "parsed", "done"] and fast == slow
    for role in (
        role_chunk("c-1", 1, [1], delta={"role": "assistant", "content": "Hi"}),
        role_chunk("c-1", 1, [1], token_ids=[9]),
        role_chunk("c-1", 1, [1], delta={"role": "assistant", "tool_calls": [{"index": 0}]}),
        role_chunk("c-1", 1, [1], delta={"role": "assistant", "reasoning_content": "hm"}),
    ):
        assert both_ways([role], [role_chunk("c-2", 2, [2])])[0] == ["parsed"], role
    nameless = {k: v for k, v in BODY.items() if k != "model"}
    assert both_ways(stream("c-1", 1, [1]), [role_chunk("c-2", 2, [2])], nameless)[0] == ["parsed"]


@pytest.mark.parametrize(
    "other",
    [
        role_chunk("c-2", 2, [2], model="m2"),  # another model's bytes
        role_chunk("c-2", 2, [2], fingerprint="fp"),
        role_chunk("c-2", 2, [2], vllm=False),  # another layout
        role_chunk("c-2", 2, [2], token_ids=[]),
        role_chunk('c-"2', 2, [2]),  # an id a writer escapes
        role_chunk("c-\\2", 2, [2]),
        role_chunk("c-\n2", 2, [2]),
        role_chunk("c-2", 2, [2]).replace(b'"created":2', b'"created":02'),  # not JSON
        role_chunk("c-2", 2, [2]).replace(b'"created":2', b'"created":2.0'),
        role_chunk("c-2", 2, [2]).replace(b'"created":2', b'"created":-2'),
        role_chunk("c-2", 2, [2]).replace(b'"created":2', b'"created":' + b"9" * 19),
        role_chunk("c-2", 2, [2]).replace(b"[2]", b'["2"]'),  # no ids: as parse cuts them
        role_chunk("c-2", 2, [2]).replace(b"[2]", b"[[2]]"),
        role_chunk("c-2", 2, [2]).replace(b"[2]", b"[2\n]"),
        role_chunk("c-2", 2, [2]).replace(b"[2]", b"[2"),
        role_chunk("c-2", 2, [2]) + b"}",
        role_chunk("c-2", 2, [2]).replace(b'"id":"c-2"', b'"id":"c-2","id":"c-3"'),
        # a key again in another spelling: JSON's decoder keeps its last value
        role_chunk("c-2", 2, [2]).replace(b'"prompt_text":null', b'"created" :1'),
        role_chunk("c-2", 2, [2]).replace(b'"prompt_text":null', b'"\\u0069d":"c-1"'),
        role_chunk("c-2", 2, [2]).replace(b"c-2", b"c-\xff"),  # not UTF-8
    ],
)
def test_a_first_chunk_of_other_bytes_is_parsed(other: bytes) -> None:
    ways, fast, slow = both_ways(stream("c-1", 1, [1]), [other])
    assert ways[0] != "known", other
    assert fast == slow


@pytest.mark.parametrize("again", [b'"created" :1', b'"\\u0069d":"c-1"', b'"id" :"c-1"'])
def test_a_first_chunk_naming_its_id_or_created_again_is_never_learned(again: bytes) -> None:
    """JSON's decoder keeps a key's last value: a first chunk that names its id or created
    again, in any spelling, after the place a kept shape would put the next stream's, would
    note the first value unparsed and the last parsed."""

    def odd(ev: bytes) -> bytes:
        return ev.replace(b'"prompt_text":null', again)

    teach = stream("c-1", 1, [1])
    teach[0] = odd(teach[0])
    ways, fast, slow = both_ways(teach, [odd(role_chunk("c-2", 7, [2]))])
    assert ways[0] != "known" and fast == slow


def test_a_finish_of_another_reason_or_shape_is_parsed_and_learned() -> None:
    teach = stream("c-1", 1, [1], reason="stop")
    length = finish_chunk("c-2", 2, "length")
    events = [role_chunk("c-2", 2, [2]), token_chunk("c-2", 2, " a", [5]), length]
    assert both_ways(teach, events)[0] == ["known", "token", "parsed"]
    shapes = taught(teach)
    sp = Splice("chat", BODY, False, shapes)
    for ev in events:
        one_event(sp, ev, True, True)
    assert [r for _, r in sp.finishes] == ["stop", "length"]  # kept with the template
    again = [role_chunk("c-3", 3, [3]), token_chunk("c-3", 3, " a", [5])]
    after_both = both_ways(teach, [*again, finish_chunk("c-3", 3, "length")], BODY, events)
    assert after_both[0][2] == "known"
    for bad in (
        finish_chunk("c-3", 3, "abort"),  # decided on: never unparsed
        finish_chunk("c-3", 3, "stop", 'say "x"'),  # a quote in the text
        finish_chunk("c-3", 3, "stop").replace(b'"stop_reason":null', b'"stop_reason":7'),
        finish_chunk("c-3", 3, "stop", ids=[1]).replace(b"[1]", b"[1,]"),
        token_chunk("c-3", 3, "", [], finish_reason="stop", stop_reason=None, usage={"a": 1}),
    ):
        ways, fast, slow = both_ways(teach, [*again, bad])
        assert ways[2] != "known", bad
        assert fast == slow


@pytest.mark.parametrize("bad", [b"\xc3y", b"x\x01", b"\\q"])
def test_a_finish_text_is_relayed_as_it_came_as_a_token_text_is(bad: bytes) -> None:
    """The unparsed path does not check a text as a JSON string (its UTF-8, its control
    bytes, its escapes), for a finish as for a token: such bytes go to the client as the
    replica sent them, where a parse refuses the event (vLLM writes JSON from Python:
    always UTF-8, its control bytes and quotes escaped)."""
    teach = stream("c-1", 1, [1])
    sp = Splice("chat", BODY, False, taught(teach))
    for ev in (role_chunk("c-2", 2, [2]), token_chunk("c-2", 2, " a", [5])):
        one_event(sp, ev, True, True)
    for ev, way in ((token_chunk("c-2", 2, "xy", [6]), "token"),
                    (finish_chunk("c-2", 2, "stop", "xy"), "known")):  # fmt: skip
        odd = ev.replace(b"xy", bad)
        assert one_event(sp, odd, False, True) == (way, (odd + b"\n\n", True))
    assert sp.finish_reason == "stop"


def test_a_cut_of_an_event_never_noted_teaches_no_first_chunk() -> None:
    """An error event relayed after the start carries prompt ids ``parse`` cuts and is never
    noted: the next event noted is not learned as a first chunk at that cut's offsets."""
    shapes = Shapes()
    sp = Splice("chat", BODY, False, shapes)
    assert one_event(sp, token_chunk("c-1", 1, " a", [5]), True, True)[0] == "parsed"
    pad = b"x" * 40
    quiet = token_chunk("c-1", 1, "", []).replace(b"]}]}", b'],"pad":"' + pad + b'"}]}')
    start = quiet.index(pad) + 5
    head = b'data: {"error":{"code":400,"message":"'
    err = head + b"y" * (start - len(head) - 23) + b'"},"prompt_token_ids":[1,2,3,4]}'
    assert err.index(b"[1,") + 1 == start  # its ids where the next event has the pad's bytes
    assert one_event(sp, err, True, True)[0] == "decided"
    assert one_event(sp, quiet, True, True)[0] == "parsed"
    assert shapes.role("chat", "m") is None


def test_a_finish_whose_other_fields_a_scan_would_not_treat_alike_is_parsed() -> None:
    """A stop_reason that is not a scalar (its lists are not the ones the scan nulls), and
    a completion's finish with a delta (``observe`` reads its reasoning and tool calls)."""
    teach = stream("c-1", 1, [1])
    odd = b'"stop_reason":{"token_ids":[]}'
    teach[3] = teach[3].replace(b'"stop_reason":null', odd)
    events = [role_chunk("c-2", 2, [2]), token_chunk("c-2", 2, " a", [5]),
              finish_chunk("c-2", 2, "stop", " c", [8]).replace(b'"stop_reason":null', odd)]  # fmt: skip
    ways, fast, slow = both_ways(teach, events)
    assert ways[2] != "known" and fast == slow
    body = {"model": "m", "prompt": "x", "stream": True}

    def completion(cid: str, reason: str | None, **extra: Any) -> bytes:
        choice = {"index": 0, "text": " c", **extra, "logprobs": None, "finish_reason": reason,
                  "stop_reason": None, "token_ids": [8]}  # fmt: skip
        return compact({"id": cid, "object": "text_completion", "created": 1, "model": "m",
                        "choices": [choice]})  # fmt: skip

    shapes = Shapes()
    for cid in ("c-1", "c-2"):
        sp = Splice("completion", body, False, shapes)
        ways = [one_event(sp, completion(cid, None), True, True)[0],
                one_event(sp, completion(cid, "stop", delta={"reasoning": "r"}), True, True)[0]]  # fmt: skip
        assert ways[1] == "parsed" and sp.reasoning_open
    assert sp.finishes == []


def test_a_guessed_template_takes_no_finish_until_a_token_confirms_it() -> None:
    teach = stream("c-1", 1, [1])
    ways, fast, slow = both_ways(teach, [role_chunk("c-2", 2, [2]), finish_chunk("c-2", 2, "stop")])
    assert ways == ["known", "parsed"] and fast == slow


def _mutated(rng: random.Random, ev: bytes) -> bytes:
    # Left out: bytes that are not UTF-8, and a control byte or a backslash put into a text.
    # A text is not checked as a JSON string on the unparsed path, a token's or a finish's
    # (``test_a_finish_text_is_relayed_as_it_came_as_a_token_text_is``): the client gets the
    # replica's bytes as they came, where a parse refuses them.
    mark = b'"content":"'
    at = ev.find(mark)
    text = range(at + len(mark), ev.find(b'"', at + len(mark))) if at >= 0 else range(0)
    while True:
        out, i, byte = _mutation(rng, ev)
        if i in text and (byte == 0x5C or byte < 0x20):
            continue
        try:
            out.decode()
        except UnicodeDecodeError:
            continue
        return out


def _mutation(rng: random.Random, ev: bytes) -> tuple[bytes, int, int]:
    """``ev`` changed, where, and the byte put there (-1 for none: unchanged or cut short)."""
    r = rng.random()
    if r < 0.3:
        i = rng.randrange(len(ev))
        byte = rng.randrange(256)
        return ev[:i] + bytes([byte]) + ev[i + 1 :], i, byte
    if r < 0.4:
        return ev[: rng.randrange(len(ev) + 1)], -1, -1
    if r < 0.5:
        i = rng.randrange(len(ev))
        put = rng.choice([b'"', b"\\", b"]", b",", b"0", b"\n", b"}"])
        return ev[:i] + put + ev[i:], i, put[0]
    return ev, -1, -1


def test_whatever_is_taken_unparsed_notes_and_writes_what_parsing_it_does() -> None:
    """Random streams (ids, created, prompts, texts, reasons), their bytes changed here and
    there: an event taken unparsed is always one the parsed path notes and writes alike."""
    rng = random.Random(29)
    taken = 0
    for n in range(3000):
        reason = rng.choice(["stop", "length"])
        teach = stream("chatcmpl-1", 1, [1, 2], reason)
        cid = rng.choice([f"chatcmpl-{n}", "c", f"é-{n}", "x y", "\x7f"])
        created = rng.choice([0, 1, 10**12, rng.randrange(10**9)])
        prompt = [rng.randrange(200_000) for _ in range(rng.choice([0, 1, 5, 50]))]
        events = stream(cid, created, prompt, rng.choice(["stop", "length", reason]))
        events[3] = finish_chunk(cid, created, reason, rng.choice(["", " c", "é"]),
                                 rng.choice([[], [8], [8, 9]]))  # fmt: skip
        events = [_mutated(rng, ev) for ev in events]
        wants = rng.random() < 0.2
        body = {**BODY, "return_token_ids": True} if wants else BODY
        ways, fast, slow = both_ways(teach, events, body)
        for way, f, s in zip(ways, fast, slow, strict=True):
            assert f == s, (way, events)
        taken += ways.count("known")
    assert taken > 2000  # most first chunks and finishes were taken unparsed
