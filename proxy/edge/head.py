"""A response's head as the gateway's server writes it (``proxy.edge.cycle``): the status
line, the headers checked and framed, and the first body framed after them, in one compiled
pass and one vectored write; and a chunk's framing.

The rules are uvicorn's (``RequestResponseCycle.send``, which the server followed until it had
its own protocol): each header name and value checked against the bytes HTTP allows, names
lowered, Content-Length and Transfer-Encoding read, ``Connection: close`` honoured, chunked
framing where the app gave no length (not for HEAD, 204 or 304). ``tests/test_head.py`` holds
the bytes and state to uvicorn's own, and ``InvalidResponse`` to where uvicorn raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

from proxy.errors import InvalidResponse
from proxy.headers import LOWER
from proxy.relay.sse import contains

# The bytes uvicorn's expressions take in a header name and a header value, read off them.
_NAME_BYTES: Final = bytes(b for b in range(256) if HEADER_RE.search(bytes([b])) is None)
_VALUE_BYTES: Final = bytes(b for b in range(256) if HEADER_VALUE_RE.search(bytes([b])) is None)
# As tables: a byte taken becomes 0, one refused 1. ``translate(None, taken)`` builds its table
# of deleted bytes on every call (about 2,500 instructions a call for the values' 200, counted
# with callgrind, two a response); ``translate(table)`` reads one made here.
_NAME_REFUSED: Final = bytes(0 if b in _NAME_BYTES else 1 for b in range(256))
_VALUE_REFUSED: Final = bytes(0 if b in _VALUE_BYTES else 1 for b in range(256))
_REFUSED: Final = b"\x01"
# A static of the compiled module: an imported name is looked up in its dict at each read.
_STATUS_LINE: Final[dict[int, bytes]] = STATUS_LINE
_CRLF: Final = b"\r\n"
_SEP: Final = b": "
_LAST_CHUNK: Final = b"0\r\n\r\n"
# The size lines of chunks under 2 KiB (a token's event is a few hundred bytes), made once:
# a chunk framed by two concatenations costs about half what formatting it did (callgrind).
_SIZE_LINES: Final = [b"%x\r\n" % n for n in range(2048)]


def _size_line(n: int) -> bytes:
    """A chunk's size line, for a chunk of ``n`` bytes."""
    return _SIZE_LINES[n] if n < 2048 else b"%x\r\n" % n


# From this size a chunk is written as its three parts (one vectored write) rather than
# copied into one: a burst's whole answer (64 events, 16 KB) was copied twice by the framing.
_WHOLE_BELOW: Final = 4096


def write_chunk(transport: asyncio.WriteTransport, data: bytes, last: bool) -> None:
    """``data`` written as one chunk of a chunked body (``last``: and the body's end; ``data``
    may then be empty): a small one in one copy, a large one as its parts."""
    n = len(data)
    if n >= _WHOLE_BELOW:
        transport.writelines([_size_line(n), data, _CRLF + _LAST_CHUNK if last else _CRLF])
    elif not last:
        transport.write(_size_line(n) + data + _CRLF)
    elif data:
        transport.write(_size_line(n) + data + _CRLF + _LAST_CHUNK)
    else:
        transport.write(_LAST_CHUNK)


class Start:
    """The bytes to write (in order, one vectored write) and the cycle's state after them."""

    __slots__ = ("chunked", "complete", "keep_alive", "length", "parts")

    def __init__(
        self,
        parts: list[bytes],
        chunked: bool | None,
        length: int,
        keep_alive: bool,
        complete: bool,
    ) -> None:
        self.parts = parts
        self.chunked = chunked  # None: neither (HEAD, 204, 304 without a length), as send
        self.length = length  # the cycle's expected_content_length: what is left to send
        self.keep_alive = keep_alive
        self.complete = complete


def response_start(
    status: int,
    headers: Iterable[Any],
    default_headers: list[tuple[bytes, bytes]],
    method: str,
    chunked: bool | None,
    length: int,
    keep_alive: bool,
    body: bytes | list[bytes],
    more_body: bool,
) -> Start:
    """The status line, ``default_headers`` then ``headers``, and ``body`` framed (as uvicorn
    writes a start then a body message); ``chunked``, ``length`` and ``keep_alive`` are the
    cycle's state before them. A plain start is one with no body and more to come. A body
    given as parts (``asgi_ext.START_BODY``) is framed as their whole and written part by part.

    The pairs are read into names and values, then framed as typed bytes. Pairs that are
    tuples of two bytes (the relay's own, and the server's defaults) are read without the
    generic protocols: read through them (an iterator to unpack each pair, a generic
    comparison per name, a tuple concatenated per header), a relayed stream's start cost about
    21,000 instructions (callgrind), typed about 15,000."""
    line = _STATUS_LINE.get(status)
    if line is None:
        raise InvalidResponse(f"Invalid HTTP status code {status!r}.")
    split = _names_and_values(default_headers, headers)
    names, values = split if split is not None else _any_names_and_values(default_headers, headers)
    # uvicorn searches each name and each value with an expression that is one character
    # class: a byte it refuses is one the table maps to 1, over all the names (values) joined
    # (sre scans ~10 ns a byte; ``translate`` ~1). ``contains``: ``in`` on bytes costs more.
    if contains(b"".join(names).translate(_NAME_REFUSED), _REFUSED):
        raise InvalidResponse("Invalid HTTP header name.")
    if contains(b"".join(values).translate(_VALUE_REFUSED), _REFUSED):
        raise InvalidResponse("Invalid HTTP header value.")
    parts: list[bytes] = [line]
    closing = False
    for i in range(len(names)):
        name = names[i].translate(LOWER)
        value = values[i]
        if name == b"content-length" and chunked is None:
            try:
                length = int(value.decode())
            except ValueError:
                raise InvalidResponse(f"Invalid Content-Length {value!r}.") from None
            chunked = False
        elif name == b"transfer-encoding" and value.lower() == b"chunked":
            length = 0
            chunked = True
        elif name == b"connection":
            if b"close" in [token.lower().strip() for token in value.split(b",")]:
                keep_alive = False
                closing = True
        parts.append(name)
        parts.append(_SEP)
        parts.append(value)
        parts.append(_CRLF)
    if not keep_alive and not closing:
        parts.append(b"connection: close\r\n")
    if chunked is None and method != "HEAD" and status != 204 and status != 304:
        chunked = True
        parts.append(b"transfer-encoding: chunked\r\n")
    parts.append(_CRLF)
    size = _body_size(body)
    if method == "HEAD":
        length = 0
    elif chunked:
        if size:
            parts.append(_size_line(size))
            _add_body(parts, body)
            parts.append(_CRLF)
        if not more_body:
            parts.append(_LAST_CHUNK)
    else:
        if size > length:
            raise InvalidResponse("Response content longer than Content-Length")
        length -= size
        if size:
            _add_body(parts, body)
    if not more_body and length != 0:
        raise InvalidResponse("Response content shorter than Content-Length")
    return Start(parts, chunked, length, keep_alive, not more_body)


def _body_size(body: bytes | list[bytes]) -> int:
    """A start's body length, given whole or as parts. Parts are told apart as a list:
    compiled, a ``bytes`` argument may still hold a bytearray."""
    if isinstance(body, list):
        size = 0
        for piece in body:
            size += len(piece)
        return size
    return len(body)


def _add_body(parts: list[bytes], body: bytes | list[bytes]) -> None:
    """The body after the head's ``parts``: its parts as they are, for one vectored write."""
    if isinstance(body, list):
        parts += body
    else:
        parts.append(body)


def _names_and_values(default_headers: Any, headers: Any) -> tuple[list[bytes], list[bytes]] | None:
    """Every pair's name and value, when ``default_headers`` and ``headers`` are lists or
    tuples of pairs that are each a tuple of two bytes; else None (nothing consumed: an
    iterable of another kind is read once, by ``_any_names_and_values``)."""
    names: list[bytes] = []
    values: list[bytes] = []
    for group in (default_headers, headers):
        if not isinstance(group, (list, tuple)):
            return None
        for pair in group:
            if not isinstance(pair, tuple) or len(pair) != 2:
                return None
            name = pair[0]
            value = pair[1]
            if not isinstance(name, bytes) or not isinstance(value, bytes):
                return None
            names.append(name)
            values.append(value)
    return names, values


def _any_names_and_values(
    default_headers: Iterable[Any], headers: Iterable[Any]
) -> tuple[list[bytes], list[bytes]]:
    """The pairs as an app may give them (uvicorn takes lists as well as tuples, and any
    bytes-like object), as bytes: a pair of another length, or a name or value that is not
    bytes-like, raises as uvicorn's unpacking and joins do (``ValueError``, ``TypeError``)."""
    names: list[bytes] = []
    values: list[bytes] = []
    for name, value in [*default_headers, *headers]:
        names.append(_as_bytes(name))
        values.append(_as_bytes(value))
    return names, values


def _as_bytes(data: Any) -> bytes:
    """A bytes-like name or value as bytes; anything else (a str, an int) a ``TypeError``."""
    return data if type(data) is bytes else bytes(memoryview(data))


__all__ = ["Start", "response_start", "write_chunk"]
