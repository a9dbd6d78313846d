"""The listening socket of a simulator, which the network faults close, replace and reopen.

``refuse`` closes the listener, so the kernel refuses connections; ``hang_accept`` puts a
listener on the port that accepts and never answers. Both also close idle keep-alive
connections, so a client's pooled connection cannot sneak past the fault, while responses
already in flight finish. Lifting reopens uvicorn's listener on the same port.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import socket
import struct
import termios
from collections.abc import Callable
from typing import cast

import uvicorn


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio only disables Nagle on sockets whose proto is IPPROTO_TCP, and
    # with Nagle on, a response written as headers then body waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _unacked(sock: socket.socket) -> int:
    """Bytes the kernel still holds for ``sock`` (sent but not acknowledged); 0 if unknown."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return int(struct.unpack("i", raw)[0])


class _BlackHole(asyncio.Protocol):
    """``hang_accept``: take the connection, read and drop everything, never answer."""

    def __init__(self, conns: set[asyncio.Transport]) -> None:
        self._conns = conns
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._conns.add(transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self._conns.discard(self._transport)


class Listener:
    """The uvicorn server's listening side, which faults close, replace and reopen."""

    def __init__(self, server: uvicorn.Server, host: str, port: int) -> None:
        self.server = server
        self.host = host
        self.port = port
        self._hole: asyncio.Server | None = None
        self._hole_conns: set[asyncio.Transport] = set()

    def close(self) -> None:
        """Stop listening, and close idle keep-alive connections (busy ones finish first)."""
        for srv in self.server.servers:
            srv.close()
        for conn in list(self.server.server_state.connections):
            conn.shutdown()

    def abort_connections(self) -> None:
        for conn in list(self.server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()

    async def reset(self, peer: tuple[str, int], flush_timeout_s: float = 1.0) -> bool:
        """Reset the connection from ``peer`` (host, port) with a TCP RST, after the bytes
        already written have been acknowledged (an RST discards what is still queued)."""
        for conn in list(self.server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is None or transport.is_closing():
                continue
            name = transport.get_extra_info("peername")
            if name is None or tuple(name[:2]) != tuple(peer[:2]):
                continue
            sock = transport.get_extra_info("socket")
            loop = asyncio.get_running_loop()
            until = loop.time() + flush_timeout_s
            # The kernel signals no event when the peer acknowledges: poll its queue.
            while loop.time() < until and (  # noqa: ASYNC110
                transport.get_write_buffer_size() > 0 or (sock is not None and _unacked(sock))
            ):
                await asyncio.sleep(0.002)
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            return True
        return False

    async def open(self) -> None:
        config = self.server.config
        # uvicorn annotates this as ``type[asyncio.Protocol]``, but its protocol classes take
        # (config, server_state, app_state), which is how uvicorn itself builds them.
        protocol_class = cast(Callable[..., asyncio.Protocol], config.http_protocol_class)
        factory = functools.partial(
            protocol_class,
            config=config,
            server_state=self.server.server_state,
            app_state=self.server.lifespan.state,
        )
        srv = await self._create(factory)
        self.server.servers = [srv]

    async def hang(self) -> None:
        self._hole = await self._create(lambda: _BlackHole(self._hole_conns))

    def unhang(self) -> None:
        if self._hole is not None:
            self._hole.close()
            self._hole = None
        for transport in list(self._hole_conns):
            transport.abort()
        self._hole_conns.clear()

    async def _create(self, factory: Callable[[], asyncio.BaseProtocol]) -> asyncio.Server:
        loop = asyncio.get_running_loop()
        last: OSError | None = None
        for _ in range(50):  # the old socket may take a moment to leave the port
            try:
                sock = bind_socket(self.host, self.port)
            except OSError as exc:
                last = exc
                await asyncio.sleep(0.02)
                continue
            return await loop.create_server(factory, sock=sock, backlog=2048)
        raise RuntimeError(f"cannot listen on {self.host}:{self.port} again: {last}")
