"""Token-exact continuation: the eligibility table, the splice's pure parts, and streams cut
by a simulator replica and continued on another, over real sockets."""

from __future__ import annotations

import asyncio
import gc
import json
import random
from typing import Any

import httpx
import pytest

import loadtest.fake_upstream as fake
from loadtest.fake_upstream import MODEL, running
from loadtest.sim.server import run_sim
from loadtest.sim.settings import SimSettings
from proxy.config import ContinuationConfig
from proxy.edge.asgi_ext import (
    CLIENT_GONE,
    START_BODY,
    START_MORE_BODY,
    START_WITH_BODY,
    ClientGoneHook,
)
from proxy.relay import continuation as cont
from proxy.relay.continuation import (
    _REFUSAL_WHY,
    Refusal,
    Splice,
    Trigger,
    decode_ids,
    eligibility,
    explain,
    forward_body,
    strip_ids,
)
from proxy.relay.reprefill import Reprefills, has_room
from proxy.relay.resume import FIRST_CONTENT_ALONE_UP_TO, first_content_alone
from proxy.relay.sse import parse_event

from .gateway import (
    a_call,
    data_events,
    generators_left_to_the_loop,
    policy_for,
    running_gateway,
)
from .waiting import wait_until

MSGS = [{"role": "user", "content": "Tell me a story about the sea."}]
BASE: dict[str, Any] = {"messages": MSGS, "stream": True}


ELIGIBILITY: list[tuple[str, dict[str, Any], Refusal | None]] = [
        ("chat", {}, None),
        ("chat", {"n": 1}, None),
        ("chat", {"n": 2}, Refusal.N),
        ("completion", {"best_of": 3, "prompt": "x"}, Refusal.N),
        ("chat", {"tools": [{"type": "function"}]}, Refusal.TOOLS),
        ("chat", {"tools": [{"type": "function"}], "tool_choice": "none"}, None),
        ("chat", {"response_format": {"type": "json_object"}}, Refusal.STRUCTURED),
        ("chat", {"response_format": {"type": "text"}}, None),
        ("chat", {"structured_outputs": {"json": {}}}, Refusal.STRUCTURED),
        ("chat", {"guided_regex": "a+"}, Refusal.STRUCTURED),
        ("chat", {"logprobs": True}, Refusal.LOGPROBS),
        ("chat", {"logprobs": False}, None),
        ("completion", {"prompt": "x", "logprobs": 2}, Refusal.LOGPROBS),
        ("chat", {"stop": ["\n\nUser:"]}, Refusal.STOP),
        ("chat", {"stop": "x"}, Refusal.STOP),
        ("chat", {"stop": []}, None),
        ("completion", {"prompt": "x", "echo": True}, Refusal.CONTENT),
        ("completion", {"prompt": ["a", "b"]}, Refusal.CONTENT),
        ("completion", {"prompt": [1, 2, 3]}, None),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         Refusal.CONTENT),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
         None),
        ("chat", {"stream_options": {"continuous_usage_stats": True}}, Refusal.USAGE_STATS),
        ("chat", {"seed": 1, "temperature": 0.7}, None),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "extra", "expected"), ELIGIBILITY)
def test_eligibility_table(kind: str, extra: dict[str, Any], expected: Refusal | None) -> None:
    body = {**BASE, **extra}
    if kind == "completion":
        body.pop("messages")
    assert eligibility(kind, body, enabled=True, refuse_when_seeded=False) == expected


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"seed": 1, "temperature": 0.7}, Refusal.SEEDED),
        ({"seed": 1}, Refusal.SEEDED),  # unset temperature: the model's default samples
        ({"seed": 1, "temperature": 0}, None),
        ({"temperature": 0.7}, None),
    ],
)
def test_seeded_refused_only_when_the_policy_says(
    extra: dict[str, Any], expected: Refusal | None
) -> None:
    body = {**BASE, **extra}
    assert eligibility("chat", body, enabled=True, refuse_when_seeded=True) == expected


def test_disabled_refuses_everything() -> None:
    assert eligibility("chat", BASE, enabled=False, refuse_when_seeded=False) is Refusal.DISABLED


def test_every_field_a_refusal_reads_is_one_the_quick_path_watches() -> None:
    # A body with none of ``_REFUSING_KEYS`` is judged on its messages or prompt alone: each
    # refusal the table shows for another field must come from a field in that set.
    for _, extra, expected in [*ELIGIBILITY, ("chat", {"seed": 1}, Refusal.SEEDED)]:
        if expected is not None:
            assert set(extra) - {"messages", "prompt"} <= cont._REFUSING_KEYS or (
                expected is Refusal.CONTENT and set(extra) <= {"messages", "prompt"}
            ), extra


# Fields a request may carry, each with values that refuse where any value of it can, and
# fields no refusal reads on their own.
_FIELD_VALUES: dict[str, list[Any]] = {
    "n": [1, 2], "best_of": [3], "tools": [[{"type": "function"}], []],
    "functions": [[{"name": "f"}]], "tool_choice": ["none", "auto"],
    "response_format": [{"type": "json_object"}, {"type": "text"}],
    **{k: [{"json": {}}] for k in cont._STRUCTURED_KEYS},
    "logprobs": [True, False, 2], "top_logprobs": [3], "prompt_logprobs": [1],
    "stop": ["x", [], ["\n"]], "echo": [True], "kv_transfer_params": [{}],
    "stream_options": [{"continuous_usage_stats": True}, {"include_usage": True}],
    "seed": [1], "temperature": [0, 0.7], "top_p": [0.9], "max_tokens": [8], "user": ["u"],
}  # fmt: skip


@pytest.mark.parametrize("seeded", [False, True])
def test_the_quick_path_judges_every_body_as_the_full_checks_do(seeded: bool) -> None:
    # ``"n": 1`` refuses nothing but is one of ``_REFUSING_KEYS``: with it, every check runs.
    image = [{"role": "user", "content": [{"type": "x"}]}]
    contents = [("chat", {"messages": MSGS}), ("chat", {"messages": image}),
                ("completion", {"prompt": "x"}), ("completion", {"prompt": ["a"]})]  # fmt: skip
    fields = [(k, v) for k, values in _FIELD_VALUES.items() if k != "n" for v in values]
    for kind, content in contents:
        for key, value in fields:
            body = {**content, "stream": True, key: value}
            quick = eligibility(kind, body, enabled=True, refuse_when_seeded=seeded)
            full = eligibility(kind, {**body, "n": 1}, enabled=True, refuse_when_seeded=seeded)
            assert quick == full, (kind, body)


def test_a_refusal_keeps_its_order_when_a_field_and_the_content_both_refuse() -> None:
    image = [{"role": "user", "content": [{"type": "image_url"}]}]
    both = {**BASE, "messages": image, "stop": "x"}
    assert eligibility("chat", both, enabled=True, refuse_when_seeded=False) is Refusal.STOP
    only_content = {**BASE, "messages": image, "max_tokens": 8}
    assert eligibility("chat", only_content, enabled=True, refuse_when_seeded=False) is (
        Refusal.CONTENT
    )


def test_strip_ids_nulls_the_lists_and_keeps_json_valid() -> None:
    ev = b'data: {"id":"x","prompt_token_ids":[1, 2,3],"choices":[{"token_ids":[4],"x":1}]}'
    out = json.loads(strip_ids(ev)[6:])
    assert out == {"id": "x", "prompt_token_ids": None, "choices": [{"token_ids": None, "x": 1}]}
    assert strip_ids(b'data: {"a":1}') == b'data: {"a":1}'


@pytest.mark.parametrize(
    ("event", "want"),
    [
        (b'{"token_ids":[1,2]}', b'{"token_ids":null}'),
        (b'{"token_ids": [1, 2]}', b'{"token_ids": null}'),  # spaces, as json.dumps writes
        (b'{"token_ids":[]}', b'{"token_ids":null}'),
        (b'{"prompt_token_ids":[1],"x":{"token_ids":[2]}}',
         b'{"prompt_token_ids":null,"x":{"token_ids":null}}'),
        (b'{"token_ids":null}', b'{"token_ids":null}'),  # already null (vLLM without the flag)
        (b'{"stop_token_ids":[1]}', b'{"stop_token_ids":[1]}'),  # another key: kept
        (b'{"token_ids":["a"]}', b'{"token_ids":["a"]}'),  # not ids: kept
        # The key's text inside content is escaped, so it is never taken for the key.
        (b'{"content":"\\"token_ids\\":[1]","token_ids":[3]}',
         b'{"content":"\\"token_ids\\":[1]","token_ids":null}'),
        (b'{"token_ids":[1', b'{"token_ids":[1'),  # cut short: left as it is
    ],
)  # fmt: skip
def test_strip_ids_only_touches_the_id_lists(event: bytes, want: bytes) -> None:
    assert strip_ids(event) == want


@pytest.mark.parametrize(
    ("event", "want"),
    [
        # The common end: the one list, the event's last value, nulled without the scan.
        (b'data: {"choices":[{"delta":{"content":"a"},"token_ids":[12,7]}]}',
         b'data: {"choices":[{"delta":{"content":"a"},"token_ids":null}]}'),
        (b'data: {"choices":[{"text":"","token_ids":[]}]}',
         b'data: {"choices":[{"text":"","token_ids":null}]}'),
        # At the end but not plain (a space, a leading zero): the scan decides.
        (b'data: {"choices":[{"token_ids":[1, 2]}]}', b'data: {"choices":[{"token_ids":null}]}'),
        (b'data: {"choices":[{"token_ids":[01]}]}', b'data: {"choices":[{"token_ids":null}]}'),
        # Two keys, the last at the end: both nulled.
        (b'data: {"prompt_token_ids":[5],"choices":[{"token_ids":[1]}]}',
         b'data: {"prompt_token_ids":null,"choices":[{"token_ids":null}]}'),
        # The key's text escaped inside content, the real list at the end.
        (b'data: {"choices":[{"text":"\\"token_ids\\":[1]}]}","token_ids":[3]}]}',
         b'data: {"choices":[{"text":"\\"token_ids\\":[1]}]}","token_ids":null}]}'),
    ],
)  # fmt: skip
def test_strip_ids_at_an_events_end(event: bytes, want: bytes) -> None:
    assert strip_ids(event) == want


def test_a_first_chunk_with_its_prompt_ids_nulled_has_its_own_ids_nulled_too() -> None:
    # As Splice.parse hands it on (the prompt's ids cut out and nulled), and as vLLM writes a
    # chunk without the flag: the key with no list is passed over, the list at the end nulled.
    event = (b'data: {"id":"c","prompt_token_ids":null,"choices":[{"index":0,'
             b'"delta":{"role":"assistant","content":""},"token_ids":[]}]}')  # fmt: skip
    assert strip_ids(event) == event.replace(b'"token_ids":[]', b'"token_ids":null')
    assert strip_ids(b'{"prompt_token_ids":null,"token_ids":null}') == (
        b'{"prompt_token_ids":null,"token_ids":null}'
    )


def test_done_is_told_without_a_parse_and_a_choice_that_is_no_object_notes_nothing() -> None:
    sp = Splice("chat", BASE, False)
    assert sp.parse(b"data: [DONE]") == (parse_event(b"data: [DONE]"), b"data: [DONE]")
    assert sp.observe({"id": "c", "choices": ["x"]}) is None  # not vLLM's: nothing noted
    assert (sp.ids, sp.text_ids, sp.finish_reason) == ([], 0, None)
    assert sp.refusal(1, 100_000) is Refusal.MALFORMED  # and its ids are not trusted


def test_strip_ids_common_end_is_the_scans_result() -> None:
    # Random events around the common end: the fast path and the scan of every list agree.
    rng = random.Random(11)
    pieces = [b"1", b"23", b"0", b"01", b",", b" ", b"]", b"[", b'"', b'token_ids":', b"x"]
    for _ in range(20_000):
        ids = b"".join(rng.choice(pieces) for _ in range(rng.randrange(0, 6)))
        key = rng.choice(
            [b'"token_ids":', b'"prompt_token_ids":', b'token_ids":', b'"token_ids": ']
        )
        head = rng.choice([b'data: {"choices":[{"text":"a",', b'data: {"token_ids":[4],"c":[{',
                           b"", b'{"t":"\"token_ids\":[2]",',
                           # a key whose value is no list first (vLLM's null prompt ids, or
                           # the ones Splice.parse nulled): passed over by the common end
                           b'data: {"prompt_token_ids":null,"choices":[{',
                           b'{"token_ids":nul,"prompt_token_ids":null,'])  # fmt: skip
        event = head + key + b"[" + ids + rng.choice([b"]}]}", b"]}", b"]}]}]}", b"}]}"])
        i = event.find(b'token_ids":')
        want = event if i < 0 else cont._strip_every_list(event, i)
        assert strip_ids(event) == want, event


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        # The client's bytes kept as they came (spacing, escapes, number spellings), the flag
        # added before the closing brace.
        (b'{"messages": [{"role":"user","content":"caf\\u00e9"}], "temperature": 1e0}\n',
         b'{"messages": [{"role":"user","content":"caf\\u00e9"}], "temperature": 1e0'
         b',"return_token_ids":true}\n'),
        (b'  {"prompt":"x"}  ', b'  {"prompt":"x","return_token_ids":true}  '),
        # The client named the flag itself: encoded afresh, the flag set.
        (b'{"prompt":"x","return_token_ids":false}', b'{"prompt":"x","return_token_ids":true}'),
    ],
)  # fmt: skip
def test_the_forwarded_body_is_the_clients_bytes_asking_for_ids(raw: bytes, want: bytes) -> None:
    out = forward_body(raw, json.loads(raw))
    assert out == want
    assert json.loads(out) == {**json.loads(raw), "return_token_ids": True}


def test_splice_replays_only_ids_that_produced_text_and_counts_the_rest() -> None:
    sp = Splice("chat", {**BASE, "max_tokens": 10, "temperature": 0, "min_tokens": 5}, True)
    role = {"id": "c1", "created": 7, "model": "m", "prompt_token_ids": [1, 2],
            "choices": [{"delta": {"role": "assistant", "content": ""}, "token_ids": []}]}  # fmt: skip
    assert sp.observe(role) is None
    sp.observe({"choices": [{"delta": {"content": "a"}, "token_ids": [10]}]})
    sp.observe({"choices": [{"delta": {"content": ""}, "token_ids": [240]}]})  # a byte, no text
    body = sp.continuation_body("m")
    assert body["prompt"] == [1, 2, 10]
    assert body["max_tokens"] == 9 and body["min_tokens"] == 4 and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True} and "messages" not in body
    chunk = sp.splice({"id": "cmpl-z", "created": 9, "model": "m",
                       "choices": [{"text": "b", "token_ids": [11], "finish_reason": None}]})  # fmt: skip
    assert chunk is not None
    assert (chunk["id"], chunk["created"], chunk["object"]) == ("c1", 7, "chat.completion.chunk")
    assert chunk["choices"][0]["delta"] == {"content": "b"}
    assert chunk["choices"][0]["token_ids"] is None  # the client did not ask
    assert sp.observe({"choices": [{"text": "", "finish_reason": "abort"}]}) is Trigger.ABORT
    # An abort notes nothing: observed twice (the pump's handler, then the loop), no id added.
    aborted = {"choices": [{"text": "x", "token_ids": [99], "finish_reason": "abort"}]}
    assert sp.observe(aborted) is sp.observe(aborted) is Trigger.ABORT
    assert 99 not in sp.ids and sp.finish_reason is None
    sp.observe({"choices": [{"text": "b", "token_ids": [11]}]})
    assert sp.usage() == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


_ROLE = (
    b'{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},"token_ids":[]}]'
)


@pytest.mark.parametrize(
    ("event", "cut", "noted"),
    [
        # chat: at the top; completions: on the choice; spaces as json.dumps writes them
        (b'data: {"id":"c","prompt_token_ids":[5,6,7],"choices":[]}', True, [5, 6, 7]),
        (b'data: {"choices":[{"text":"a","prompt_token_ids":[5, 6],"token_ids":[9]}]}', True,
         [5, 6]),
        (b'data: {"prompt_token_ids":[],"choices":[]}', True, []),
        # cut, but not ids: nothing to replay when a seam reads them
        (b'data: {"prompt_token_ids":[1,{}],"choices":[]}', True, None),
        (b'data: {"prompt_token_ids":[1.5],"choices":[]}', True, None),
        # not where vLLM puts them: parsed whole, nothing noted
        (b'data: {"x":{"prompt_token_ids":[1]},"choices":[]}', False, None),
        # a "[" or a quote inside (the first "]" may not end the list): parsed whole
        (b'data: {"prompt_token_ids":[1,[2]],"choices":[]}', False, None),
        (b'data: {"prompt_token_ids":[1,"a]"],"choices":[]}', False, None),
        # the key elsewhere too, however spelt its value: parsed whole, the top's ids noted
        (b'data: {"x":{"prompt_token_ids":null},"prompt_token_ids":[1],"choices":[]}', False,
         [1]),
        (b'data: {"prompt_token_ids": null,"choices":[{"delta":{"prompt_token_ids":[7]}}]}',
         False, None),
        # an event of several lines (vLLM writes one): parsed whole, its data lines joined
        (b'data: {"id":"c","prompt_token_ids":[1,2\n,9],"z":[4\ndata: ,3],"choices":[]}', False,
         [1, 2, 3]),
        # the key's text inside a string is escaped: never taken for the key
        (b'data: {"c":"\\"prompt_token_ids\\":[1]","choices":[]}', False, None),
        (b"data: [DONE]", False, None),
    ],
)  # fmt: skip
def test_parse_keeps_the_prompt_ids_unparsed_and_returns_the_same_object(
    event: bytes, cut: bool, noted: list[int] | None
) -> None:
    for wants_ids in (False, True):
        sp = Splice("chat", {**BASE, "return_token_ids": wants_ids}, False)
        got, shown = sp.parse(event)
        want = parse_event(event)
        if isinstance(want, dict):
            sp.observe(got)  # a list parsed whole is noted here, as before
        if cut:
            for holder in (want, *want["choices"]):
                if "prompt_token_ids" in holder:
                    holder["prompt_token_ids"] = None  # where the cut ids were: null
        assert got == want
        assert sp.prompt_ids == noted
        # The client gets the replica's bytes when it asked for ids, else the prompt's list
        # nulled already (what is inside it is the gateway's to replay, never the client's).
        if wants_ids or not cut:
            assert shown == event
        else:
            at = event.index(b"[", event.index(b'"prompt_token_ids":'))
            assert shown == event[:at] + b"null" + event[event.index(b"]", at) + 1 :]


def test_prompt_ids_are_noted_once_and_a_later_list_is_dropped_unparsed() -> None:
    sp = Splice("completion", {"prompt": "x", "stream": True}, False)
    first, _ = sp.parse(
        b'data: {"choices":[{"text":"a","prompt_token_ids":[1,2],"token_ids":[3]}]}'
    )
    later, _ = sp.parse(
        b'data: {"choices":[{"text":"b","prompt_token_ids":[1,2,3],"token_ids":[4]}]}'
    )
    assert (
        first["choices"][0]["prompt_token_ids"] is later["choices"][0]["prompt_token_ids"] is None
    )
    sp.observe(first)
    sp.observe(later)
    assert sp.prompt_ids == [1, 2] and sp.ids == [3, 4]


def test_prompt_ids_that_are_not_ids_refuse_the_seam() -> None:
    assert decode_ids(b"1, 2,3") == [1, 2, 3] and decode_ids(b"") == []
    assert decode_ids(b"1,,2") is None and decode_ids(b"1.5") is None
    sp = Splice("chat", BASE, False)
    sp.observe(sp.parse(b'data: {"prompt_token_ids":[1,,2],' + _ROLE[1:] + b"}")[0])
    sp.observe({"choices": [{"delta": {"content": "a"}, "token_ids": [7]}]})
    assert sp.prompt_ids is None and sp.refusal(1, 100) is Refusal.NO_IDS


def test_the_first_completion_chunk_carrying_prompt_ids_is_not_the_template() -> None:
    sp = Splice("completion", {"prompt": "x", "stream": True}, False)
    head = b'data: {"id":"x","object":"text_completion","created":1,"model":"m","choices":'
    tail = b'","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":'
    first = head + b'[{"index":0,"text":"a' + tail + b'[1,2],"token_ids":[3]}]}'
    second = head + b'[{"index":0,"text":"b' + tail + b'null,"token_ids":[4]}]}'
    obj, _ = sp.parse(first)
    sp.observe(obj)
    sp.learn_template(first, obj)
    assert sp.head is None
    obj, _ = sp.parse(second)
    sp.observe(obj)
    sp.learn_template(second, obj)
    assert sp.head is not None
    third = second.replace(b'"text":"b', b'"text":"c').replace(b"[4]", b"[5]")
    assert sp.take_chunk(third + b"\n\n", True) is not None
    assert sp.prompt_ids == [1, 2] and sp.ids == [3, 4, 5]


def test_max_tokens_reached_is_finished_not_continued() -> None:
    sp = Splice("chat", {**BASE, "max_tokens": 1}, False)
    sp.observe({"id": "c", "prompt_token_ids": [1],
                "choices": [{"delta": {"content": "a"}, "token_ids": [5]}]})  # fmt: skip
    assert sp.exhausted()
    (end,) = sp.length_ending()
    assert end["choices"][0]["finish_reason"] == "length"


def test_seam_inside_reasoning_or_after_a_tool_call_is_refused() -> None:
    sp = Splice("chat", BASE, False)
    sp.observe({"prompt_token_ids": [1], "choices": [{"delta": {"reasoning_content": "hm"}}]})
    assert sp.refusal(1, 100) is Refusal.REASONING
    sp.observe({"choices": [{"delta": {"content": "ok"}}]})
    assert sp.refusal(1, 100) is None
    assert sp.refusal(1, 0) is Refusal.SEQ_LEN
    sp.observe({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]})
    assert sp.refusal(1, 100) is Refusal.TOOLS


# -- over real sockets ----------------------------------------------------------------------

SETTINGS = SimSettings(step_fixed_s=0.001, decode_per_seq_s=0.0, prefill_per_token_s=0.0,
                       request_overhead_s=0.0)  # fmt: skip


def _text(events: list[Any]) -> str:
    return "".join(
        (c.get("delta") or {}).get("content") or c.get("text") or ""
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices") or []
    )


@pytest.fixture
async def fleet():
    """Replica ``a`` (the lane's pool) and ``b`` (its spill pool): a stream starts on ``a``
    and is continued on ``b``."""
    async with run_sim(SETTINGS, name="a") as a, run_sim(SETTINGS, name="b") as b:
        policy = policy_for(
            {"a": [a.url], "b": [b.url]},
            lanes=[{"name": "all", "pool": "a", "spill_to": "b", "stream_idle_timeout_s": 3.0}],
            continuation={"enabled": True},
        )
        async with running_gateway(policy) as (url, app):
            async with httpx.AsyncClient(timeout=30) as client:
                yield a, b, url, app, client


async def _chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Any]:
    resp = await client.post(url + "/v1/chat/completions", json={**BASE, **body})
    assert resp.status_code == 200, resp.text
    return data_events(resp.text)


def _continuations(replica: Any) -> list[dict[str, Any]]:
    """The continuation requests ``replica`` received: token-id prompts on /v1/completions (the
    health canary's text prompt goes there too)."""
    return [
        r
        for r in replica.requests()
        if r["path"] == "/v1/completions" and isinstance((r["body"] or {}).get("prompt"), list)
    ]


def _count(app: Any, name: str, **labels: str) -> float:
    return app.gateway.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(
    ("fault", "trigger"),
    [
        ({"fault": "cut_close", "after_tokens": 40}, "eof"),
        ({"fault": "cut_reset", "after_tokens": 25}, "reset"),
        ({"fault": "cut_error", "after_tokens": 10}, "error_event"),
        ({"fault": "cut_abort", "after_tokens": 10}, "abort"),
        ({"fault": "stall", "after_tokens": 20}, "stall"),
    ],
)
async def test_a_cut_stream_is_continued_token_exact(fleet, fault, trigger, access_lines) -> None:
    a, b, url, app, client = fleet
    body = {"max_tokens": 60, "temperature": 0, "stream_options": {"include_usage": True}}
    ref = await _chat(client, url, body)
    await a.set_fault(fault)
    try:
        got = await _chat(client, url, body)
    finally:
        await a.set_fault(None)
    assert _text(got) == _text(ref) and _text(got)
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
    chunks = [e for e in got if isinstance(e, dict)]
    assert not any("error" in e for e in chunks)
    assert {e["id"] for e in chunks} == {ref[0]["id"].replace(ref[0]["id"], chunks[0]["id"])}
    assert len({e["created"] for e in chunks}) == 1
    roles = [e for e in chunks if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert len(roles) == 1
    assert all(e.get("prompt_token_ids") is None for e in chunks)
    assert all(c.get("token_ids") is None for e in chunks for c in e["choices"])
    finishes = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 60
    assert chunks[-1]["usage"]["prompt_tokens"] == ref[-2]["usage"]["prompt_tokens"]
    cont_req = _continuations(b)[-1]
    assert cont_req["body"]["max_tokens"] == 60 - fault["after_tokens"]
    counted = {
        (m.labels["trigger"], m.labels["outcome"]): m.value
        for metric in app.gateway.metrics.registry.collect()
        if metric.name == "tokenlane_continuations"
        for m in metric.samples
        if m.name == "tokenlane_continuations_total" and m.value
    }
    assert counted == {(trigger, "ok"): 1}
    # The access line of the continued request names its seam.
    await wait_until(lambda: len(access_lines) >= 2, what="both access lines")
    (plain,) = [line for line in access_lines if line["continuations"] is None]
    (continued,) = [line for line in access_lines if line["continuations"] is not None]
    (seam,) = continued["continuations"]
    assert seam["trigger"] == trigger and seam["to"] == continued["replica"]
    assert seam["from"] == plain["replica"] != seam["to"]
    assert 0 < seam["at_token"] <= fault["after_tokens"]


async def test_a_continued_stream_leaves_no_async_generator_to_the_loop(
    fleet, access_lines
) -> None:
    """The relay's readers of both upstreams (the cut one and the continuation) leave nothing
    suspended for the loop to close after the request (``test_relay.py``'s plain case)."""
    a, _b, url, app, client = fleet
    with generators_left_to_the_loop() as left:
        await a.set_fault({"fault": "cut_close", "after_tokens": 10})
        try:
            got = await _chat(client, url, {"max_tokens": 30, "temperature": 0})
        finally:
            await a.set_fault(None)
        await wait_until(lambda: access_lines, what="the request's access line")  # it returned
        gc.collect()
    assert got[-1] == "[DONE]"
    labels = {"lane": "all", "trigger": "eof", "outcome": "ok"}
    assert _count(app, "tokenlane_continuations_total", **labels) == 1  # continued, indeed
    assert left == []


async def test_ineligible_stream_ends_with_the_error_event(fleet) -> None:
    a, b, url, _app, client = fleet
    await a.set_fault({"fault": "cut_error", "after_tokens": 5})
    got = await _chat(client, url, {"max_tokens": 30, "stop": ["zzzz"]})
    assert got[-1] == "[DONE]" and "error" in got[-2]
    assert not _continuations(b)
    chunks = [e for e in got if isinstance(e, dict) and "choices" in e]
    assert chunks and all(c.get("token_ids") is None for e in chunks for c in e["choices"])


async def test_a_client_asking_for_ids_gets_them_all(fleet) -> None:
    a, _b, url, _app, client = fleet
    body = {"max_tokens": 30, "return_token_ids": True}
    ref = await _chat(client, url, body)
    await a.set_fault({"fault": "cut_close", "after_tokens": 12})
    got = await _chat(client, url, body)
    ids = [
        i
        for e in got
        if isinstance(e, dict)
        for c in e["choices"]
        for i in c.get("token_ids") or []
    ]
    ref_ids = [i for e in ref if isinstance(e, dict) for c in e["choices"]
               for i in c.get("token_ids") or []]  # fmt: skip
    assert ids == ref_ids and len(ids) == 30
    assert got[0]["prompt_token_ids"] == ref[0]["prompt_token_ids"]


async def test_no_other_replica_ends_with_the_error_event(fleet) -> None:
    a, b, url, app, client = fleet
    await b.set_fault({"fault": "cut_close", "after_tokens": 2})
    await a.set_fault({"fault": "cut_close", "after_tokens": 5})
    got = await _chat(client, url, {"max_tokens": 30})
    assert got[-1] == "[DONE]" and "error" in got[-2]
    assert _count(app, "tokenlane_continuations_total", lane="all", trigger="eof",
                  outcome="failed") == 1  # fmt: skip


# -- re-prefill bounds ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "on_target", "max_total", "max_per_replica", "expected"),
    [
        (0, 0, 1, 1, True),
        (1, 0, 1, 8, False),  # the gateway's bound
        (3, 2, 64, 2, False),  # the target's bound
        (3, 1, 64, 2, True),
    ],
)
def test_reprefill_room(
    total: int, on_target: int, max_total: int, max_per_replica: int, expected: bool
) -> None:
    assert has_room(total, on_target, max_total, max_per_replica) is expected


@pytest.mark.parametrize(
    ("on_target", "tokens_on_target", "tokens", "expected"),
    [
        (0, 0, 100, True),
        (0, 0, 90_000, True),  # a replica re-prefilling nothing takes one, however long
        (1, 90_000, 10, False),  # ... and nothing more until it is done
        (3, 30_000, 2_768, True),  # exactly the budget
        (3, 30_000, 2_769, False),  # one token over
        (32, 320, 10, False),  # the count still bounds many short ones
    ],
)
def test_reprefill_room_in_tokens(
    on_target: int, tokens_on_target: int, tokens: int, expected: bool
) -> None:
    assert has_room(0, on_target, 64, 32, tokens_on_target, tokens, 32_768) is expected


def test_the_token_bound_holds_per_replica_and_is_given_back_with_the_slot() -> None:
    slots = Reprefills()
    long = slots.try_take("b", 64, 32, 30_000, 32_768)
    assert long is not None
    assert slots.try_take("b", 64, 32, 3_000, 32_768) is None  # would pass the budget
    short = slots.try_take("b", 64, 32, 2_000, 32_768)
    assert short is not None and slots.tokens_by_replica == {"b": 32_000}
    assert slots.try_take("c", 64, 32, 30_000, 32_768) is not None  # its own budget
    long.release()
    assert slots.tokens_by_replica["b"] == 2_000
    assert slots.try_take("b", 64, 32, 30_000, 32_768) is not None


async def test_a_slot_is_given_back_once_and_wakes_a_waiter() -> None:
    slots = Reprefills()
    first = slots.try_take("b", 64, 1)
    assert first is not None and slots.try_take("b", 64, 1) is None and slots.full == 1
    assert slots.try_take("c", 64, 1) is not None  # another replica has its own bound
    waiter = asyncio.ensure_future(slots.freed(30))
    await asyncio.sleep(0)
    first.release()
    first.release()
    await waiter
    assert slots.by_replica == {"c": 1} and slots.total == 1
    assert slots.peak_by_replica == {"b": 1, "c": 1}


async def test_streams_cut_together_reprefill_on_the_survivor_one_at_a_time() -> None:
    # b takes 0.3 s to its first token, so three streams cut at the same token on a meet a
    # held slot: each waits, none is refused, and b never re-prefills two at once.
    slow_start = SimSettings(step_fixed_s=0.001, decode_per_seq_s=0.0, prefill_per_token_s=0.0,
                             request_overhead_s=0.3)  # fmt: skip
    async with run_sim(SETTINGS, name="a") as a, run_sim(slow_start, name="b") as b:
        policy = policy_for(
            {"a": [a.url], "b": [b.url]},
            lanes=[{"name": "all", "pool": "a", "spill_to": "b"}],
            continuation={"enabled": True, "max_in_flight_per_replica": 1},
        )
        async with running_gateway(policy) as (url, app):
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"max_tokens": 30, "temperature": 0}
                ref = await _chat(client, url, body)
                await a.set_fault({"fault": "cut_close", "after_tokens": 10})
                got = await asyncio.gather(*(_chat(client, url, body) for _ in range(3)))
            relay = app.gateway.relay
    for events in got:
        assert _text(events) == _text(ref) and events[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in events)
    assert len(_continuations(b)) == 3
    (b_name,) = relay.resumer.reprefills.peak_by_replica
    assert relay.resumer.reprefills.peak_by_replica[b_name] == 1
    assert relay.resumer.reprefills.full >= 1  # the bound acted: a continuation waited for the slot
    assert relay.resumer.reprefills.total == 0


@pytest.mark.parametrize(
    ("extra", "lane_switch", "eligible", "refusal"),
    [
        ({}, True, True, None),
        ({"stream": False}, True, False, None),
        ({}, False, False, "disabled"),
        ({"stop": ["x"]}, True, False, "stop"),
    ],
)
def test_explain_says_whether_a_stream_would_continue(
    extra: dict[str, Any], lane_switch: bool, eligible: bool, refusal: str | None
) -> None:
    said = explain(ContinuationConfig(enabled=True), lane_switch, "chat", {**BASE, **extra})
    assert (said["eligible"], said["refusal"]) == (eligible, refusal) and said["why"]


@pytest.mark.parametrize(
    ("enabled", "extra", "reason"), [(False, {}, "disabled"), (True, {"stop": ["zzzz"]}, "stop")]
)
async def test_a_stream_never_continuable_is_counted_by_why_when_its_replica_fails(
    enabled: bool, extra: dict[str, Any], reason: str
) -> None:
    # The plain relay sees a reset (an in-band error it relays unread); the reason is worked
    # out then, from the body the edge parsed.
    async with run_sim(SETTINGS, name="a") as a, run_sim(SETTINGS, name="b") as b:
        policy = policy_for(
            {"a": [a.url], "b": [b.url]},
            lanes=[{"name": "all", "pool": "a", "spill_to": "b"}],
            continuation={"enabled": enabled},
        )
        async with running_gateway(policy) as (url, app):
            await a.set_fault({"fault": "cut_reset", "after_tokens": 5})
            async with httpx.AsyncClient(timeout=30) as client:
                got = await _chat(client, url, {"max_tokens": 30, **extra})
    assert got[-1] == "[DONE]" and "error" in got[-2]
    assert not _continuations(b)
    assert _count(app, "tokenlane_continuation_refusals_total", lane="all", reason=reason) == 1


def test_continuation_is_on_unless_the_policy_turns_it_off() -> None:
    assert explain(ContinuationConfig(), True, "chat", BASE)["eligible"] is True
    off = ContinuationConfig(enabled=False)
    assert explain(off, True, "chat", BASE)["refusal"] == "disabled"
    assert explain(ContinuationConfig(), False, "chat", BASE)["refusal"] == "disabled"  # lane


def test_every_refusal_has_words() -> None:
    assert set(_REFUSAL_WHY) == set(Refusal)


async def test_a_stream_read_in_one_burst_reaches_the_client_whole_without_ids() -> None:
    """The whole stream in one read (as a fast replica's is): its token chunks go through the
    unparsed path, the client gets every event with the ids nulled, and the ids are kept."""
    async with running(tokens=40) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"model": MODEL, "messages": MSGS, "stream": True}
                got = await client.post(url + "/v1/chat/completions", json=body)
                plain = await client.post(
                    up.url + "/v1/chat/completions", json=body
                )  # what a client asking for no ids gets from the replica
    chats = [b for b in up.stats.bodies if b.get("messages") == MSGS]
    assert [b.get("return_token_ids") for b in chats] == [True, None]  # asked upstream

    def without_null_ids(events: list[Any]) -> list[Any]:
        # vLLM writes the keys as null without the flag; the fake leaves them out.
        out = []
        for e in events:
            if isinstance(e, dict):
                e = {k: v for k, v in e.items() if not (k == "prompt_token_ids" and v is None)}
                e["choices"] = [
                    {k: v for k, v in c.items() if not (k == "token_ids" and v is None)}
                    for c in e["choices"]
                ]
            out.append(e)
        return out

    got_events = data_events(got.text)
    assert len(got_events) == 43  # role, 40 tokens, finish, [DONE]
    assert without_null_ids(got_events) == without_null_ids(data_events(plain.text))
    assert all(c.get("token_ids") is None for e in got_events[:-1] for c in e["choices"])


async def test_a_continuation_waits_for_a_replica_on_its_canary() -> None:
    """No replica can take the stream now, but one is on its canary (as when an ejection held
    back by the cap has the ejected ones probed at once): the continuation waits for it, with
    keep-alives, within the start timeout, instead of giving the stream up."""
    async with run_sim(SETTINGS, name="a") as a, run_sim(SETTINGS, name="b") as b:
        policy = policy_for(
            {"a": [a.url], "b": [b.url]},
            lanes=[{"name": "all", "pool": "a", "spill_to": "b"}],
            continuation={"enabled": True, "keepalive_s": 0.2, "start_timeout_s": 60},
        )
        async with running_gateway(policy) as (url, _):
            async with httpx.AsyncClient(timeout=60) as client:
                body = {**BASE, "max_tokens": 40, "temperature": 0}
                ref = await _chat(client, url, body)
                r = await client.post(url + "/admin/replicas/eject", json={"url": b.url})
                assert r.status_code == 200, r.text
                # b comes back through a canary that cannot answer while its engine is frozen.
                await b.set_fault({"fault": "stall"})
                r = await client.post(url + "/admin/replicas/readmit", json={"url": b.url})
                assert r.status_code == 200, r.text
                await a.set_fault({"fault": "cut_close", "after_tokens": 10})
                raw = b""
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as s:
                    async for part in s.aiter_raw():
                        raw += part
                        if b": keep-alive" in raw and b.engine.stalled:
                            await b.set_fault(None)  # the canary answers; b is back
    got = data_events(raw.decode())
    assert b": keep-alive" in raw  # it waited
    assert _text(got) == _text(ref) and got[-1] == "[DONE]"
    assert not any("error" in e for e in got if isinstance(e, dict))
    assert _continuations(b)


async def test_a_continuation_with_no_target_probes_an_ejected_replica_back_at_once() -> None:
    """The only other replica was ejected for failing and its fault has lifted (its /health
    answers), but its ejection would last a minute: a stream cut now has it probed at once,
    waits for its canary and is continued there, instead of ending with no_target."""
    async with run_sim(SETTINGS, name="a") as a, run_sim(SETTINGS, name="b") as b:
        policy = policy_for(
            {"a": [a.url], "b": [b.url]},
            lanes=[{"name": "all", "pool": "a", "spill_to": "b"}],
            health={"eject_base_s": 60, "unhealthy_threshold": 1},
            continuation={"enabled": True, "keepalive_s": 0.2, "start_timeout_s": 60},
        )
        async with running_gateway(policy) as (url, app):
            r_b = app.gateway.fleet.find(b.url)[0]
            async with httpx.AsyncClient(timeout=60) as client:
                body = {**BASE, "max_tokens": 40, "temperature": 0}
                ref = await _chat(client, url, body)
                await b.set_fault({"fault": "health_fail"})
                await wait_until(lambda: r_b.state.value == "ejected", what="b ejected")
                await b.set_fault(None)
                await wait_until(lambda: r_b.health_ok, what="b's /health answers again")
                assert r_b.state.value == "ejected"  # and would be for a minute
                await a.set_fault({"fault": "cut_close", "after_tokens": 10})
                got = await _chat(client, url, body)
    assert _text(got) == _text(ref) and got[-1] == "[DONE]"
    assert not any("error" in e for e in got if isinstance(e, dict))
    assert _continuations(b)
    assert r_b.state.value == "healthy"


def test_a_continuation_waits_only_for_a_probing_replica_it_could_take() -> None:
    from proxy.fleet.fleet import Fleet, ReplicaState
    from proxy.observe.metrics import Metrics
    from proxy.policyfile import build_policy
    from proxy.routing.admission import Admission
    from proxy.routing.pick import Picker

    urls = ["http://a:1", "http://b:1", "http://d:1"]
    policy = build_policy(
        {
            "pools": {"p": {"replicas": [{"url": u} for u in urls]}},
            "lanes": [{"name": "all", "pool": "p"}],
        }
    )
    metrics = Metrics()
    fleet = Fleet(policy, {}, metrics=metrics)
    a, b, dead = fleet.replicas()
    for r, state, health_ok in (
        (a, ReplicaState.PROBING, True),  # on its canary
        (b, ReplicaState.HEALTHY, True),
        (dead, ReplicaState.PROBING, False),  # probing, /health failing: for ever
    ):
        r.models = {"m": {"id": "m"}}
        r.state, r.health_ok = state, health_ok
    picker = Picker(fleet, Admission(fleet, metrics), metrics, lambda: policy, random.Random())

    def probing(tried: set[Any], pinned: str | None = None) -> bool:
        call = a_call(policy.lanes[0])
        call.tried, call.pinned = tried, pinned
        return picker.probing(call)

    assert probing(set())  # a is on its canary
    assert not probing({a})  # but the stream already failed there: the pick never takes it
    assert not probing(set(), pinned=b.url)  # pinned elsewhere
    a.state = ReplicaState.HEALTHY
    assert not probing(set())  # a dead replica probes for ever: not worth the wait


@pytest.mark.parametrize(
    ("live", "alone"), [(0, True), (1, True), (2, True), (3, False), (64, False)]
)
def test_the_first_content_goes_alone_only_with_at_most_two_requests_in_flight(
    live: int, alone: bool
) -> None:
    assert first_content_alone(live) is alone


@pytest.mark.parametrize(("others", "alone"), [(0, True), (1, True), (2, False), (3, False)])
async def test_a_burst_of_an_eligible_stream_sends_its_first_token_then_the_rest_at_once(
    others: int, alone: bool
) -> None:
    """Continuation on, a 64-token stream that comes in one read (as the overhead benchmark's
    mock sends it). With few requests in flight, the response start carries the events up to
    the first content (the role chunk and the first token), sent before the rest is read; the
    rest and the body's end follow in one message (one socket write under the gateway's
    server). With more in flight (``first_content_alone``), the whole read goes in the start.
    Either way every event arrives once, in order, the ids hidden."""
    assert first_content_alone(1 + others) is alone  # this request and the others
    async with (
        running() as up,
        running_gateway(policy_for({"p": [up.url]}, continuation={"enabled": True})) as (_, app),
    ):
        body = json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        ).encode()
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"host", b"gw")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
            "extensions": {START_WITH_BODY: {}, CLIENT_GONE: ClientGoneHook()},
        }  # fmt: skip
        # Requests of others in flight, as the relay counts them.
        live: set[Any] = app.gateway.relay.live
        placeholders = [object() for _ in range(others)]
        live.update(placeholders)
        try:
            await app(scope, receive, send)
        finally:
            live.difference_update(placeholders)
        # Eligible: asked for the ids, the client's bytes otherwise as they came.
        assert up.stats.raw_bodies[-1] == body[:-1] + b',"return_token_ids":true}'
    start = sent[0]
    assert start["type"] == "http.response.start"
    if alone:
        assert len(sent) == 2 and start[START_MORE_BODY] is True
        first = data_events(start[START_BODY].decode())
        assert [e["choices"][0]["delta"] for e in first] == [
            {"role": "assistant", "content": ""},
            {"content": " tok0"},
        ]
        rest = sent[1]
        assert rest["type"] == "http.response.body" and rest["more_body"] is False
        whole = start[START_BODY] + rest["body"]
    else:
        assert len(sent) == 1 and start[START_MORE_BODY] is False
        whole = start[START_BODY]
    events = data_events(whole.decode())
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["delta"].get("content") for e in events[:65]] == (
        [""] + [f" tok{i}" for i in range(64)]
    )  # the role chunk, then 64 tokens in order
    assert events[65]["choices"][0]["finish_reason"] is not None and len(events) == 67
    assert b'"token_ids":[' not in whole


async def test_a_continuation_answered_in_one_write_reaches_the_client_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The continuation's replica sends its whole answer in one write: the events after its
    first token in that read (more tokens, the finish, [DONE]) are relayed from it, not
    dropped while the relay waits for a read that never comes."""
    answers = [
        fake.stream_events(5, token_ids=True),  # the first replica's, cut after two tokens
        _three_tokens_and_the_end(),
    ]
    got, continued = await _continued(monkeypatch, answers, cut_after=2)
    assert continued["max_tokens"] == 3
    assert _text(got) == " tok0 tok1 c1 c2 c3"


async def test_an_error_after_the_first_token_in_the_same_read_is_continued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first token goes out as soon as it is read: an in-stream 5xx error after it in the
    same read is met after the client has bytes, as if in the next read, so the stream is
    continued (not retried from the start, as it was while a whole read was taken first)."""
    error = b'data: {"error":{"message":"engine died","type":"Error","param":null,"code":500}}'
    answers = [
        [*fake.stream_events(5, token_ids=True)[:3], error + b"\n\n"],  # role, 2 tokens, error
        _three_tokens_and_the_end(),
    ]
    got, continued = await _continued(monkeypatch, answers, cut_after=None)
    assert continued["prompt"][-2:] == [1000, 1001] and continued["max_tokens"] == 3
    assert _text(got) == " tok0 tok1 c1 c2 c3"


async def test_a_busy_gateway_retries_an_error_after_the_first_token_in_the_same_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With other requests in flight the whole first read is taken before anything is sent
    (``first_content_alone``): an in-stream error after the first token in that read is met
    before the client has bytes, so the request is retried from its start on the other
    replica, and the client gets that replica's stream alone, whole."""
    error = b'data: {"error":{"message":"engine died","type":"Error","param":null,"code":500}}'
    whole = fake.stream_events(5, token_ids=True)
    answers = [[*whole[:3], error + b"\n\n"], whole]  # role, 2 tokens, error; then all of it
    monkeypatch.setattr(fake, "events_for", lambda *a, **k: answers.pop(0))
    async with running() as a, running() as b:
        policy = policy_for(
            {"a": [a.url], "b": [b.url]},
            lanes=[{"name": "all", "pool": "a", "spill_to": "b"}],
            continuation={"enabled": True},
        )
        async with running_gateway(policy) as (url, app), httpx.AsyncClient(timeout=30) as client:
            live: set[Any] = app.gateway.relay.live
            placeholders = [object() for _ in range(FIRST_CONTENT_ALONE_UP_TO)]
            live.update(placeholders)
            try:
                body = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 5}
                got = data_events((await client.post(url + "/v1/chat/completions", json=body)).text)
            finally:
                live.difference_update(placeholders)
    assert not answers  # both replicas answered
    chats = [x for x in b.stats.bodies if x.get("messages") == MSGS]
    assert len(chats) == 1  # the request itself, from its start: no continuation on b
    assert not any(isinstance(x.get("prompt"), list) for x in b.stats.bodies)
    assert got[-1] == "[DONE]" and not any("error" in e for e in got if isinstance(e, dict))
    assert _text(got) == "".join(f" tok{i}" for i in range(5))


def _three_tokens_and_the_end() -> list[bytes]:
    """A continuation's answer: " c1 c2 c3", the finish, [DONE]."""
    tokens = [_completion(f" c{i}", [2000 + i]) for i in (1, 2, 3)]
    return [*tokens, _completion("", [], "length"), b"data: [DONE]\n\n"]


def _completion(text: str, ids: list[int], finish: str | None = None) -> bytes:
    """A /v1/completions chunk with its token ids, as vLLM writes it."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
              "stop_reason": None, "token_ids": ids}  # fmt: skip
    obj = {"id": "cmpl-b", "object": "text_completion", "created": 2, "model": MODEL,
           "choices": [choice]}  # fmt: skip
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _continued(
    monkeypatch: pytest.MonkeyPatch, answers: list[list[bytes]], cut_after: int | None
) -> tuple[list[Any], dict[str, Any]]:
    """A stream on replica ``a`` continued on ``b``, each answering the next of ``answers``
    (``a``'s cut after ``cut_after`` tokens, else sent in one write as ``b``'s is); the
    client's events and the continuation request ``b`` received."""
    monkeypatch.setattr(fake, "events_for", lambda *a, **k: answers.pop(0))
    async with running() as a, running() as b:
        a.cut_after = cut_after
        policy = policy_for(
            {"a": [a.url], "b": [b.url]},
            lanes=[{"name": "all", "pool": "a", "spill_to": "b"}],
            continuation={"enabled": True},
        )
        async with running_gateway(policy) as (url, _), httpx.AsyncClient(timeout=30) as client:
            body = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 5}
            got = data_events((await client.post(url + "/v1/chat/completions", json=body)).text)
    assert not answers  # both replicas answered
    # (``b``'s health canary asks /v1/completions too, with a text prompt)
    (continued,) = [body for body in b.stats.bodies if isinstance(body.get("prompt"), list)]
    assert got[-1] == "[DONE]" and not any("error" in e for e in got if isinstance(e, dict))
    finishes = [c["finish_reason"] for e in got[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    return got, continued
