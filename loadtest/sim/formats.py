"""vLLM's response shapes, as pure functions: plain chat and completion bodies, the SSE events
of a stream (built from pre-rendered prefixes: one event per token per stream is the simulator's
hot path), and ``/v1/models``. Field sets follow ``tests/fixtures/``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_TEXT_CACHE: dict[str, str] = {}


def jtext(text: str) -> str:
    """JSON string literal of ``text``; output pieces repeat, so they are cached."""
    cached = _TEXT_CACHE.get(text)
    if cached is None:
        cached = _DUMPS(text)
        if len(_TEXT_CACHE) < 100_000:
            _TEXT_CACHE[text] = cached
    return cached


def compact(obj: Any) -> bytes:
    try:
        return _DUMPS(obj).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from the request: escape it, as \\udXXX
        return json.dumps(obj, separators=(",", ":")).encode("ascii")


def usage(prompt: int, completion: int, *, details: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if details:
        out["prompt_tokens_details"] = None
    return out


def jids(ids: Sequence[int] | None) -> str:
    """JSON of a token-id list, or null."""
    return "null" if ids is None else "[" + ",".join(map(str, ids)) + "]"


@dataclass
class Choice:
    index: int
    text: str
    finish_reason: str | None
    stop_reason: str | None
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_token_ids: list[int] | None = None  # completions, with return_token_ids


def chat_response(
    rid: str,
    created: int,
    model: str,
    fingerprint: str,
    choices: Sequence[Choice],
    u: dict,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {
                    "role": "assistant",
                    "content": c.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": c.token_ids,
            }
            for c in choices
        ],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": u,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
        "prompt_text": None,
        "kv_transfer_params": None,
    }


def completion_response(
    rid: str, created: int, model: str, fingerprint: str, choices: Sequence[Choice], u: dict
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": c.token_ids,
                "prompt_logprobs": None,
                "prompt_token_ids": c.prompt_token_ids,
            }
            for c in choices
        ],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": u,
        "kv_transfer_params": None,
    }


def stream_error_event(message: str, err_type: str = "InternalServerError", code: int = 500) -> str:
    # vLLM writes this one event with json.dumps' default separators (spaces), unlike chunks.
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"


class StreamFormat:
    """The SSE events of one streamed response (chat or completion), as vLLM serialises them."""

    def __init__(
        self,
        kind: str,
        rid: str,
        created: int,
        model: str,
        fingerprint: str,
        *,
        include_usage: bool,
        continuous_usage: bool,
        token_ids: bool = False,
    ) -> None:
        self.chat = kind == "chat"
        self.token_ids = token_ids
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        self._head = (
            f'data: {{"id":{jtext(prefix + rid)},"object":"{obj}","created":{created},'
            f'"model":{jtext(model)},"choices":'
        )
        self._fingerprint = jtext(fingerprint)
        self._include_usage = include_usage
        self._continuous = continuous_usage

    def _usage(self, prompt: int, completion: int) -> str:
        if not self._continuous:
            return ""
        return f',"usage":{_DUMPS(usage(prompt, completion, details=False))}'

    def role(self, index: int, prompt: int, prompt_ids: Sequence[int] | None = None) -> str:
        """A chat choice's first chunk; with ``return_token_ids`` it carries the prompt ids."""
        pids = jids(prompt_ids if self.token_ids else None)
        return (
            f'{self._head}[{{"index":{index},"delta":{{"role":"assistant","content":""}},'
            f'"logprobs":null,"finish_reason":null}}],"prompt_token_ids":{pids},'
            f'"prompt_text":null{self._usage(prompt, 0)}}}\n\n'
        )

    def token(
        self,
        index: int,
        text: str,
        prompt: int,
        completion: int,
        ids: Sequence[int] | None = None,
        prompt_ids: Sequence[int] | None = None,
    ) -> str:
        """One token's chunk. ``ids``: the token ids it carries; ``prompt_ids``: a completion
        choice's prompt ids, on its first chunk (both only with ``return_token_ids``)."""
        tids = jids(ids if self.token_ids else None)
        if self.chat:
            choice = f'{{"index":{index},"delta":{{"content":{jtext(text)}}},"logprobs":null,'
            choice += f'"finish_reason":null,"token_ids":{tids}}}'
        else:
            pids = jids(prompt_ids if self.token_ids else None)
            choice = f'{{"index":{index},"text":{jtext(text)},"logprobs":null,'
            choice += f'"finish_reason":null,"stop_reason":null,"prompt_token_ids":{pids},'
            choice += f'"token_ids":{tids}}}'
        return f"{self._head}[{choice}]{self._usage(prompt, completion)}}}\n\n"

    def finish(
        self,
        index: int,
        text: str,
        reason: str,
        stop_reason: str | None,
        prompt: int,
        completion: int,
        ids: Sequence[int] | None = None,
        prompt_ids: Sequence[int] | None = None,
    ) -> str:
        stop = jtext(stop_reason) if stop_reason is not None else "null"
        tids = jids(ids if self.token_ids else None)
        if self.chat:
            choice = f'{{"index":{index},"delta":{{"content":{jtext(text)}}},"logprobs":null,'
            choice += f'"finish_reason":"{reason}","stop_reason":{stop},"token_ids":{tids}}}'
        else:
            pids = jids(prompt_ids if self.token_ids else None)
            choice = f'{{"index":{index},"text":{jtext(text)},"logprobs":null,'
            choice += f'"finish_reason":"{reason}","stop_reason":{stop},"prompt_token_ids":{pids},'
            choice += f'"token_ids":{tids}}}'
        # The fingerprint rides on the finishing chunk unless a usage chunk follows.
        fp = "" if self._include_usage else f',"system_fingerprint":{self._fingerprint}'
        return f"{self._head}[{choice}]{fp}{self._usage(prompt, completion)}}}\n\n"

    def usage_chunk(self, prompt: int, completion: int) -> str:
        u = _DUMPS(usage(prompt, completion, details=False))
        return f'{self._head}[],"usage":{u},"system_fingerprint":{self._fingerprint}}}\n\n'


def models_response(models: Sequence[str], created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": m,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": m,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, m).hex[:16]}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for m in models
        ],
    }
