"""The simulator's routes: vLLM's OpenAI server, ``/metrics``, and the ``/sim/`` controls."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from . import faults, formats, protocol
from .faults import FaultError
from .generate import Output
from .generation import Generation
from .messages_api import MessagesRoutes
from .metrics import CONTENT_TYPE
from .pooling_api import PoolingRoutes
from .realtime_api import route as realtime_route
from .replica import Sim
from .responses_api import ResponsesRoutes
from .scheduler import EngineRequest

GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's AuthenticationMiddleware


class JSONBody(JSONResponse):
    def render(self, content: Any) -> bytes:
        return formats.compact(content)


def _error(exc: protocol.ApiError) -> Response:
    return JSONBody(exc.body(), status_code=exc.status)


def _status_error(status: int, message: str) -> Response:
    """An error of any status in vLLM's shape (the ``error_rate`` fault)."""
    err = protocol.ApiError(status, message, protocol.error_type(status))
    return JSONBody(err.body(), status_code=status)


def _output_seed(base: int, request_seed: int | None, index: int) -> int:
    # Ints and tuples of ints hash alike in every process, so replicas agree on the answer. The
    # prompt is not in it: the output is a function of the whole token context (generate.py),
    # so a request continued from prompt + generated ids goes on exactly where it was cut.
    return hash((base, request_seed or 0, index)) & 0xFFFF_FFFF_FFFF


class _Observe:
    """Counts and logs every request outside /sim/, and checks the API key like vLLM. A
    WebSocket handshake counts as a GET; refused, it gets the 401 before the upgrade (vLLM's
    middleware means to, but fails on the scope's missing ``method``: an HTTP 500)."""

    def __init__(self, app: ASGIApp, sim: Sim) -> None:
        self.app = app
        self.sim = sim

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        sim = self.sim
        path: str = scope["path"]
        scope["sim.send"] = send
        if not path.startswith("/sim/"):
            sim.requests_received += 1
            sim.requests_by_path[path] += 1
            headers: dict[str, str] = {}
            for k, v in scope["headers"]:
                name, value = k.decode("latin-1").lower(), v.decode("latin-1")
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
            if sim.settings.request_log_size > 0:
                entry = {
                    "method": scope.get("method", "GET"),
                    "path": path,
                    "query": scope.get("query_string", b"").decode("latin-1"),
                    "headers": headers,
                    "body": None,
                    "arrived_at": time.time(),
                }
                sim.request_log.append(entry)
                scope["sim.entry"] = entry
            if (
                sim.settings.api_key
                and scope.get("method") != "OPTIONS"
                and path.startswith(GUARDED_PREFIX)
                and not sim.authorized(headers.get("authorization"))
            ):
                await JSONBody({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    entry = request.scope.get("sim.entry")
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        if entry is not None:
            entry["body"] = raw.decode("utf-8", errors="replace")
        raise protocol.validation_error(
            "", "json_invalid", "JSON decode error", raw[:200].decode("utf-8", "replace")
        ) from None
    if entry is not None:
        entry["body"] = body
    return body


def build_routes(sim: Sim) -> ASGIApp:
    s = sim.settings
    responses = ResponsesRoutes(sim, _json_body)  # holds this process's response store

    async def generate(request: Request, kind: str) -> Any:
        try:
            body = await _json_body(request)
        except protocol.ApiError as exc:
            return _error(exc)
        status = sim.error_rate_hit()
        if status is not None:
            return _status_error(status, f"Simulated fault: error_rate (status {status})")
        try:
            parse = protocol.parse_chat if kind == "chat" else protocol.parse_completion
            g = parse(body, s.models, priority_enabled=s.scheduling_policy == "priority")
            limits = [
                protocol.effective_max_tokens(len(p), g.sampling.max_tokens, s.max_model_len)
                for p in g.prompts
            ]
        except protocol.ApiError as exc:
            return _error(exc)
        if sim.engine.dead is not None:
            return Response(status_code=500)
        rid = protocol.request_id(request.headers.get("x-request-id"))
        now = time.monotonic()
        sp = g.sampling
        reqs: list[EngineRequest] = []
        for p_index, (prompt, limit) in enumerate(zip(g.prompts, limits, strict=True)):
            for i in range(sp.n):
                seed = _output_seed(s.seed, sp.seed, i)
                natural = None
                if sp.max_tokens is None:
                    natural = (s.natural_len_min, s.natural_len_max)
                out = Output(seed, max_tokens=limit, prompt=prompt, natural_range=natural,
                             stop=sp.stop, include_stop=sp.include_stop)  # fmt: skip
                reqs.append(EngineRequest(
                    id=f"{rid}-{p_index * sp.n + i}", prompt=prompt, output=out,
                    priority=sp.priority, arrival=now, max_tokens=limit, params_n=sp.n,
                ))  # fmt: skip
        return Generation(sim, g, reqs, rid)

    async def chat(request: Request) -> Any:
        return await generate(request, "chat")

    async def completions(request: Request) -> Any:
        return await generate(request, "completion")

    messages = MessagesRoutes(sim, _json_body)  # Anthropic Messages on the chat path
    pooling = PoolingRoutes(sim, _json_body, chat, completions)  # /invocations dispatches

    async def models(request: Request) -> Response:
        return JSONBody(formats.models_response(s.models, sim.created, s.max_model_len))

    async def health(request: Request) -> Response:
        f = sim.fault
        if f is not None and f.name == "health_fail":
            return Response(status_code=int(f.params["status"]))
        if sim.engine.dead is not None:
            return Response(status_code=503)
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return JSONBody({"version": protocol.VLLM_VERSION})

    async def tokenize(request: Request) -> Response:
        try:
            return JSONBody(protocol.tokenize(await _json_body(request), s.models, s.max_model_len))
        except protocol.ApiError as exc:
            return _error(exc)

    priority = s.scheduling_policy == "priority"

    async def render_chat(request: Request) -> Response:
        try:
            body = await _json_body(request)
            items = protocol.render(body, s.models, s.max_model_len, "chat",
                                    priority_enabled=priority)  # fmt: skip
        except protocol.ApiError as exc:
            return _error(exc)
        return JSONBody(items[0])

    async def render_completion(request: Request) -> Response:
        try:
            body = await _json_body(request)
            items = protocol.render(body, s.models, s.max_model_len, "completion",
                                    priority_enabled=priority)  # fmt: skip
        except protocol.ApiError as exc:
            return _error(exc)
        return JSONBody(items)

    async def detokenize(request: Request) -> Response:
        try:
            return JSONBody(protocol.detokenize(await _json_body(request), s.models))
        except protocol.ApiError as exc:
            return _error(exc)

    async def metrics(request: Request) -> Response:
        return Response(sim.metrics_text(), media_type=CONTENT_TYPE)

    async def get_fault(request: Request) -> Response:
        return JSONBody(sim.describe_fault())

    async def post_fault(request: Request) -> Response:
        try:
            fault = faults.parse(await request.json(), require_duration=True)
        except (ValueError, FaultError) as exc:
            return JSONBody(protocol.ApiError(400, str(exc)).body(), status_code=400)
        if fault is not None and fault.name in faults.UNREACHABLE:
            # Answer first: once applied, nothing can reach this port.
            if sim.listener is None and not (fault.name == "crash" and sim.on_crash):
                err = protocol.ApiError(400, f"{fault.name} needs a simulator that owns its socket")
                return JSONBody(err.body(), status_code=400)
            return JSONBody(fault.describe(fault.duration_s), background=BackgroundTask(
                sim.set_fault, fault))  # fmt: skip
        await sim.set_fault(fault)
        return JSONBody(sim.describe_fault())

    async def stats(request: Request) -> Response:
        return JSONBody(sim.stats())

    async def requests_log(request: Request) -> Response:
        if request.method == "DELETE":
            sim.request_log.clear()
            return JSONBody({"requests": []})
        items = sim.requests(request.query_params.get("path"))
        limit = request.query_params.get("limit")
        if limit and limit.isdigit():
            items = items[-int(limit) :] if int(limit) else []
        return JSONBody({"requests": items})

    async def not_found(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        detail = "Not Found" if exc.status_code == 404 else exc.detail
        return JSONBody({"detail": detail}, status_code=exc.status_code)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sim.engine.start()
        if sim.kv_events is not None:
            sim.kv_events.start()
        try:
            yield
        finally:
            await sim.close()

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages.create, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        Route("/v1/chat/completions/render", render_chat, methods=["POST"]),
        Route("/v1/completions/render", render_completion, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
        Route("/v1/chat/completions/batch", pooling.chat_batch, methods=["POST"]),
        Route("/v1/embeddings", pooling.embeddings, methods=["POST"]),
        Route("/v2/embed", pooling.cohere_embed, methods=["POST"]),
        Route("/pooling", pooling.pooling, methods=["POST"]),
        Route("/classify", pooling.classify, methods=["POST"]),
        Route("/score", pooling.score, methods=["POST"]),
        Route("/v1/score", pooling.score, methods=["POST"]),
        Route("/rerank", pooling.rerank, methods=["POST"]),
        Route("/v1/rerank", pooling.rerank, methods=["POST"]),
        Route("/v2/rerank", pooling.rerank, methods=["POST"]),
        Route("/invocations", pooling.invocations, methods=["POST"]),
        Route("/tokenizer_info", pooling.tokenizer_info, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/sim/fault", get_fault, methods=["GET"]),
        Route("/sim/fault", post_fault, methods=["POST"]),
        Route("/sim/stats", stats, methods=["GET"]),
        Route("/sim/requests", requests_log, methods=["GET", "DELETE"]),
        realtime_route(sim),  # the WebSocket
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: not_found},
    )
    app.state.sim = sim
    return _Observe(app, sim)
