"""vLLM's OpenAI request handling, as pure functions: validation with vLLM's error bodies, the
output budget, and ``/tokenize`` / ``/detokenize``. Response shapes are in ``formats.py``.

Error bodies come in vLLM's three shapes: a pydantic validation failure (``type`` "Bad Request",
``param`` "body.<field>"), a semantic check (``type`` "BadRequestError", the message ending with
``(parameter=..., value=...)`` as ``VLLMValidationError`` prints it), and 404 "NotFoundError"
for a model that is not served.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import tokenizer

VLLM_VERSION = "0.21.1"
VOCAB_LIMIT = 151_665  # Qwen2.5's vocabulary with its added tokens
MAX_N = 128  # the simulator's own guard; vLLM has none
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


class ApiError(Exception):
    """An error response in vLLM's shape."""

    def __init__(
        self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


_ERROR_TYPES = {
    400: "BadRequestError", 404: "NotFoundError", 429: "TooManyRequestsError",
    500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}  # fmt: skip


def error_type(status: int) -> str:
    """vLLM's error ``type`` for an HTTP status."""
    return _ERROR_TYPES.get(status, "InternalServerError")


def semantic_error(message: str, parameter: str, value: Any = None) -> ApiError:
    """``VLLMValidationError``: its text ends with the parameter and value."""
    suffix = f" (parameter={parameter}, value={value})" if value is not None else ""
    return ApiError(400, message + suffix, "BadRequestError", parameter)


def _summary(value: Any) -> Any:
    if isinstance(value, list | tuple | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, str) and len(value) > 200:
        return value[:200] + "...[truncated]"
    return value


def validation_error(loc: str, kind: str, msg: str, value: Any) -> ApiError:
    """A FastAPI/pydantic ``RequestValidationError`` as vLLM renders it."""
    err = {"type": kind, "loc": f"body.{loc}" if loc else "body", "msg": msg}
    err["input"] = _summary(value)
    return ApiError(400, f"1 validation error:\n  {err}", "Bad Request", err["loc"])


def not_found_model(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


# -- field checks -----------------------------------------------------------------------------

_KINDS: dict[str, tuple[str, str]] = {
    "int": ("int_type", "Input should be a valid integer"),
    "float": ("float_type", "Input should be a valid number"),
    "bool": ("bool_type", "Input should be a valid boolean"),
    "str": ("string_type", "Input should be a valid string"),
    "list": ("list_type", "Input should be a valid list"),
    "dict": ("dict_type", "Input should be a valid dictionary"),
}


def _get(body: Mapping[str, Any], key: str, kind: str, default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    ok: bool
    if kind == "int":
        ok = not isinstance(value, bool) and (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        )
        value = int(value) if ok else value
    elif kind == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "str":
        ok = isinstance(value, str)
    elif kind == "list":
        ok = isinstance(value, list)
    else:
        ok = isinstance(value, dict)
    if not ok:
        raise validation_error(key, *_KINDS[kind], value)
    return value


def _stop_list(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise validation_error("stop", "string_type", "Input should be a valid string", stop)


@dataclass
class Sampling:
    max_tokens: int | None  # as requested; None lets the output end naturally
    n: int = 1
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False
    seed: int | None = None
    priority: int = 0
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    return_token_ids: bool = False  # vLLM's extension: prompt and output token ids


@dataclass
class GenerationRequest:
    kind: str  # "chat" or "completion"
    model: str  # as the response names it
    prompts: list[list[int]]  # one per prompt (chat: exactly one)
    prompt_texts: list[str | None]
    sampling: Sampling


def _common(
    body: Mapping[str, Any], models: Sequence[str], priority_enabled: bool
) -> tuple[str, Sampling]:
    model = _get(body, "model", "str")
    if model and model not in models:
        raise not_found_model(model)
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p"):
        _get(body, key, "float")
    _get(body, "top_k", "int")
    _get(body, "user", "str")
    temperature = body.get("temperature")
    if temperature is not None and temperature < 0:
        raise semantic_error(
            f"temperature must be non-negative, got {temperature}.", "temperature", temperature
        )
    n = _get(body, "n", "int", 1)
    if n < 1:
        raise semantic_error(f"n must be at least 1, got {n}.", "n", n)
    if n > MAX_N:
        raise semantic_error(f"n must be at most {MAX_N} (simulator limit), got {n}.", "n", n)
    stream = bool(_get(body, "stream", "bool", False))
    options = _get(body, "stream_options", "dict")
    if options and not stream:
        raise semantic_error(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    options = options or {}
    include_usage = bool(_get(options, "include_usage", "bool", False))
    continuous = bool(_get(options, "continuous_usage_stats", "bool", False))
    priority = _get(body, "priority", "int", 0)
    if priority != 0 and not priority_enabled:
        raise semantic_error(
            f"Got priority {priority} but Priority scheduling is not enabled.", "priority", priority
        )
    sampling = Sampling(
        max_tokens=None,
        n=n,
        stop=_stop_list(body),
        include_stop=bool(_get(body, "include_stop_str_in_output", "bool", False)),
        seed=_get(body, "seed", "int"),
        priority=priority,
        stream=stream,
        include_usage=stream and include_usage,
        continuous_usage=stream and include_usage and continuous,
        return_token_ids=bool(_get(body, "return_token_ids", "bool", False)),
    )
    return model or models[0], sampling


def _max_tokens(value: int | None, name: str) -> int | None:
    if value is not None and value < 1:
        raise semantic_error(f"{name} must be at least 1, got {value}.", name, value)
    return value


def _messages(body: Mapping[str, Any]) -> list[Any]:
    """A chat request's ``messages``, checked as vLLM's pydantic models check them."""
    if "messages" not in body:
        raise validation_error("messages", "missing", "Field required", body)
    messages = _get(body, "messages", "list")
    if messages is None:
        raise validation_error("messages", "list_type", "Input should be a valid list", None)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise validation_error(
                f"messages.{i}", "dict_type", "Input should be a valid dictionary", message
            )
        if not isinstance(message.get("role"), str):
            raise validation_error(f"messages.{i}.role", "missing", "Field required", message)
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise validation_error(
                f"messages.{i}.tool_calls", "list_type", "Input should be a valid list", calls
            )
    return messages


def parse_chat(
    body: Any, models: Sequence[str], *, priority_enabled: bool = False
) -> GenerationRequest:
    if not isinstance(body, dict):
        raise validation_error(
            "", "model_attributes_type", "Input should be a valid dictionary", body
        )
    messages = _messages(body)
    model, sampling = _common(body, models, priority_enabled)
    _get(body, "logprobs", "bool")
    _get(body, "top_logprobs", "int")
    tools = _get(body, "tools", "list")
    add_generation_prompt = _get(body, "add_generation_prompt", "bool", True)
    # max_completion_tokens is the current name; vLLM prefers it over the deprecated one.
    limit = _get(body, "max_completion_tokens", "int")
    name = "max_completion_tokens"
    if limit is None:
        limit, name = _get(body, "max_tokens", "int"), "max_tokens"
    sampling.max_tokens = _max_tokens(limit, name)
    try:
        prompt = tokenizer.chat_prompt_ids(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )
    except tokenizer.TemplateError as exc:
        raise semantic_error(str(exc), "messages") from None
    except UnicodeEncodeError as exc:
        raise unencodable(exc) from None
    return GenerationRequest("chat", model, [prompt], [None], sampling)


def unencodable(exc: UnicodeEncodeError) -> ApiError:
    """Text the tokenizer cannot encode (a lone surrogate such as ``"\\ud800"`` in JSON): vLLM
    turns the tokenizer's ``ValueError`` into a 400 with its message."""
    return ApiError(400, str(exc), "BadRequestError")


def parse_completion(
    body: Any, models: Sequence[str], *, priority_enabled: bool = False
) -> GenerationRequest:
    if not isinstance(body, dict):
        raise validation_error(
            "", "model_attributes_type", "Input should be a valid dictionary", body
        )
    prompt = body.get("prompt")
    if prompt is None or prompt == "":
        raise semantic_error(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    try:
        prompts, texts = _completion_prompts(prompt)
    except UnicodeEncodeError as exc:
        raise unencodable(exc) from None
    for ids in prompts:
        if not ids:
            raise semantic_error("The decoder prompt cannot be empty", "prompt")
        low, high = min(ids), max(ids)
        if low < 0:
            raise validation_error(
                "prompt", "greater_than_equal", "Input should be greater than or equal to 0", low
            )
        if high >= VOCAB_LIMIT:
            raise semantic_error(f"Token id {high} is out of vocabulary", "prompt", high)
    model, sampling = _common(body, models, priority_enabled)
    _get(body, "logprobs", "int")
    sampling.echo = bool(_get(body, "echo", "bool", False))
    # Absent, max_tokens is 16; an explicit null lifts the limit (the context's rest in vLLM;
    # here the answer ends naturally, as a model's does).
    default = None if "max_tokens" in body else COMPLETION_DEFAULT_MAX_TOKENS
    sampling.max_tokens = _max_tokens(_get(body, "max_tokens", "int", default), "max_tokens")
    return GenerationRequest("completion", model, prompts, texts, sampling)


def _completion_prompts(prompt: Any) -> tuple[list[list[int]], list[str | None]]:
    """A completions ``prompt`` (text, texts, token ids or lists of token ids) as token ids."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)], [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p) for p in prompt], list(prompt)
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return [list(prompt)], [None]
    if isinstance(prompt, list) and all(
        isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt
    ):
        return [list(p) for p in prompt], [None] * len(prompt)
    raise validation_error("prompt", "string_type", "Input should be a valid string", prompt)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def effective_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The output budget, or vLLM's 400 when the prompt and output do not fit the context."""
    if max_tokens is None:
        if prompt_len >= max_model_len:
            raise semantic_error(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"request has {prompt_len} input tokens. Please reduce the length of the input "
                "messages.",
                "input_tokens",
                prompt_len,
            )
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise semantic_error(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {max_tokens} output tokens and your prompt contains {prompt_len} input "
            f"tokens, for a total of {prompt_len + max_tokens} tokens. Please reduce the length "
            "of the input prompt or the number of requested output tokens.",
            "input_tokens",
            prompt_len,
        )
    return max_tokens


_RENDERED_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                      "frequency_penalty")  # fmt: skip


def render(
    body: Any, models: Sequence[str], max_model_len: int, kind: str, *, priority_enabled: bool
) -> list[dict]:
    """``POST /v1/chat/completions/render`` (``kind`` "chat": one item) and
    ``/v1/completions/render`` (one per prompt): vLLM's ``GenerateRequest`` for each prompt,
    its token ids and the output budget, validated exactly as the generation routes validate.

    ``sampling_params`` carries the fields the simulator models (a subset of vLLM's
    ``SamplingParams``); ``features`` is null (media parts are counted, not rendered)."""
    parse = parse_chat if kind == "chat" else parse_completion
    g = parse(body, models, priority_enabled=priority_enabled)
    sp = g.sampling
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    items = []
    for prompt in g.prompts:
        limit = effective_max_tokens(len(prompt), sp.max_tokens, max_model_len)
        params: dict[str, Any] = {
            "n": sp.n,
            "seed": sp.seed,
            "stop": sp.stop,
            "include_stop_str_in_output": sp.include_stop,
            "max_tokens": limit,
        }
        params.update({k: body[k] for k in _RENDERED_SAMPLING if body.get(k) is not None})
        items.append(
            {
                "request_id": prefix + uuid.uuid4().hex,
                "token_ids": prompt,
                "features": None,
                "sampling_params": params,
                "model": body.get("model"),
                "stream": sp.stream,
                "stream_options": body.get("stream_options") if sp.stream else None,
                "cache_salt": body.get("cache_salt"),
                "priority": sp.priority,
                "kv_transfer_params": None,
            }
        )
    return items


def request_id(header: str | None) -> str:
    """vLLM names a request after the client's X-Request-Id when it sends one."""
    return header if header else uuid.uuid4().hex[:16]


def tokenize(body: Any, models: Sequence[str], max_model_len: int) -> dict[str, Any]:
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` -> vLLM's TokenizeResponse."""
    if not isinstance(body, dict):
        raise validation_error(
            "", "model_attributes_type", "Input should be a valid dictionary", body
        )
    model = _get(body, "model", "str")
    if model and model not in models:
        raise not_found_model(model)
    if "messages" in body:
        messages = _messages(body)
        try:
            ids = tokenizer.chat_prompt_ids(
                messages,
                add_generation_prompt=_get(body, "add_generation_prompt", "bool", True),
                tools=_get(body, "tools", "list"),
            )
        except tokenizer.TemplateError as exc:
            raise semantic_error(str(exc), "messages") from None
        except UnicodeEncodeError as exc:
            raise unencodable(exc) from None
    elif "prompt" in body:
        try:
            ids = tokenizer.encode(_get(body, "prompt", "str", ""))
        except UnicodeEncodeError as exc:
            raise unencodable(exc) from None
    else:
        raise validation_error("prompt", "missing", "Field required", body)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}


def detokenize(body: Any, models: Sequence[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise validation_error(
            "", "model_attributes_type", "Input should be a valid dictionary", body
        )
    model = _get(body, "model", "str")
    if model and model not in models:
        raise not_found_model(model)
    tokens = _get(body, "tokens", "list")
    if tokens is None or not all(_is_int(t) for t in tokens):
        raise validation_error("tokens", "list_type", "Input should be a valid list", tokens)
    return {"prompt": tokenizer.decode(tokens)}
