"""The ASGI response of one chat or completion request, streamed or not.

Plain ASGI rather than Starlette's ``StreamingResponse``, because this is the simulator's hot
path: the request's task waits for the engine's wake-up and writes every token that is ready in
one ``send``, straight to uvicorn; a watcher notices the client leaving and aborts the request
in the engine at once (vLLM frees the KV blocks the same way).

With ``return_token_ids`` every chunk carries its token ids (the prompt's on the first chunk),
in vLLM's places. Under a ``cut_*`` fault a stream ends once some choice has sent
``after_tokens`` tokens, the way that fault says (``faults.py``); plain responses are not cut.
"""

from __future__ import annotations

import asyncio
import time

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from . import faults, formats, protocol
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
                await self._stream(scope, send, wake, gone)
            else:
                await self._plain(send, wake, gone)
        finally:
            watcher.cancel()
            for r in self.reqs:
                if not r.done:
                    engine.abort(r)

    def _usage_numbers(self) -> tuple[int, int]:
        return sum(self.prompt_lens), sum(r.num_output for r in self.reqs)

    async def _settled(self, wake: asyncio.Event, gone: asyncio.Event) -> str:
        """Wait until every sequence is done ("done"), one failed ("error") or the client left
        ("gone"): what a plain (not streamed) response waits for."""
        while True:
            await wake.wait()
            wake.clear()
            if gone.is_set():
                self.sim.disconnects += 1
                return "gone"
            if any(r.error for r in self.reqs):
                return "error"
            if all(r.done for r in self.reqs):
                return "done"

    async def _plain(self, send: Send, wake: asyncio.Event, gone: asyncio.Event) -> None:
        settled = await self._settled(wake, gone)
        if settled == "gone":
            return
        if settled == "error":
            # vLLM's handler for EngineDeadError: a bare 500.
            await send({"type": "http.response.start", "status": 500, "headers": [
                (b"content-length", b"0")]})  # fmt: skip
            await send({"type": "http.response.body", "body": b""})
            return
        g = self.req
        ids_on = g.sampling.return_token_ids
        choices = []
        for i, r in enumerate(self.reqs):
            text = r.output.text
            # With return_token_ids vLLM echoes the prompt as ids only (its prompt text is "").
            echo = g.prompt_texts[self.prompt_of[i]] if g.sampling.echo and not ids_on else None
            if echo is not None:
                text = echo + text
            choice = formats.Choice(i, text, r.finish_reason, r.output.stop_reason)
            if ids_on:
                choice.token_ids = list(r.output.ids)
                if g.kind != "chat":
                    choice.prompt_token_ids = list(r.prompt)
            choices.append(choice)
        prompt, completion = self._usage_numbers()
        u = formats.usage(prompt, completion, details=True)
        fp = self.sim.fingerprint
        if g.kind == "chat":
            pids = list(self.reqs[0].prompt) if ids_on else None
            data = formats.chat_response(self.rid, self.created, g.model, fp, choices, u, pids)
        else:
            data = formats.completion_response(self.rid, self.created, g.model, fp, choices, u)
        body = formats.compact(data)
        await send({"type": "http.response.start", "status": 200, "headers": [
            *JSON_HEADERS, (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    def _cut_after(self) -> int | None:
        """The token count at which the current ``cut_*`` fault ends this stream, if any."""
        fault = self.sim.fault
        if fault is None or fault.name not in faults.CUTS:
            return None
        return int(fault.params["after_tokens"])

    async def _stream(
        self, scope: Scope, send: Send, wake: asyncio.Event, gone: asyncio.Event
    ) -> None:
        g = self.req
        sp = g.sampling
        fmt = formats.StreamFormat(
            g.kind, self.rid, self.created, g.model, self.sim.fingerprint,
            include_usage=sp.include_usage, continuous_usage=sp.continuous_usage,
            token_ids=sp.return_token_ids,
        )  # fmt: skip
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        sent = [0] * len(self.reqs)
        # Echo as text, unless token ids are returned (vLLM then echoes an empty prompt text).
        echo_pending = sp.echo and not sp.return_token_ids
        role_sent = g.kind != "chat"
        while True:
            cut_after = self._cut_after()
            parts: list[str] = []
            for k, r in enumerate(self.reqs):
                out = r.output
                produced = len(out.ids)
                if cut_after is not None:
                    produced = min(produced, cut_after)
                if produced <= sent[k]:
                    continue
                if not role_sent:
                    parts.extend(self._roles(fmt))
                    role_sent = True
                p = self.prompt_of[k]
                prompt = self.prompt_lens[p]
                for t in range(sent[k], produced):
                    delta = out.deltas[t]
                    if echo_pending and t == 0:
                        delta = (g.prompt_texts[p] or "") + delta
                    ids = out.ids[t : t + 1]
                    # Completions put the prompt's ids on each choice's first chunk.
                    pids = r.prompt if t == 0 else None
                    if t == len(out.ids) - 1 and out.finished:
                        reason = out.finish_reason or "stop"
                        parts.append(
                            fmt.finish(k, delta, reason, out.stop_reason, prompt, t + 1, ids, pids)
                        )
                    else:
                        parts.append(fmt.token(k, delta, prompt, t + 1, ids, pids))
                sent[k] = produced
            error = next((r.error for r in self.reqs if r.error), None)
            if error is not None:
                parts.append(formats.stream_error_event(error))
                parts.append(formats.DONE)
                await send({"type": "http.response.body", "body": "".join(parts).encode()})
                return
            complete = all(r.done and sent[k] == len(r.output.ids) for k, r in enumerate(self.reqs))
            if complete:
                if sp.include_usage:
                    parts.append(fmt.usage_chunk(*self._usage_numbers()))
                parts.append(formats.DONE)
                await send({"type": "http.response.body", "body": "".join(parts).encode()})
                return
            if cut_after is not None and any(n >= cut_after for n in sent):
                if not role_sent:
                    parts.extend(self._roles(fmt))
                await self._cut(scope, send, fmt, parts, sent)
                return
            if parts:
                body = "".join(parts).encode()
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await wake.wait()
            wake.clear()
            if gone.is_set():
                self.sim.disconnects += 1
                return

    def _roles(self, fmt: formats.StreamFormat) -> list[str]:
        # vLLM sends every choice's role chunk with the first output of any choice.
        prompt0 = self.prompt_lens[0]
        return [fmt.role(i, prompt0, self.reqs[i].prompt) for i in range(len(self.reqs))]

    async def _cut(
        self, scope: Scope, send: Send, fmt: formats.StreamFormat, parts: list[str], sent: list[int]
    ) -> None:
        """End the stream the way the ``cut_*`` fault says, after the chunks in ``parts``."""
        fault = self.sim.fault
        name = fault.name if fault is not None else "cut_close"
        if name == "cut_error":
            status = int(fault.params["status"]) if fault is not None else 500
            message = f"Simulated fault: cut_error (status {status})"
            parts.append(formats.stream_error_event(message, protocol.error_type(status), status))
            parts.append(formats.DONE)
        elif name == "cut_abort":
            for k, r in enumerate(self.reqs):
                if not (r.output.finished and sent[k] == len(r.output.ids)):
                    prompt = self.prompt_lens[self.prompt_of[k]]
                    parts.append(fmt.finish(k, "", "abort", None, prompt, sent[k], ()))
            if self.req.sampling.include_usage:
                completion = sum(sent)
                parts.append(fmt.usage_chunk(sum(self.prompt_lens), completion))
            parts.append(formats.DONE)
        if name == "cut_reset":
            if parts:
                body = "".join(parts).encode()
                await send({"type": "http.response.body", "body": body, "more_body": True})
            if await self.sim.reset_connection(scope.get("client")):
                return
            parts = []  # no socket of our own to reset: end the response instead
        await send({"type": "http.response.body", "body": "".join(parts).encode()})
