"""The ASGI response of one chat or completion request, streamed or not.

Plain ASGI rather than Starlette's ``StreamingResponse``, because this is the simulator's hot
path: the request's task waits for the engine's wake-up and writes every token that is ready in
one ``send``, straight to uvicorn; a watcher notices the client leaving and aborts the request
in the engine at once (vLLM frees the KV blocks the same way).
"""

from __future__ import annotations

import asyncio
import time

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from . import formats, protocol
from .engine import EngineDead
from .replica import Sim
from .scheduler import EngineRequest

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON_HEADERS = [(b"content-type", b"application/json")]


class Generation:
    """The ASGI response of one chat or completion request, streamed or not."""

    def __init__(
        self, sim: Sim, req: protocol.GenerationRequest, engine_reqs: list[EngineRequest], rid: str
    ) -> None:
        self.sim = sim
        self.req = req
        self.reqs = engine_reqs
        self.rid = rid
        self.created = int(time.time())
        n = req.sampling.n
        # Prompt tokens: each prompt once, however many choices it has.
        self.prompt_lens = [len(p) for p in req.prompts]
        self.prompt_of = [i // n for i in range(len(engine_reqs))]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Tokens are the hot path: write to uvicorn directly, past Starlette's send wrappers.
        send = scope.get("sim.send", send)
        engine = self.sim.engine
        wake = asyncio.Event()
        for r in self.reqs:
            r.notify = wake.set
        try:
            for r in self.reqs:
                engine.submit(r)
        except EngineDead:
            for r in self.reqs:
                engine.abort(r)
            await Response(status_code=500)(scope, receive, send)
            return
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            wake.set()

        watcher = asyncio.create_task(watch())
        try:
            if self.req.sampling.stream:
                await self._stream(send, wake, gone)
            else:
                await self._plain(send, wake, gone)
        finally:
            watcher.cancel()
            for r in self.reqs:
                if not r.done:
                    engine.abort(r)

    def _usage_numbers(self) -> tuple[int, int]:
        return sum(self.prompt_lens), sum(r.num_output for r in self.reqs)

    async def _plain(self, send: Send, wake: asyncio.Event, gone: asyncio.Event) -> None:
        while True:
            await wake.wait()
            wake.clear()
            if gone.is_set():
                self.sim.disconnects += 1
                return
            if any(r.error for r in self.reqs):
                # vLLM's handler for EngineDeadError: a bare 500.
                await send({"type": "http.response.start", "status": 500, "headers": [
                    (b"content-length", b"0")]})  # fmt: skip
                await send({"type": "http.response.body", "body": b""})
                return
            if all(r.done for r in self.reqs):
                break
        g = self.req
        choices = []
        for i, r in enumerate(self.reqs):
            text = r.output.text
            if g.sampling.echo and g.prompt_texts[self.prompt_of[i]] is not None:
                text = g.prompt_texts[self.prompt_of[i]] + text  # type: ignore[operator]
            choices.append(formats.Choice(i, text, r.finish_reason, r.output.stop_reason))
        prompt, completion = self._usage_numbers()
        u = formats.usage(prompt, completion, details=True)
        build = formats.chat_response if g.kind == "chat" else formats.completion_response
        body = formats.compact(
            build(self.rid, self.created, g.model, self.sim.fingerprint, choices, u)
        )
        await send({"type": "http.response.start", "status": 200, "headers": [
            *JSON_HEADERS, (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    async def _stream(self, send: Send, wake: asyncio.Event, gone: asyncio.Event) -> None:
        g = self.req
        fmt = formats.StreamFormat(
            g.kind, self.rid, self.created, g.model, self.sim.fingerprint,
            include_usage=g.sampling.include_usage, continuous_usage=g.sampling.continuous_usage,
        )  # fmt: skip
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        sent = [0] * len(self.reqs)
        echo_pending = g.sampling.echo
        role_sent = g.kind != "chat"
        while True:
            await wake.wait()
            wake.clear()
            if gone.is_set():
                self.sim.disconnects += 1
                return
            parts: list[str] = []
            for k, r in enumerate(self.reqs):
                out = r.output
                produced = len(out.ids)
                if produced <= sent[k]:
                    continue
                if not role_sent:
                    # vLLM sends every choice's role chunk with the first token of any choice.
                    prompt0 = self.prompt_lens[0]
                    parts.extend(fmt.role(i, prompt0) for i in range(len(self.reqs)))
                    role_sent = True
                prompt = self.prompt_lens[self.prompt_of[k]]
                for t in range(sent[k], produced):
                    delta = out.deltas[t]
                    if echo_pending and t == 0:
                        delta = (g.prompt_texts[self.prompt_of[k]] or "") + delta
                    if t == produced - 1 and out.finished:
                        reason = out.finish_reason or "stop"
                        parts.append(fmt.finish(k, delta, reason, out.stop_reason, prompt, t + 1))
                    else:
                        parts.append(fmt.token(k, delta, prompt, t + 1))
                sent[k] = produced
            error = next((r.error for r in self.reqs if r.error), None)
            if error is not None:
                parts.append(formats.stream_error_event(error))
                parts.append(formats.DONE)
                await send({"type": "http.response.body", "body": "".join(parts).encode()})
                return
            if all(r.done for r in self.reqs):
                if g.sampling.include_usage:
                    parts.append(fmt.usage_chunk(*self._usage_numbers()))
                parts.append(formats.DONE)
                await send({"type": "http.response.body", "body": "".join(parts).encode()})
                return
            if parts:
                body = "".join(parts).encode()
                await send({"type": "http.response.body", "body": body, "more_body": True})
