"""Parse and check a request body before it costs a replica anything.

Only what the gateway itself relies on is checked (the fields it classifies and routes by);
everything else is vLLM's to judge, and the body is forwarded byte for byte either way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Final

import msgspec

from proxy.errors import BadRequest


def media_type(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The request's media type, lower-cased and without parameters; None when it has none."""
    for key, value in headers:
        if key == b"content-type":
            return value.split(b";", 1)[0].strip().lower()
    return None


def is_json_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """A body vLLM reads as JSON: ``application/json``, ``application/<x>+json``, or one with
    no Content-Type at all (FastAPI parses those as JSON too)."""
    kind = media_type(headers)
    return (
        kind is None
        or kind == b"application/json"
        or (kind.startswith(b"application/") and kind.endswith(b"+json"))
    )


_DECODER: Final = msgspec.json.Decoder()
_DECODE: Final = _DECODER.decode  # bound once: compiled, a method call looks it up by name


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``BadRequest`` naming what is wrong with it.

    Parsed by msgspec (a fifth of ``json.loads``' time on a chat body); what msgspec refuses
    is parsed again by ``json``, which decides and words the error: ``json`` also takes
    ``NaN``, ``Infinity``, numbers past a float's range and lone surrogates, as vLLM's own
    parser (FastAPI's ``json.loads``) does. Where both parse, they give the same objects
    (``tests/test_validate.py``)."""
    try:
        body = _DECODE(raw)
    except (ValueError, RecursionError):  # msgspec's DecodeError; invalid UTF-8 in a string
        return _parse_with_json(raw)
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(body).__name__}")
    return body


def _parse_with_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(body).__name__}")
    return body


def _int_field(body: dict[str, Any], name: str, minimum: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"`{name}` must be an integer", param=name)
    if value < minimum:
        raise BadRequest(f"`{name}` must be at least {minimum}, got {value}", param=name)


def _common(body: dict[str, Any]) -> None:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("`stream` must be a boolean", param="stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("`model` must be a string", param="model")
    _int_field(body, "max_tokens", 0)
    _int_field(body, "max_completion_tokens", 0)
    _int_field(body, "n", 1)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("`stream_options` must be an object", param="stream_options")


def check_chat(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("`messages` is required", param="messages")
    if not isinstance(messages, list):
        raise BadRequest("`messages` must be a list of messages", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"`messages[{i}]` must be an object", param="messages")
    _common(body)


def check_completion(body: dict[str, Any]) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("`prompt` is required", param="prompt")
    if not isinstance(prompt, (str, list)):
        raise BadRequest(
            "`prompt` must be a string, a list of strings or a list of token ids", param="prompt"
        )
    _common(body)


def check_messages(body: dict[str, Any]) -> None:
    """An Anthropic Messages body: ``messages`` and ``max_tokens`` are required there."""
    check_chat(body)
    if body.get("max_tokens") is None:
        raise BadRequest("`max_tokens` is required", param="max_tokens")
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise BadRequest("`system` must be a string or a list of text blocks", param="system")
    thinking = body.get("thinking")
    if thinking is not None and not isinstance(thinking, dict):
        raise BadRequest("`thinking` must be an object", param="thinking")


def check_responses(body: dict[str, Any]) -> None:
    """A Responses body: ``input`` is a string or a list of items (it may be left out only
    where a previous response carries the conversation on)."""
    value = body.get("input")
    if value is None and body.get("previous_response_id") is None:
        raise BadRequest("`input` is required", param="input")
    if value is not None and not isinstance(value, (str, list)):
        raise BadRequest("`input` must be a string or a list of input items", param="input")
    prev = body.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise BadRequest("`previous_response_id` must be a string", param="previous_response_id")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("`instructions` must be a string", param="instructions")
    _int_field(body, "max_output_tokens", 1)
    _common(body)


def wants_stream(body: dict[str, Any]) -> bool:
    return body.get("stream") is True


def wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True
