"""The record of one client request on its way through the gateway (``Call``) and of each
upstream attempt made for it (``Attempt``). Everything that observes a request (outcomes, the
access log, auth's token charge) reads this record, so it depends on nothing but config, the
fleet's ``Replica`` and the request's ``Profile`` (imported, not only named for the type
checker: compiled, a call checks the annotated types at run time, ``proxy/compiled.py``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

from proxy.config import LaneConfig
from proxy.edge.asgi_ext import BodyWriter
from proxy.errors import Dialect
from proxy.fleet.fleet import Replica
from proxy.relay.retry import Phase
from proxy.routing.profile import Profile

# Read as a Final: compiled, ``time.monotonic`` is a lookup in the module's dict per call.
now: Final = time.monotonic


class Call:
    """One client request on its way through the gateway: what came in and what happened.

    A plain class with its own ``__init__`` rather than a dataclass: compiled, a dataclass's
    generated ``__init__`` stays interpreted (1.1 % of a burst request's samples under
    ``perf``, its forty stores through slot descriptors); this one is compiled. Slots, as the
    dataclass had: interpreted, a misspelt attribute fails as it does compiled."""

    __slots__ = (
        "body",
        "body_writer",
        "content_chunks",
        "continuation",
        "cut",
        "dialect",
        "disconnected",
        "error",
        "error_origin",
        "extra_headers",
        "fields",
        "finish_reasons",
        "finished",
        "headers",
        "kind",
        "lane",
        "method",
        "model",
        "overhead_s",
        "path",
        "pinned",
        "pool",
        "prefix_match_tokens",
        "profile",
        "prompt_token_ids",
        "query",
        "queue_wait_s",
        "received_at",
        "replica",
        "request_id",
        "retried_after_send",
        "retries",
        "start_with_body",
        "started",
        "status",
        "stream",
        "task",
        "trace",
        "tried",
        "ttft_s",
        "usage",
        "wants_usage",
    )

    def __init__(
        self,
        request_id: str,
        kind: str,  # chat | completion | messages | responses | other
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        stream: bool,
        model: str | None,
        lane: LaneConfig,
        profile: Profile | None,
        wants_usage: bool,
        received_at: float,
        query: bytes = b"",
        method: str = "POST",
        dialect: Dialect = Dialect.OPENAI,
        fields: dict[str, Any] | None = None,
    ) -> None:
        self.request_id = request_id
        self.kind = kind
        self.path = path
        self.body = body
        self.headers = headers
        self.stream = stream
        self.model = model
        self.lane = lane
        self.profile = profile
        self.wants_usage = wants_usage
        self.received_at = received_at
        self.query = query
        self.method = method  # GET only on pass-through paths vLLM serves with GET
        # Whose shapes the gateway's own errors take on this path (``errors.dialect_of``).
        self.dialect = dialect
        # The body as the edge parsed it (chat and completions), for what reads its fields
        # later (continuation's eligibility) without parsing it again.
        self.fields = fields
        # The one replica (its URL) that can answer: it holds the stored response the request
        # names (``relay.homes``). None: any replica of the lane's pools.
        self.pinned: str | None = None
        self.task: asyncio.Task[Any] | None = None
        self.start_with_body = False  # the server takes START_WITH_BODY
        # The server's DIRECT_BODY writer: a started stream's chunks are written from the
        # upstream connection's callback (``respond``, ``resume``). None: ASGI messages only.
        self.body_writer: BodyWriter | None = None
        # Added to every answer: the key's x-ratelimit-* headers when it has limits (empty,
        # and free, when rate limits are off).
        self.extra_headers: list[tuple[bytes, bytes]] | tuple[()] = ()
        # outcome
        self.pool: str | None = None
        self.replica: Replica | None = None
        self.status = 0
        self.started = False  # status line sent to the client
        self.ttft_s: float | None = None
        self.queue_wait_s = 0.0
        self.retries = 0
        self.overhead_s: float | None = None  # arrival to the first attempt's send
        self.content_chunks = 0
        self.usage: dict[str, Any] | None = None
        # Each choice's finish_reason as the answer ended, read only while tracing is on (a
        # trace attribute) or where the answer is parsed anyway (continuation, a plain
        # response).
        self.finish_reasons: list[str] | None = None
        self.error: str | None = None
        self.finished = False
        self.disconnected = False
        # Set when the gateway itself ends the request (shutdown past its grace): why, for the
        # client's error event, before its task is cancelled.
        self.cut: str | None = None
        # Who produced an error answer: "gateway" (its own refusal or failure) or "replica" (a
        # relayed upstream error); None on success. For the access log.
        self.error_origin: str | None = None
        self.tried: set[Replica] = set()
        self.retried_after_send = False  # the one retry of retry.on_5xx_after_send was used
        # cache_aware pools: the prompt tokens the chosen replica was judged to hold cached
        self.prefix_match_tokens: int | None = None
        # precise cache_aware: the prompt as a replica renders it
        self.prompt_token_ids: list[int] | None = None
        self.trace: Any = None  # the request's SERVER span while tracing is on
        # An eligible stream's continuation state (``relay.continuation.Splice``), else None.
        self.continuation: Any = None

    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this request runs on: its task's, else the running one. Python
        3.11's ``asyncio.get_running_loop`` makes a ``getpid`` system call each time (to tell a
        forked child from its parent); a task's ``get_loop`` reads a field. Three a request
        on the relay's path were three of its eight system calls."""
        task = self.task
        return task.get_loop() if task is not None else asyncio.get_running_loop()


class Attempt:
    """One upstream attempt as the fleet sees it (``fleet.StreamWatch``): a health verdict on
    its replica can end it through ``interrupt``. ``phase`` says how far it got, which is what
    the retry rules (``relay.retry.judge``) turn on."""

    __slots__ = (
        "interrupted",
        "last_progress",
        "phase",
        "replica",
        "task",
    )

    def __init__(self, replica: Replica, task: asyncio.Task[Any] | None) -> None:
        self.replica = replica
        self.task = task
        self.last_progress = now()
        self.phase = Phase.SENDING
        self.interrupted: str | None = None

    @property
    def content_sent(self) -> bool:
        """Content reached the client (the fleet's ``StreamWatch`` reads this)."""
        return self.phase is Phase.CONTENT

    def interrupt(self, reason: str) -> None:
        if self.interrupted is None and self.task is not None:
            self.interrupted = reason
            self.task.cancel(f"tokenlane: {reason}")
