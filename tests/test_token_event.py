"""The continuation relay's unparsed path (``token_event`` and ``Splice.take_ids``): an
ordinary token chunk read without parsing it must note exactly what parsing it would, and be
relayed exactly as ``strip_ids`` would write it; anything else is left to the parser."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.relay.continuation import Splice, strip_ids, token_event

BODY: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "stream": True}
HEAD = '"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m"'


def chat_chunk(
    content: Any, ids: list[int] | None, finish: str | None = None, **extra: Any
) -> bytes:
    delta = {} if content is None else {"content": content}
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": finish}  # fmt: skip
    if ids is not None:
        choice["token_ids"] = ids
    choice.update(extra.pop("choice", {}))
    obj = {**json.loads("{" + HEAD + "}"), "choices": [choice], **extra}
    # vLLM writes compact JSON with non-ASCII text as itself
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def completion_chunk(text: str, ids: list[int]) -> bytes:
    obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None,
                        "token_ids": ids}]}  # fmt: skip
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode()


def started(kind: str = "chat") -> Splice:
    sp = Splice(kind, BODY, False)
    sp.observe({"id": "chatcmpl-1", "created": 1, "model": "m", "choices": []})
    return sp


def both_ways(ev: bytes, kind: str = "chat") -> tuple[Any, Any]:
    """(what the parser notes, what the unparsed path notes) of one event."""
    parsed, fast = started(kind), started(kind)
    parsed.observe(json.loads(ev[6:]))
    found = token_event(ev, kind)
    assert found is not None, ev
    fast.take_ids(ev, *found)
    out = ev[: found[0]] + b"null" + ev[found[1] + 1 :]
    note = lambda sp: (sp.ids, sp.text_ids, sp.reasoning_open, sp.finish_reason)  # noqa: E731
    return (note(parsed), strip_ids(ev)), (note(fast), out)


@pytest.mark.parametrize(
    ("event", "kind", "taken"),
    [
        (chat_chunk(" word", [12]), "chat", (True, [12])),
        (chat_chunk("", [12, 13]), "chat", (False, [12, 13])),  # a character's first bytes
        (chat_chunk(None, []), "chat", (False, [])),
        (completion_chunk(" a", [5]), "completion", (True, [5])),
        (completion_chunk("", [5]), "completion", (False, [5])),
        # left to the parser:
        (chat_chunk("x", [1], "stop"), "chat", None),  # finished
        (chat_chunk("x", [1], "abort"), "chat", None),
        (chat_chunk("x", None), "chat", None),  # no ids
        (chat_chunk("x", [1], prompt_token_ids=[1, 2]), "chat", None),  # the first chunk
        (chat_chunk("x", [1], usage={"prompt_tokens": 1}), "chat", None),
        (chat_chunk("x", [1], system_fingerprint="fp"), "chat", None),
        (chat_chunk(None, [1], choice={"delta": {"tool_calls": [{"index": 0}]}}), "chat", None),
        (chat_chunk(None, [1], choice={"delta": {"reasoning_content": "hm"}}), "chat", None),
        (b'data: {"error":{"message":"x","code":500}}', "chat", None),
        (b"data: [DONE]", "chat", None),
        (b": keep-alive", "chat", None),
        (chat_chunk("x", [1]).replace(b'"token_ids":[1]', b'"token_ids": [1]'), "chat", None),
        (chat_chunk("x", [1]).replace(b":null", b": null"), "chat", None),
        (chat_chunk("x", [1]).replace(b"[1]", b"[1,,2]"), "chat", None),
        (chat_chunk("x", [1]).replace(b"[1]", b"[1,]"), "chat", None),
        (chat_chunk("x", [1]).replace(b"[1]", b'["a"]'), "chat", None),
    ],
)
def test_token_event_takes_only_ordinary_token_chunks(event: bytes, kind: str, taken: Any) -> None:
    found = token_event(event, kind)
    if taken is None:
        assert found is None
        return
    assert found is not None
    sp = started(kind)
    sp.take_ids(event, *found)
    assert (found[2], sp.ids) == taken


def test_two_choices_are_left_to_the_parser() -> None:
    ev = chat_chunk("a", [1])
    obj = json.loads(ev[6:])
    obj["choices"].append({**obj["choices"][0], "index": 1})
    assert token_event(b"data: " + json.dumps(obj, separators=(",", ":")).encode(), "chat") is None


# Text that looks like the keys the unparsed path looks for: escaped inside a JSON string, so
# never taken for them.
TRICKY = st.sampled_from(['"token_ids":[1]', '"finish_reason":null', '"error"', "\\", '"',
                          '"content":"', "]", "[", ",", "é", "🙂", "\n"])  # fmt: skip
TEXT = st.lists(st.one_of(st.text(max_size=5), TRICKY), max_size=6).map("".join)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(text=TEXT, ids=st.lists(st.integers(0, 2**31), max_size=4))
def test_the_unparsed_path_notes_and_writes_what_parsing_does(text: str, ids: list[int]) -> None:
    for ev, kind in ((chat_chunk(text, ids), "chat"), (completion_chunk(text, ids), "completion")):
        parsed, fast = both_ways(ev, kind)
        assert fast == parsed
