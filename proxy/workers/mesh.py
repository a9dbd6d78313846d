"""How the workers of one serve talk: framed JSON over Unix sockets in the serve's run directory.

Each worker listens on ``{rundir}/w{index}.sock``. News (a replica's transition, a health
round's results, a reload, a freed slot) goes one way over one kept-open connection per peer
(``tell``/``tell_all``: never waits, a peer that is down misses it and catches up when it
starts, with ``sync``). A question (``ask``: metrics to merge, a reload for the leader) opens a
connection of its own, bounded by a timeout; a worker that does not answer in time is left out
of the answer and the caller says so.

A frame is a 4-byte big-endian length and a JSON object. News carries ``"t"``; a question
carries ``"ask"`` and gets one frame back on its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import struct
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("tokenlane.workers")

LENGTH = struct.Struct(">I")
MAX_HINT_BACKLOG = 4 * 1024 * 1024  # bytes a slow peer may owe before hints to it are dropped
MAX_FRAME = 64 * 1024 * 1024  # a merged metrics answer of a very large fleet stays below
Message = dict[str, Any]
OnNews = Callable[[Message], None]
OnAsk = Callable[[Message], Awaitable[Message]]


def socket_path(rundir: str, index: int) -> str:
    return os.path.join(rundir, f"w{index}.sock")


def frame(message: Message) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Message:
    (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes")
    message = json.loads(await reader.readexactly(size))
    if not isinstance(message, dict):
        raise ValueError("a frame is a JSON object")
    return message


async def ask(path: str, message: Message, timeout_s: float) -> Message | None:
    """The answer of the worker listening on ``path``; None when it is down or does not answer
    in time."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(path, limit=MAX_FRAME)
            writer.write(frame(message))
            return await read_frame(reader)
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
        return None
    finally:
        if writer is not None:
            writer.close()


class Mesh:
    """This worker's end: its listener, its kept connections to the peers, its questions."""

    def __init__(
        self, rundir: str, index: int, workers: int, on_news: OnNews, on_ask: OnAsk
    ) -> None:
        self.rundir, self.index, self.workers = rundir, index, workers
        self.on_news, self.on_ask = on_news, on_ask
        self._server: asyncio.AbstractServer | None = None
        self._peers: dict[int, asyncio.StreamWriter] = {}
        self._connecting: dict[int, asyncio.Task[None]] = {}
        self._pending: dict[int, list[bytes]] = {}
        self.hints_dropped = 0
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def peers(self) -> list[int]:
        return [w for w in range(self.workers) if w != self.index]

    async def start(self) -> None:
        path = socket_path(self.rundir, self.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # this worker's predecessor's
        self._server = await asyncio.start_unix_server(self._serve, path=path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connecting.values()) + list(self._handlers):
            task.cancel()
        for writer in self._peers.values():
            writer.close()
        self._peers.clear()

    # -- news ------------------------------------------------------------------------------

    def tell(self, peer: int, message: Message, *, hint: bool = False) -> None:
        """Send ``message`` to ``peer`` in the background (dropped if the peer is down). A
        ``hint`` is also dropped while the peer reads too slowly to keep up (its unsent bytes
        past ``MAX_HINT_BACKLOG``): news that only improves a choice never piles up in memory."""
        data = frame(message)
        writer = self._peers.get(peer)
        if writer is not None:
            if not writer.is_closing():
                if hint and writer.transport.get_write_buffer_size() > MAX_HINT_BACKLOG:
                    self.hints_dropped += 1
                    return
                writer.write(data)
                return
            del self._peers[peer]
        self._pending.setdefault(peer, []).append(data)
        if peer not in self._connecting:
            task = asyncio.get_running_loop().create_task(self._connect(peer))
            self._connecting[peer] = task
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    def tell_all(self, message: Message, *, hint: bool = False) -> None:
        for peer in self.peers:
            self.tell(peer, message, hint=hint)

    async def _connect(self, peer: int) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(socket_path(self.rundir, peer))
        except OSError:
            self._pending.pop(peer, None)  # down or starting: it syncs when it starts
            return
        finally:
            self._connecting.pop(peer, None)
        self._peers[peer] = writer
        for data in self._pending.pop(peer, []):
            writer.write(data)
        # The peer never writes on this connection: EOF is its end (it died or restarted).
        with contextlib.suppress(ConnectionError):
            await reader.read()
        if self._peers.get(peer) is writer:
            del self._peers[peer]
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            while True:
                message = await read_frame(reader)
                if "ask" in message:
                    writer.write(frame(await self.on_ask(message)))
                    await writer.drain()
                    continue
                try:
                    self.on_news(message)
                except Exception:  # one bad message must not end the connection
                    log.exception("worker %d: news %r failed", self.index, message.get("t"))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except ValueError as exc:
            log.warning("worker %d: dropping a peer connection: %s", self.index, exc)
        finally:
            if task is not None:
                self._handlers.discard(task)
            writer.close()

    # -- questions -------------------------------------------------------------------------

    async def ask(self, peer: int, message: Message, timeout_s: float) -> Message | None:
        """``peer``'s answer to ``message``; None when it is down or does not answer in time."""
        return await ask(socket_path(self.rundir, peer), message, timeout_s)

    async def ask_all(self, message: Message, timeout_s: float) -> dict[int, Message | None]:
        peers = self.peers
        answers = await asyncio.gather(*(self.ask(p, message, timeout_s) for p in peers))
        return dict(zip(peers, answers, strict=True))


__all__ = ["Mesh", "Message", "ask", "frame", "read_frame", "socket_path"]
