"""``sse.FIND`` and ``sse.RFIND`` (``proxy/relay/_bytesearch.c`` in the compiled build): exactly
``bytes.find`` and ``bytes.rfind`` for any bytes and any indices, and ``proxy.headers.lower``
exactly ``bytes.lower``."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import compiled
from proxy.headers import lower
from proxy.relay import sse

SMALL = st.integers(-12, 40)


def test_the_compiled_build_searches_in_c() -> None:
    if compiled.status.startswith("compiled"):
        assert type(sse.FIND).__name__ == "builtin_function_or_method"
        assert sse.FIND.__module__ == "proxy.relay._bytesearch"
    else:
        assert sse.FIND is sse._find and sse.RFIND is sse._rfind


@settings(max_examples=3_000, deadline=None)
@given(data=st.binary(max_size=40), sub=st.binary(max_size=4), start=SMALL, end=SMALL)
def test_find_and_rfind_are_bytes_own(data: bytes, sub: bytes, start: int, end: int) -> None:
    assert sse.FIND(data, sub, start, end) == data.find(sub, start, end)
    assert sse.RFIND(data, sub, start, end) == data.rfind(sub, start, end)


def test_find_and_rfind_over_events_and_huge_indices() -> None:
    # Texts like the relay's (events, ids, keys), every window, and indices past Py_ssize_t.
    rng = random.Random(5)
    pieces = [b'"token_ids":[', b"]", b"12,", b"\n", b"\n\n", b'"', b"data: ", b"x", b"\\"]
    for _ in range(5_000):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12)))
        sub = rng.choice([*pieces, b"", data[: rng.randrange(len(data) + 1)]])
        n = len(data)
        for start, end in [(0, n), (rng.randrange(-n - 2, n + 3), rng.randrange(-n - 2, n + 3))]:
            assert sse.FIND(data, sub, start, end) == data.find(sub, start, end)
            assert sse.RFIND(data, sub, start, end) == data.rfind(sub, start, end)
    for big in (2**63, -(2**63), 2**80, -(2**80)):
        assert sse.FIND(b"abcabc", b"c", big, 2**90) == b"abcabc".find(b"c", big, 2**90)
        assert sse.RFIND(b"abcabc", b"c", 0, big) == b"abcabc".rfind(b"c", 0, big)


@pytest.mark.parametrize("bad", [("ab", b"a", 0, 2), (b"ab", bytearray(b"a"), 0, 2)])
def test_what_is_not_bytes_is_refused(bad: tuple[object, ...]) -> None:
    if sse.FIND is sse._find:
        pytest.skip(f"no C search: the gateway runs {compiled.status}")
    with pytest.raises(TypeError):
        sse.FIND(*bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        sse.RFIND(*bad)  # type: ignore[arg-type]


def test_lower_is_bytes_lower_for_every_byte() -> None:
    every = bytes(range(256))
    assert lower(every) == every.lower()
    assert lower(b"Content-Type") == b"content-type" and lower(b"") == b""
