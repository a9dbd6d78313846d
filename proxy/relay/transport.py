"""The aiohttp transport under the relay's ``httpx`` client, trimmed for a proxy.

``httpx_aiohttp.AiohttpTransport`` converts every request and response for the general case:
a new ``ClientTimeout`` per request, the body looked up through ``request.content``, and a
response stream read in 16 KiB slices through two generator layers. A relay sends the same
few timeouts over and over and wants each chunk as it arrived, so this subclass keeps those
conversions once and reads what the socket gave (``readany``). Errors are mapped exactly as
the parent maps them (``map_aiohttp_exceptions``), so callers see the same ``httpx`` errors
with the aiohttp error as their cause.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
from aiohttp import ClientSession, ClientTimeout
from httpx_aiohttp.transport import AiohttpResponseStream, AiohttpTransport, map_aiohttp_exceptions

_EXTENSIONS = {"http_version": b"HTTP/1.1"}


class RawResponseStream(AiohttpResponseStream):
    """A response body as the socket delivered it: each read returns what is buffered (one
    relayed chunk per upstream write when the relay keeps up), never re-sliced."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        content = self._aiohttp_response.content
        with map_aiohttp_exceptions():
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk

    def at_eof(self) -> bool:
        """Everything the replica sent has been read: the last read held the end too."""
        return self._aiohttp_response.content.at_eof()


class RelayTransport(AiohttpTransport):
    """``AiohttpTransport`` with per-request work cached: the aiohttp timeout of each
    ``httpx`` timeout dict the relay reuses, and no redirect, proxy or SNI handling (the relay
    sends plain requests to the replicas' own URLs and follows no redirect)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        # id(timeout dict) -> (the dict, kept alive so its id stays its own; the aiohttp timeout)
        self._timeouts: dict[int, tuple[dict[str, float | None], ClientTimeout]] = {}

    def _client_timeout(self, timeout: dict[str, float | None]) -> ClientTimeout:
        cached = self._timeouts.get(id(timeout))
        if cached is not None and cached[0] is timeout:
            return cached[1]
        aio = ClientTimeout(
            sock_connect=timeout.get("connect"),
            sock_read=timeout.get("read"),
            connect=timeout.get("pool"),
        )
        if len(self._timeouts) > 256:  # reloads make new dicts; the old ones go
            self._timeouts.clear()
        self._timeouts[id(timeout)] = (timeout, aio)
        return aio

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self.client
        if not isinstance(session, ClientSession):
            session = self.client = self.get_client()
        stream = request.stream
        if isinstance(stream, httpx.ByteStream):
            # The bytes themselves (a one-part join returns its part): also for a request
            # built from a stream, which has no ``.content`` until read.
            data: Any = b"".join(stream) or None
        else:  # a streamed body: aiohttp frames it itself
            data = stream
            request.headers.pop("transfer-encoding", None)
        with map_aiohttp_exceptions():
            response = await session.request(
                request.method,
                str(request.url),
                headers=request.headers,
                data=data,
                allow_redirects=False,
                auto_decompress=False,
                compress=False,
                timeout=self._client_timeout(request.extensions.get("timeout") or {}),
            )
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=RawResponseStream(response),
            request=request,
            extensions=_EXTENSIONS,
        )


__all__ = ["RawResponseStream", "RelayTransport"]
