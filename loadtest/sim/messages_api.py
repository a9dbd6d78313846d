"""vLLM's Anthropic Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on
the simulator's chat generation path.

vLLM serves it by translating the request into a Chat Completions request, running chat, and
translating the answer back (``vllm/entrypoints/anthropic/serving.py`` at commit
0001948bc76939369ca855c90b36d81256477e85, ``api_router.py`` at
01540b75e3b1c58a3bf586ee6defbdde6e0a2c1b; facts in ``tests/fixtures/README.md``). This
module does the same onto :class:`Generation`: the request becomes chat messages, is rendered
with the chat template of ``tokenizer.py`` and runs as one engine request, so batching, prefix
caching, metrics, the request log and the faults act as on chat, and ``count_tokens`` counts the
very prompt the generation runs. Shapes follow ``tests/fixtures/vllm_messages_*``.

Length: one API's translation both ways (a request into chat, a chat answer and stream back into
Messages) with its error shapes; each direction must be read against the other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope, Send

from . import formats, protocol, tokenizer
from .generate import Output
from .generation import JSON_HEADERS, SSE_HEADERS, Generation
from .replica import ENGINE_DEAD_MESSAGE, Sim
from .scheduler import EngineRequest

# vLLM's finish_reason -> Anthropic stop_reason. Anything else (an abort) has none: the plain
# answer then drops the key (vLLM dumps it with exclude_none), a stream sends null. A stop
# sequence ends with "stop", so vLLM never answers "stop_sequence".
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ROLES = ("user", "assistant", "system")
ROLE_ALIASES = {"ctx": "user", "msg": "user"}  # sent by recent Claude Code; vLLM maps them
BLOCK_TYPES = (
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
)
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request system text


def _json(data: Any, status: int = 200) -> Response:
    return Response(formats.compact(data), status_code=status, media_type="application/json")


def error_body(err_type: str, message: str) -> dict[str, Any]:
    """vLLM's ``AnthropicErrorResponse``: what the handler's own errors become on these routes.
    Request validation (a missing field, bad JSON) is not: it keeps vLLM's app-wide
    ``{"error": {...}}`` shape of ``protocol.validation_error``."""
    return {"type": "error", "error": {"type": err_type, "message": message}}


def _translated(exc: protocol.ApiError) -> Response:
    """An error of the chat handler, as vLLM's ``translate_error_response`` passes it on."""
    return _json(error_body(exc.err_type, exc.message), exc.status)


# -- requests ---------------------------------------------------------------------------------


@dataclass
class Call:
    """One validated Messages request."""

    model: str
    messages: list[dict[str, Any]]  # in Chat Completions form
    tools: list[dict[str, Any]] | None
    max_tokens: int | None  # None for count_tokens
    stop: list[str]
    stream: bool


def _invalid(loc: str, kind: str, msg: str, value: Any) -> protocol.ApiError:
    return protocol.validation_error(loc, kind, msg, value)


def _blocks(value: Any, loc: str) -> list[dict[str, Any]]:
    """Content blocks, checked as vLLM's ``AnthropicContentBlock`` checks them."""
    if not isinstance(value, list):
        raise _invalid(loc, "string_type", "Input should be a valid string", value)
    for j, block in enumerate(value):
        if not isinstance(block, dict):
            raise _invalid(
                f"{loc}.{j}",
                "model_type",
                "Input should be a valid dictionary or instance of AnthropicContentBlock",
                block,
            )
        if block.get("type") not in BLOCK_TYPES:
            allowed = ", ".join(f"'{t}'" for t in BLOCK_TYPES[:-1])
            raise _invalid(
                f"{loc}.{j}.type",
                "literal_error",
                f"Input should be {allowed} or '{BLOCK_TYPES[-1]}'",
                block.get("type"),
            )
        for key in ("text", "thinking", "id", "tool_use_id", "name"):
            if block.get(key) is not None and not isinstance(block[key], str):
                raise _invalid(
                    f"{loc}.{j}.{key}", "string_type", "Input should be a valid string", block[key]
                )
    return value


def parse(body: Any, models: Sequence[str], *, count_only: bool = False) -> Call:
    """Check a request as vLLM's ``AnthropicMessagesRequest`` (or ``AnthropicCountTokensRequest``
    with ``count_only``) does, and translate it into chat messages."""
    if not isinstance(body, dict):
        raise _invalid("", "model_attributes_type", "Input should be a valid dictionary", body)
    if "model" not in body:
        raise _invalid("model", "missing", "Field required", body)
    model = protocol._get(body, "model", "str")
    if not model:
        raise _invalid("model", "value_error", "Value error, Model is required", model)
    if "messages" not in body:
        raise _invalid("messages", "missing", "Field required", body)
    messages = protocol._get(body, "messages", "list")
    if messages is None:
        raise _invalid("messages", "list_type", "Input should be a valid list", None)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _invalid(
                f"messages.{i}",
                "model_type",
                "Input should be a valid dictionary or instance of AnthropicMessage",
                message,
            )
        role = message.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            kind = "missing" if "role" not in message else "literal_error"
            text = (
                "Field required"
                if "role" not in message
                else ("Input should be 'user', 'assistant' or 'system'")
            )
            raise _invalid(f"messages.{i}.role", kind, text, message.get("role", message))
        if "content" not in message:
            raise _invalid(f"messages.{i}.content", "missing", "Field required", message)
        if not isinstance(message["content"], str):
            _blocks(message["content"], f"messages.{i}.content")
    max_tokens = None
    if not count_only:
        if "max_tokens" not in body:
            raise _invalid("max_tokens", "missing", "Field required", body)
        max_tokens = protocol._get(body, "max_tokens", "int")
        if max_tokens is None or max_tokens <= 0:
            raise _invalid(
                "max_tokens", "value_error", "Value error, max_tokens must be positive", max_tokens
            )
    stop = protocol._get(body, "stop_sequences", "list") or []
    if not all(isinstance(s, str) for s in stop):
        raise _invalid("stop_sequences", "string_type", "Input should be a valid string", stop)
    stream = bool(protocol._get(body, "stream", "bool", False)) and not count_only
    for key in ("temperature", "top_p"):
        protocol._get(body, key, "float")
    protocol._get(body, "top_k", "int")
    protocol._get(body, "metadata", "dict")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _blocks(system, "system")
    tools = _tools(body)
    if model not in models:
        # vLLM checks the model in the chat handler: its 404 is translated, not a validation.
        raise protocol.not_found_model(model)
    return Call(model, chat_messages(system, messages), tools, max_tokens, stop, stream)


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """``tools`` in Chat Completions form (what the chat template renders); ``tool_choice`` is
    only checked: the simulator's answers never call a tool."""
    choice = protocol._get(body, "tool_choice", "dict")
    if choice is not None:
        if choice.get("type") not in ("auto", "any", "tool", "none"):
            raise _invalid(
                "tool_choice.type",
                "literal_error",
                "Input should be 'auto', 'any', 'tool' or 'none'",
                choice.get("type"),
            )
        if choice["type"] == "tool" and not choice.get("name"):
            raise _invalid(
                "tool_choice",
                "value_error",
                "Value error, tool_choice.name is required when type is 'tool'",
                choice,
            )
    tools = protocol._get(body, "tools", "list")
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _invalid(
                f"tools.{i}",
                "model_type",
                "Input should be a valid dictionary or instance of AnthropicTool",
                tool,
            )
        for key, kind in (("name", "str"), ("input_schema", "dict")):
            if key not in tool:
                raise _invalid(f"tools.{i}.{key}", "missing", "Field required", tool)
            protocol._get(tool, key, kind)
        schema = {"type": "object", **tool["input_schema"]}
        function = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": schema,
        }
        out.append({"type": "function", "function": function})
    return out


def _system_texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    # Claude Code's billing header carries a per-request hash; vLLM drops it so that the
    # prompt's prefix stays cacheable.
    return [
        b["text"]
        for b in content
        if b.get("type") == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)
    ]


def chat_messages(system: Any, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages vLLM builds from a Messages request: one system message (the
    ``system`` field and system-role messages, joined); text and image blocks as content parts;
    ``tool_use`` as tool calls; a user's ``tool_result`` as a tool message placed before the
    user message; thinking as ``reasoning`` (Qwen2.5's template does not render it)."""
    texts = _system_texts(system) if system else []
    for m in messages:
        if m.get("role") == "system":
            texts.extend(_system_texts(m["content"]))
    out: list[dict[str, Any]] = [{"role": "system", "content": "".join(texts)}] if texts else []
    for m in messages:
        role = ROLE_ALIASES.get(m["role"], m["role"])
        if role == "system":
            continue
        msg: dict[str, Any] = {"role": role}
        if isinstance(m["content"], str):
            msg["content"] = m["content"]
        else:
            _convert_blocks(m["content"], role, msg, out)
        if not (role == "user" and "content" not in msg):
            out.append(msg)
    return out


def _convert_blocks(
    blocks: Sequence[Mapping[str, Any]], role: str, msg: dict[str, Any], out: list[dict[str, Any]]
) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for b in blocks:
        kind = b["type"]
        if kind == "text" and b.get("text"):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and b.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b["source"])}})
        elif kind == "thinking" and b.get("thinking") is not None:
            reasoning.append(b["thinking"])
        elif kind == "tool_use":
            arguments = formats.compact(b.get("input") or {}).decode()
            calls.append(
                {
                    "id": b.get("id") or f"call_{int(time.time())}",
                    "type": "function",
                    "function": {"name": b.get("name") or "", "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            if role == "user":
                out.extend(_tool_result(b))
            else:
                result = str(b["content"]) if b.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {result}"})
        # redacted_thinking and tool_reference add nothing to the prompt.
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        msg["content"] = parts[0]["text"]
    elif parts:
        msg["content"] = parts


def _image_url(source: Mapping[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_result(block: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A user's ``tool_result``: a tool message, then its images as a user message."""
    content = block.get("content")
    text, images = "", []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        items = [c for c in content if isinstance(c, Mapping)]
        text = "\n".join(str(c.get("text", "")) for c in items if c.get("type") == "text")
        images = [_image_url(c.get("source") or {}) for c in items if c.get("type") == "image"]
    out: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text}
    ]
    if images:
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
        out.append({"role": "user", "content": parts})
    return out


def prompt_ids(call: Call) -> list[int]:
    """The prompt the engine runs, and ``count_tokens`` counts."""
    try:
        return tokenizer.chat_prompt_ids(call.messages, tools=call.tools)
    except tokenizer.TemplateError as exc:
        raise protocol.semantic_error(str(exc), "messages") from None
    except UnicodeEncodeError as exc:
        raise protocol.unencodable(exc) from None


# -- answers ----------------------------------------------------------------------------------


def event(name: str, data: dict[str, Any]) -> str:
    """One SSE event as vLLM's ``wrap_data_with_event`` writes it: compact JSON."""
    return f"event: {name}\ndata: {formats.compact(data).decode()}\n\n"


def _usage(prompt: int, output: int) -> dict[str, int]:
    return {"input_tokens": prompt, "output_tokens": output}


def unparsable_error(chat_error: dict[str, Any]) -> str:
    """The in-band error of a Messages stream. vLLM's converter validates each chat chunk as a
    ``ChatCompletionStreamResponse``; the chat stream's ``{"error": ...}`` event fails that, and
    the converter sends pydantic's text as an ``internal_error`` and ends the stream. This
    rebuilds that text (pydantic cuts the input's repr to its first 25 and last 24 chars)."""
    shown = repr(chat_error)
    if len(shown) > 50:
        shown = shown[:25] + "..." + shown[-24:]
    line = (
        f"  Field required [type=missing, input_value={shown}, input_type=dict]\n"
        "    For further information visit https://errors.pydantic.dev/2.12/v/missing"
    )
    text = f"2 validation errors for ChatCompletionStreamResponse\nmodel\n{line}\nchoices\n{line}"
    return event("error", error_body("internal_error", text))


class MessagesGeneration(Generation):
    """One Messages request through the engine: :class:`Generation` submits it, watches the
    client and aborts; this class writes vLLM's Messages shapes."""

    def __init__(
        self, sim: Sim, g: protocol.GenerationRequest, reqs: list[EngineRequest], rid: str
    ) -> None:
        super().__init__(sim, g, reqs, rid)
        self.message_id = f"chatcmpl-{rid}"  # vLLM reuses the chat completion's id

    async def _plain(self, send: Send, wake: asyncio.Event, gone: asyncio.Event) -> None:
        settled = await self._settled(wake, gone)
        if settled == "gone":
            return
        r = self.reqs[0]
        if settled == "error":
            # The engine's error escapes the chat handler; vLLM's Messages router catches it.
            data: dict[str, Any] = error_body("internal_error", r.error or ENGINE_DEAD_MESSAGE)
            status = 500
        else:
            text = r.output.text
            data = {
                "id": self.message_id,
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": text}] if text else [],
                "model": self.req.model,
                "stop_reason": STOP_REASONS.get(r.output.finish_reason or ""),
                "usage": _usage(len(r.prompt), r.num_output),
            }
            if data["stop_reason"] is None:
                del data["stop_reason"]
            status = 200
        body = formats.compact(data)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*JSON_HEADERS, (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _start(self) -> str:
        # Dumped with exclude_unset, so the message has neither "type" nor "role".
        message: dict[str, Any] = {
            "id": self.message_id,
            "content": [],
            "model": self.req.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(len(self.reqs[0].prompt), 0),
        }
        return event("message_start", {"type": "message_start", "message": message})

    def _end(self, opened: bool, stop_reason: str | None, output: int) -> list[str]:
        parts = [event("content_block_stop", {"type": "content_block_stop", "index": 0})]
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason},
            "usage": _usage(len(self.reqs[0].prompt), output),
        }
        return [
            *(parts if opened else []),
            event("message_delta", delta),
            event("message_stop", {"type": "message_stop"}),
        ]

    async def _stream(
        self, scope: Scope, send: Send, wake: asyncio.Event, gone: asyncio.Event
    ) -> None:
        # Headers go out at once; message_start waits for the first token, as vLLM's converter
        # answers the chat stream's role chunk, which comes with it. A stall stays silent.
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        r = self.reqs[0]
        sent, started, opened = 0, False, False
        while True:
            await wake.wait()
            wake.clear()
            if gone.is_set():
                self.sim.disconnects += 1
                return
            cut_after = self._cut_after()
            out = r.output
            produced = len(out.ids) if cut_after is None else min(len(out.ids), cut_after)
            parts: list[str] = []
            if produced > sent and not started:
                parts.append(self._start())
                started = True
            for t in range(sent, produced):
                delta = out.deltas[t]
                if not delta:
                    continue  # vLLM's converter skips empty deltas (the EOS, an emoji's bytes)
                if not opened:
                    block = {
                        "type": "content_block_start",
                        "content_block": {"type": "text", "text": ""},
                        "index": 0,
                    }
                    parts.append(event("content_block_start", block))
                    opened = True
                parts.append(
                    event(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "delta": {"type": "text_delta", "text": delta},
                            "index": 0,
                        },
                    )
                )
            sent = produced
            fault = self.sim.fault
            name = fault.name if fault is not None else None
            cut = (
                cut_after is not None
                and sent >= cut_after
                and not (r.done and sent == len(out.ids))
            )
            if r.error or (cut and name == "cut_error"):
                status: int = 500
                message: str | None = r.error
                if message is None and fault is not None:
                    status = int(fault.params["status"])
                    message = f"Simulated fault: cut_error (status {status})"
                err = {
                    "message": message,
                    "type": protocol.error_type(status),
                    "param": None,
                    "code": status,
                }
                parts.append(unparsable_error({"error": err}))
                await send({"type": "http.response.body", "body": "".join(parts).encode()})
                return
            if cut and name != "cut_abort":
                await self._cut_messages(scope, send, parts, name)
                return
            if cut or (r.done and sent == len(out.ids)):
                # Finished, or aborted in the engine (cut_abort: finish_reason "abort", which
                # maps to no stop_reason).
                if not started:
                    parts.append(self._start())
                reason = "abort" if cut else (out.finish_reason or "stop")
                parts.extend(self._end(opened, STOP_REASONS.get(reason), sent))
                await send({"type": "http.response.body", "body": "".join(parts).encode()})
                return
            if parts:
                body = "".join(parts).encode()
                await send({"type": "http.response.body", "body": body, "more_body": True})

    async def _cut_messages(
        self, scope: Scope, send: Send, parts: list[str], name: str | None
    ) -> None:
        """End a stream under ``cut_close`` / ``cut_reset`` (``faults.py``)."""
        if parts:
            body = "".join(parts).encode()
            await send({"type": "http.response.body", "body": body, "more_body": True})
        if name == "cut_reset" and await self.sim.reset_connection(scope.get("client")):
            return
        await send({"type": "http.response.body", "body": b""})


# -- routes -----------------------------------------------------------------------------------


class MessagesRoutes:
    """The handlers of ``/v1/messages`` and ``/v1/messages/count_tokens``."""

    def __init__(self, sim: Sim, json_body: Callable[[Request], Awaitable[Any]]) -> None:
        self.sim = sim
        self.json_body = json_body

    async def _call(self, request: Request, *, count_only: bool) -> Call | Response:
        try:
            body = await self.json_body(request)
            return parse(body, self.sim.settings.models, count_only=count_only)
        except protocol.ApiError as exc:
            if exc.err_type == "Bad Request":  # a validation error: vLLM's app-wide shape
                return _json(exc.body(), exc.status)
            return _translated(exc)

    async def create(self, request: Request) -> Any:
        sim, s = self.sim, self.sim.settings
        call = await self._call(request, count_only=False)
        if isinstance(call, Response):
            return call
        fault = sim.error_rate_error()
        if fault is not None:
            return _json(error_body(fault.err_type, fault.message), fault.status)
        if sim.engine.dead is not None:
            # The chat handler raises the engine's death; the Messages router answers it.
            return _json(error_body("internal_error", ENGINE_DEAD_MESSAGE), 500)
        try:
            prompt = prompt_ids(call)
            limit = protocol.effective_max_tokens(len(prompt), call.max_tokens, s.max_model_len)
        except protocol.ApiError as exc:
            return _translated(exc)
        rid = protocol.request_id(request.headers.get("x-request-id"))
        # The answer's seed as app.py's _output_seed computes it (no request seed, choice 0),
        # so replicas agree and a continuation goes on where a cut left off.
        seed = hash((s.seed, 0, 0)) & 0xFFFF_FFFF_FFFF
        out = Output(seed, max_tokens=limit, prompt=prompt, stop=call.stop)
        req = EngineRequest(
            id=f"{rid}-0", prompt=prompt, output=out, arrival=time.monotonic(), max_tokens=limit
        )
        # vLLM streams the chat answer with include_usage and continuous_usage_stats.
        sampling = protocol.Sampling(
            max_tokens=call.max_tokens,
            stop=call.stop,
            stream=call.stream,
            include_usage=call.stream,
            continuous_usage=call.stream,
        )
        g = protocol.GenerationRequest("chat", call.model, [prompt], [None], sampling)
        return MessagesGeneration(sim, g, [req], rid)

    async def count_tokens(self, request: Request) -> Response:
        call = await self._call(request, count_only=True)
        if isinstance(call, Response):
            return call
        try:
            n = len(prompt_ids(call))
        except protocol.ApiError as exc:
            return _translated(exc)
        return _json({"input_tokens": n, "context_management": {"original_input_tokens": n}})
