"""``validate.parse_json_object``: msgspec first, ``json`` for what msgspec refuses; the same
objects as ``json.loads`` wherever it parses, and the same errors (``json``'s words)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.edge.validate import parse_json_object
from proxy.errors import BadRequest

# json takes these and msgspec does not: parsed by json, as vLLM's FastAPI parses them.
ONLY_JSON = [
    b'{"temperature": NaN}',
    b'{"a": Infinity, "b": -Infinity}',
    b'{"a": 1e999}',
    b'{"a": "\\ud800"}',  # a lone surrogate
]
BOTH = [
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}',
    b'{"a": -0.0, "b": -0, "c": 0.1, "d": 5e-324, "e": 1.7976931348623157e308}',
    b'{"a": 123456789012345678901234567890, "b": -9223372036854775809}',
    b'{"a": 1, "a": 2}',  # the last one wins in both
    b'{"a": "\\ud83d\\ude00 \\u0000 \\u00e9 \xc3\xa9", "\\u00e9": null}',
    b' \r\n\t{"a": [true, false, null, {}, []]} \n',
]
REFUSED = [
    b"",
    b"\xff{}",  # not UTF-8
    b'{"a": "\xae"}',  # not UTF-8 inside a string (msgspec raises UnicodeDecodeError)
    b'\xef\xbb\xbf{"a": 1}',  # a BOM
    b'{"a": "x\ny"}',  # a raw control character in a string
    b'{"a": 01}',
    b'{"a": [1,]}',
    b"{'a': 1}",
    b'{"a": 1} x',
    b"[" * 5000 + b"]" * 5000,  # nested too deeply
]


@pytest.mark.parametrize("raw", ONLY_JSON + BOTH)
def test_a_body_json_parses_is_what_json_parses(raw: bytes) -> None:
    assert repr(parse_json_object(raw)) == repr(json.loads(raw.decode()))


def _json_error(raw: bytes) -> str:
    """What the gateway said of ``raw`` when ``json`` alone parsed bodies."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"request body is not valid UTF-8 (byte {exc.start})"
    try:
        json.loads(text)
    except RecursionError:
        return "request body is nested too deeply"
    except ValueError as exc:
        return f"request body is not valid JSON: {exc}"
    raise AssertionError("json parsed it")


@pytest.mark.parametrize("raw", REFUSED)
def test_a_body_neither_parses_is_refused_in_json_s_words(raw: bytes) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_json_object(raw)
    assert caught.value.message == _json_error(raw)


@pytest.mark.parametrize(("raw", "kind"), [(b"[1]", "list"), (b"3", "int"), (b"NaN", "float")])
def test_a_body_that_is_no_object_is_refused(raw: bytes, kind: str) -> None:
    with pytest.raises(BadRequest, match=f"must be a JSON object, not {kind}"):
        parse_json_object(raw)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(), JSON, max_size=6), st.booleans())
def test_any_object_json_writes_is_read_back_as_json_reads_it(
    body: dict[str, Any], ascii_only: bool
) -> None:
    raw = json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    try:
        want = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:  # a lone surrogate written raw: not UTF-8, refused either way
        with pytest.raises(BadRequest):
            parse_json_object(raw)
        return
    assert repr(parse_json_object(raw)) == repr(want)


def _as_json_alone(raw: bytes) -> object:
    """What the gateway made of ``raw`` when ``json`` alone parsed bodies: the object, or the
    words of its refusal."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return _json_error(raw)
    return body if isinstance(body, dict) else f"not an object: {type(body).__name__}"


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.builds(
            lambda head, cut, tail: head[:cut] + tail,
            st.sampled_from(BOTH + ONLY_JSON),
            st.integers(0, 80),
            st.binary(max_size=8),
        ),
    )
)
def test_any_bytes_get_what_json_alone_made_of_them(raw: bytes) -> None:
    try:
        got: object = parse_json_object(raw)
    except BadRequest as exc:
        got = exc.message
        if got.startswith("request body must be a JSON object, not "):
            got = "not an object: " + got.rsplit(" ", 1)[1]
    assert repr(got) == repr(_as_json_alone(raw))
