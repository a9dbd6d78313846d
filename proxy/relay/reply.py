"""A replica's answer as the relay reads it (``Reply``): what ``httpx.Response`` over
``upstream.RawResponseStream`` gave the relay, without its per-request objects (a request's
URL, two header collections, the response's streams). Compiled with the rest of the request
path (``proxy/compiled.py``); ``upstream.RelayTransport`` wraps one in an ``httpx.Response``
for the transport's other users (the health loop)."""

from __future__ import annotations

from proxy.headers import LOWER
from proxy.relay.h1 import H1Connection, H1Pool, Handler, Origin


class Reply:
    """A replica's answer as the relay reads it: its status, its headers as the wire had them,
    its body read as the socket gave it (``chunks``, ``aread``) or pumped (``pump``);
    ``aclose`` hands the connection back to the pool."""

    __slots__ = ("_origin", "_pool", "_released", "conn", "headers", "status_code")

    def __init__(self, pool: H1Pool, origin: Origin, conn: H1Connection) -> None:
        self._pool = pool
        self._origin = origin
        self.conn = conn
        self._released = False
        self.status_code: int = conn.status
        self.headers = ReplyHeaders(conn.headers)

    def chunks(self) -> Reads:
        """The body's reads, each what arrived since the last."""
        return Reads(self.conn)

    async def pump(self, handler: Handler) -> bytes | None:
        """``H1Connection.pump``: None at the body's end, else what the handler returned."""
        return await self.conn.pump(handler)

    def at_eof(self) -> bool:
        """Everything the replica sent has been read: the last read held the end too."""
        conn = self.conn
        return conn.complete and not conn.chunks and not conn.declined

    async def aread(self) -> bytes:
        """The rest of the body, whole."""
        return b"".join([chunk async for chunk in Reads(self.conn)])

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            self._pool.release(self._origin, self.conn)


class ReplyHeaders:
    """An answer's headers: ``raw`` as the wire had them; ``get`` as ``httpx.Headers.get``
    (any case, repeated values joined with ", ")."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    def get(self, name: str, default: str = "") -> str:
        key = name.lower().encode("latin-1")
        values = [v for k, v in self.raw if k.translate(LOWER) == key]
        if not values:
            return default
        return b", ".join(values).decode("latin-1")


class Reads:
    """An answer's body reads, each what arrived since the last; a class, not an async
    generator: a reader that stops early (at its first content, or at ``[DONE]``) leaves no
    suspended generator for the event loop to close in a task of its own after the request
    (``tests/test_relay.py::test_a_relayed_stream_leaves_no_async_generator_to_the_loop``)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: H1Connection) -> None:
        self._conn: H1Connection | None = conn

    def __aiter__(self) -> Reads:
        return self

    async def __anext__(self) -> bytes:
        # Over for good once it ended or raised, as a generator is: the connection may serve
        # another request by then.
        conn = self._conn
        if conn is None:
            raise StopAsyncIteration
        try:
            chunk = await conn.next_chunk()
        except BaseException:
            self._conn = None
            raise
        if chunk:
            return chunk
        self._conn = None
        raise StopAsyncIteration


__all__ = ["Reads", "Reply", "ReplyHeaders"]
