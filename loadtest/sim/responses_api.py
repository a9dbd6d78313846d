"""vLLM's OpenAI Responses API (``/v1/responses``) on the simulator's generation path, and the
per-process response store behind ``store``, ``previous_response_id``, ``background``, ``GET``
and ``cancel``.

A request is rendered into chat messages the way vLLM's ``construct_input_messages`` does
(instructions as a system message, the stored conversation of ``previous_response_id`` and its
answer, then the input; function tools in Chat Completions form), tokenized with the chat
template of ``tokenizer.py`` and run as one engine request through :class:`Generation`, so
batching, prefix caching, metrics, the request log and the faults act as on chat. Shapes follow
``tests/fixtures/vllm_responses_*`` (vLLM's ``entrypoints/openai/responses/`` at commit
90d7b6b8af44c93549f45ca37d49bf9a8d87e970; see ``tests/fixtures/README.md``).

The simulator behaves as vLLM started with ``VLLM_ENABLE_RESPONSES_API_STORE=1``: without it
vLLM stores nothing, so ``previous_response_id`` and ``GET`` always answer 404 and
``background`` 400. vLLM's store never forgets; this one keeps the last :data:`STORE_SIZE`.

Length: one API's whole surface (rendering a request, the streamed event sequence, the store and
its routes) is one job, and its event shapes are checked against vLLM's best side by side.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Scope, Send

from . import formats, protocol, tokenizer
from .generate import Output
from .generation import SSE_HEADERS, Generation
from .replica import ENGINE_DEAD_MESSAGE, Sim
from .scheduler import EngineRequest

STORE_SIZE = 10_000  # responses kept per process; the oldest go first
# vLLM takes sampling defaults from the model's generation_config.json (Qwen2.5-0.5B-Instruct's)
# and echoes them in the response object.
DEFAULT_TEMPERATURE, DEFAULT_TOP_P = 0.7, 0.8


def _json(data: Any, status: int = 200) -> Response:
    return Response(formats.compact(data), status_code=status, media_type="application/json")


def _error(exc: protocol.ApiError) -> Response:
    return _json(exc.body(), exc.status)


def not_found(response_id: str) -> protocol.ApiError:
    return protocol.ApiError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id"
    )


def random_id() -> str:
    return uuid.uuid4().hex  # vLLM's random_uuid()


# -- the store --------------------------------------------------------------------------------


@dataclass
class Stored:
    """One stored response: its body as GET answers it, and the chat messages its prompt was
    rendered from (vLLM's ``msg_store``), which a follow-up continues."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    task: asyncio.Task[None] | None = None  # a background response's run


class ResponseStore:
    """The last :data:`STORE_SIZE` responses of this process, by id."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def put(self, response_id: str, item: Stored) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


# -- requests ---------------------------------------------------------------------------------


@dataclass
class Call:
    """One ``POST /v1/responses``, validated: what the response object echoes and how to run."""

    body: dict[str, Any]
    model: str
    store: bool
    background: bool
    stream: bool
    priority: int
    max_output_tokens: int | None
    previous_response_id: str | None
    tools: list[Any] = field(default_factory=list)


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = protocol._get(body, key, "bool")
    return default if value is None else bool(value)


def parse(body: Any, models: Sequence[str], *, priority_enabled: bool) -> Call:
    """Check a request as vLLM's ``ResponsesRequest`` and ``_check_model`` do."""
    if not isinstance(body, dict):
        raise protocol.validation_error(
            "", "model_attributes_type", "Input should be a valid dictionary", body
        )
    if "input" not in body:
        raise protocol.validation_error("input", "missing", "Field required", body)
    value = body["input"]
    if not isinstance(value, str | list):
        raise protocol.validation_error(
            "input", "string_type", "Input should be a valid string", value
        )
    for i, item in enumerate(value if isinstance(value, list) else []):
        if not isinstance(item, dict):
            raise protocol.validation_error(
                f"input.{i}", "dict_type", "Input should be a valid dictionary", item
            )
    for key in ("instructions", "previous_response_id", "user"):
        protocol._get(body, key, "str")
    for key in ("temperature", "top_p"):
        protocol._get(body, key, "float")
    tools = protocol._get(body, "tools", "list", [])
    store, background = _bool(body, "store", True), _bool(body, "background", False)
    if background and not store:
        # ResponsesRequest.validate_background, a model validator: pydantic's value_error.
        raise protocol.validation_error(
            "",
            "value_error",
            "Value error, background can only be used when `store` is true",
            body,
        )
    limit = protocol._get(body, "max_output_tokens", "int")
    if limit is not None and limit < 1:  # SamplingParams' check, under its own name
        raise protocol.semantic_error(
            f"max_tokens must be at least 1, got {limit}.", "max_tokens", limit
        )
    priority = protocol._get(body, "priority", "int", 0)
    model = protocol._get(body, "model", "str")
    if model and model not in models:
        raise protocol.not_found_model(model)
    if priority != 0 and not priority_enabled:
        raise protocol.semantic_error(
            f"Got priority {priority} but Priority scheduling is not enabled.", "priority", priority
        )
    return Call(
        body=body,
        model=models[0],
        store=store,
        background=background,
        stream=_bool(body, "stream", False),
        priority=priority,
        max_output_tokens=limit,
        previous_response_id=body.get("previous_response_id"),
        tools=tools,
    )


_TEXT_PARTS = ("input_text", "output_text", "text")


def _content(content: Any) -> Any:
    """Responses content parts as chat parts: text stays text, an image or a file is media."""
    if not isinstance(content, list):
        return content
    parts: list[Any] = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text")})
        elif isinstance(part, Mapping) and part.get("type") in ("input_image", "input_file"):
            parts.append({"type": "image_url", "image_url": part.get("image_url")})
        else:
            parts.append(part)
    return parts


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input``, as vLLM's ``construct_input_messages``:
    a function call joins the assistant message before it, its output becomes a tool message,
    reasoning items are dropped (Qwen2.5's template has no place for them)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        if kind == "function_call":
            function = {"name": item.get("name"), "arguments": item.get("arguments")}
            call = {"id": item.get("call_id"), "type": "function", "function": function}
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
            )
        elif kind == "reasoning":
            continue
        else:
            message = {k: v for k, v in item.items() if k not in ("type", "id", "status")}
            message["content"] = _content(item.get("content"))
            if prev is not None and message.get("role") == "assistant" and "content" not in prev:
                prev["content"] = message["content"]
            else:
                messages.append(message)
    return messages


def conversation(call: Call, previous: Stored | None) -> list[dict[str, Any]]:
    """Instructions, the previous conversation and its answer, then the new input."""
    messages: list[dict[str, Any]] = []
    instructions = call.body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous is not None:
        # Instructions do not carry over (OpenAI's rule, which vLLM follows).
        messages.extend(m for m in previous.messages if m.get("role") != "system")
        for item in previous.response["output"]:
            if item.get("type") == "message":
                messages.extend(
                    {"role": "assistant", "content": part["text"]} for part in item["content"]
                )
    messages.extend(input_messages(call.body["input"]))
    return messages


def tool_dicts(tools: Sequence[Any]) -> list[dict[str, Any]] | None:
    """Function tools in Chat Completions form, as the chat template receives them."""
    out = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in tools
        if isinstance(t, Mapping) and t.get("type") == "function"
    ]
    return out or None


def prompt_ids(
    messages: list[dict[str, Any]], tools: Sequence[Any], max_model_len: int
) -> list[int]:
    try:
        ids = tokenizer.chat_prompt_ids(messages, tools=tool_dicts(tools))
    except tokenizer.TemplateError as exc:
        raise protocol.semantic_error(str(exc), "input") from None
    except UnicodeEncodeError as exc:
        raise protocol.unencodable(exc) from None
    if len(ids) >= max_model_len:
        raise protocol.ApiError(
            400,
            f"The engine prompt length {len(ids)} exceeds the max_model_len {max_model_len}. "
            "Please reduce prompt.",
            "invalid_request_error",
            "input",
        )
    return ids


# -- response shapes --------------------------------------------------------------------------


def usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + output,
    }


def output_text(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message item; ``text`` None for the empty one a stream opens with."""
    content = [output_text(text)] if text else []
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def response_object(
    call: Call,
    rid: str,
    created: int,
    max_tokens: int,
    status: str,
    output: list[dict[str, Any]],
    u: dict[str, Any] | None,
) -> dict[str, Any]:
    """vLLM's ``ResponsesResponse.from_request``: the request's settings echoed back."""
    b = call.body
    temperature = b.get("temperature")
    top_p = b.get("top_p")
    return {
        "id": rid,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": b.get("instructions"),
        "metadata": b.get("metadata"),
        "model": call.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": b.get("parallel_tool_calls", True),
        "temperature": DEFAULT_TEMPERATURE if temperature is None else temperature,
        "tool_choice": b.get("tool_choice", "auto"),
        "tools": call.tools,
        "top_p": DEFAULT_TOP_P if top_p is None else top_p,
        "background": call.background,
        "max_output_tokens": max_tokens,
        "max_tool_calls": b.get("max_tool_calls"),
        "previous_response_id": call.previous_response_id,
        "prompt": None,
        "reasoning": b.get("reasoning"),
        "service_tier": b.get("service_tier", "auto"),
        "status": status,
        "text": b.get("text"),
        "top_logprobs": None,
        "truncation": b.get("truncation", "disabled"),
        "usage": u,
        "user": b.get("user"),
        "input_messages": None,
        "output_messages": None,
        "kv_transfer_params": None,
    }


def event(data: dict[str, Any]) -> str:
    """One SSE event as vLLM's api_router writes it: the type line, then compact JSON."""
    return f"event: {data['type']}\ndata: {formats.compact(data).decode()}\n\n"


class Events:
    """The event stream of one response, numbering events from 0 as vLLM does."""

    def __init__(self, item_id: str) -> None:
        self.seq = 0
        self.item_id = item_id

    def __call__(self, kind: str, **fields: Any) -> str:
        # The SDK's event models declare their fields in alphabetical order.
        data = dict(sorted({**fields, "sequence_number": self.seq, "type": kind}.items()))
        self.seq += 1
        return event(data)

    def opened(self) -> list[str]:
        """The message item and its text part, announced with the first text."""
        return [
            self(
                "response.output_item.added",
                item=message_item(self.item_id, None, "in_progress"),
                output_index=0,
            ),
            self(
                "response.content_part.added",
                content_index=0,
                item_id=self.item_id,
                output_index=0,
                part=output_text("", []),
            ),
        ]

    def delta(self, text: str) -> str:
        return self(
            "response.output_text.delta",
            content_index=0,
            delta=text,
            item_id=self.item_id,
            logprobs=[],
            output_index=0,
        )

    def closed(self, text: str) -> list[str]:
        item = message_item(self.item_id, text, "completed")
        item["content"] = [output_text(text)]
        item.update(annotations=[], logprobs=[])  # extra fields vLLM passes to the SDK's model
        return [
            self(
                "response.output_text.done",
                content_index=0,
                item_id=self.item_id,
                logprobs=[],
                output_index=0,
                text=text,
            ),
            self(
                "response.content_part.done",
                content_index=0,
                item_id=self.item_id,
                output_index=0,
                part=output_text(text),
            ),
            self("response.output_item.done", item=item, output_index=0),
        ]


# -- running ----------------------------------------------------------------------------------


class ResponsesGeneration(Generation):
    """One Responses request through the engine: :class:`Generation` submits it, watches the
    client and aborts; this class writes vLLM's Responses shapes and stores the result."""

    def __init__(
        self,
        sim: Sim,
        g: protocol.GenerationRequest,
        reqs: list[EngineRequest],
        call: Call,
        rid: str,
        store: ResponseStore,
        messages: list[dict[str, Any]],
    ) -> None:
        super().__init__(sim, g, reqs, rid)
        self.call = call
        self.store = store
        self.messages = messages
        self.limit = reqs[0].max_tokens

    def final(self, status: str, text: str, output_tokens: int) -> dict[str, Any]:
        """The finished response (its message item gets a fresh ``msg_`` id, as in vLLM)."""
        r = self.reqs[0]
        if status == "completed" and r.finish_reason == "length":
            status = "incomplete"
        item = message_item(f"msg_{random_id()}", text, "completed")
        u = usage(len(r.prompt), output_tokens, r.num_cached_tokens or 0)
        return response_object(self.call, self.rid, self.created, self.limit, status, [item], u)

    def keep(self, response: dict[str, Any]) -> None:
        if not self.call.store:
            return
        held = self.store.get(self.rid)
        if held is not None and held.response["status"] == "cancelled":
            return  # vLLM leaves a cancelled response as it is
        self.store.put(self.rid, Stored(response, self.messages))

    async def _plain(self, send: Send, wake: asyncio.Event, gone: asyncio.Event) -> None:
        settled = await self._settled(wake, gone)
        if settled == "gone":
            return
        if settled == "error":
            held = self.store.get(self.rid)
            if held is not None and held.response["status"] == "queued":
                held.response["status"] = "failed"  # a background run that failed
            await _error(protocol.ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError"))(
                {"type": "http"}, _never, send
            )
            return
        r = self.reqs[0]
        response = self.final("completed", r.output.text, r.num_output)
        self.keep(response)
        await _json(response)({"type": "http"}, _never, send)

    async def _stream(
        self, scope: Scope, send: Send, wake: asyncio.Event, gone: asyncio.Event
    ) -> None:
        # Headers, response.created and response.in_progress go out before the engine has the
        # request, as vLLM's generator yields them first.
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        ev = Events(random_id())  # the streamed item's id is a bare uuid in vLLM
        head = response_object(
            self.call, self.rid, self.created, self.limit, "in_progress", [], None
        )
        parts = [ev("response.created", response=head), ev("response.in_progress", response=head)]
        await send(
            {"type": "http.response.body", "body": "".join(parts).encode(), "more_body": True}
        )
        r = self.reqs[0]
        sent, opened, text = 0, False, ""
        while True:
            await wake.wait()
            wake.clear()
            if gone.is_set():
                self.sim.disconnects += 1
                return
            cut_after = self._cut_after()
            out = r.output
            produced = len(out.ids) if cut_after is None else min(len(out.ids), cut_after)
            parts = []
            for t in range(sent, produced):
                delta = out.deltas[t]
                if not delta:
                    continue  # vLLM drops empty deltas (an emoji's leading bytes, the EOS)
                if not opened:
                    parts.extend(ev.opened())
                    opened = True
                parts.append(ev.delta(delta))
                text += delta
            sent = produced
            if r.error:
                await send(
                    {
                        "type": "http.response.body",
                        "body": "".join(parts).encode(),
                        "more_body": True,
                    }
                )
                return _drop()
            ended = r.done and sent == len(out.ids)
            name = self.sim.fault.name if self.sim.fault is not None else None
            if not ended and cut_after is not None and sent >= cut_after and name != "cut_abort":
                await self._cut_responses(scope, send, parts, name)
                return
            if ended or (cut_after is not None and sent >= cut_after):
                # Finished, or aborted in the engine (cut_abort): vLLM closes the item and
                # completes the response with what was generated.
                if opened:
                    parts.extend(ev.closed(text))
                response = self.final("completed", text, sent)
                self.keep(response)
                parts.append(ev("response.completed", response=response))
                await send({"type": "http.response.body", "body": "".join(parts).encode()})
                return
            if parts:
                await send(
                    {
                        "type": "http.response.body",
                        "body": "".join(parts).encode(),
                        "more_body": True,
                    }
                )

    async def _cut_responses(
        self, scope: Scope, send: Send, parts: list[str], name: str | None
    ) -> None:
        """End a stream under ``cut_close`` / ``cut_reset`` / ``cut_error`` (``faults.py``)."""
        if parts:
            await send(
                {"type": "http.response.body", "body": "".join(parts).encode(), "more_body": True}
            )
        if name == "cut_error":
            return _drop()  # vLLM's Responses stream has no in-band error event
        if name == "cut_reset" and await self.sim.reset_connection(scope.get("client")):
            return
        await send({"type": "http.response.body", "body": b""})


def _drop() -> None:
    """End a stream without its last chunk, so uvicorn closes the connection mid-body: what a
    vLLM Responses stream does when generation fails. Its handler for ``GenerationError``
    validates ``{"error": ...}`` as a stream event, which fails, and an ``EngineDeadError`` is
    not caught at all; either way the exception escapes the ``StreamingResponse``
    (``responses/serving.py`` at commit 90d7b6b8). The caller returns right after."""
    return None


async def _never() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _discard(message: Message) -> None:
    return None


# -- routes -----------------------------------------------------------------------------------


class ResponsesRoutes:
    """The handlers of ``/v1/responses``, ``GET /v1/responses/{id}`` and ``.../cancel``."""

    def __init__(self, sim: Sim, json_body: Callable[[Request], Awaitable[Any]]) -> None:
        self.sim = sim
        self.json_body = json_body
        self.store = ResponseStore()

    async def create(self, request: Request) -> Any:
        sim, s = self.sim, self.sim.settings
        try:
            body = await self.json_body(request)
        except protocol.ApiError as exc:
            return _error(exc)
        fault = sim.error_rate_error()
        if fault is not None:
            return _error(fault)
        try:
            call = parse(body, s.models, priority_enabled=s.scheduling_policy == "priority")
            if call.background and call.stream:
                raise protocol.semantic_error("background streaming is not simulated", "background")
            if sim.engine.dead is not None:
                raise protocol.ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError")
            previous = None
            if call.previous_response_id is not None:
                previous = self.store.get(call.previous_response_id)
                if previous is None:
                    raise not_found(call.previous_response_id)
            messages = conversation(call, previous)
            prompt = prompt_ids(messages, call.tools, s.max_model_len)
        except protocol.ApiError as exc:
            return _error(exc)
        rest = s.max_model_len - len(prompt)
        limit = rest if call.max_output_tokens is None else min(call.max_output_tokens, rest)
        # vLLM's extra body field ``request_id`` names the response, else resp_<uuid>.
        named = body.get("request_id")
        rid = named if isinstance(named, str) and named else f"resp_{random_id()}"
        # The answer's seed as app.py's _output_seed computes it (no request seed, choice 0),
        # so replicas agree and a continuation goes on where a cut left off.
        seed = hash((s.seed, 0, 0)) & 0xFFFF_FFFF_FFFF
        natural = (s.natural_len_min, s.natural_len_max) if call.max_output_tokens is None else None
        out = Output(seed, max_tokens=limit, prompt=prompt, natural_range=natural)
        req = EngineRequest(
            id=f"{rid}-0",
            prompt=prompt,
            output=out,
            priority=call.priority,
            arrival=time.monotonic(),
            max_tokens=limit,
        )
        sampling = protocol.Sampling(
            max_tokens=call.max_output_tokens, stream=call.stream, priority=call.priority
        )
        g = protocol.GenerationRequest("chat", call.model, [prompt], [None], sampling)
        gen = ResponsesGeneration(sim, g, [req], call, rid, self.store, messages)
        if not call.background:  # stored when done, if ``store``
            return gen
        queued = response_object(call, rid, gen.created, limit, "queued", [], None)
        held = Stored(dict(queued), messages)
        self.store.put(rid, held)
        held.task = asyncio.create_task(self._run(gen, held))
        return _json(queued)

    async def _run(self, gen: ResponsesGeneration, held: Stored) -> None:
        await gen({"type": "http"}, _never, _discard)
        if held.response["status"] == "queued" and self.store.get(gen.rid) is held:
            held.response["status"] = "failed"  # the engine refused it (engine_dead)

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        held = self.store.get(response_id)
        if held is None:
            return _error(not_found(response_id))
        if request.query_params.get("stream", "").lower() in ("true", "1"):
            # vLLM replays events only for background streams, which the simulator does not
            # run; for any other id it answers this.
            return _error(
                protocol.semantic_error(
                    f"Unknown response_id: {response_id}", "response_id", response_id
                )
            )
        return _json(held.response)

    async def cancel(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        held = self.store.get(response_id)
        if held is None:
            return _error(not_found(response_id))
        if held.response["status"] not in ("queued", "in_progress"):
            return _error(
                protocol.ApiError(
                    400,
                    "Cannot cancel a synchronous response.",
                    "invalid_request_error",
                    "response_id",
                )
            )
        held.response["status"] = "cancelled"
        if held.task is not None and not held.task.done():
            held.task.cancel()  # Generation aborts the engine request on the way out
            await asyncio.gather(held.task, return_exceptions=True)
        return _json(held.response)
