"""Request bodies for the fuzz suite (``tests/test_fuzz.py``), as hypothesis strategies.

Three kinds, in about equal parts: bodies drawn from the request schemas of the classified APIs
(chat and completions, every field vLLM reads, with values at and beyond their edges); a valid
body with one field-level mutation (a value replaced by any JSON, a key dropped, a key added,
the whole body replaced); and raw bytes (noise, a valid body cut short, a byte flipped). The
pass-through paths get noise and JSON too: the gateway reads their bodies for the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
PASSTHROUGH = ("/tokenize", "/detokenize", "/v1/embeddings")


@dataclass(frozen=True)
class Case:
    """One request: where it goes, its body as sent, and its content type."""

    path: str
    body: bytes
    content_type: str

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        return f"Case({self.path!r}, {self.body[:300]!r}, {self.content_type!r})"


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
# Counts the gateway does arithmetic with: mostly small (a fuzzed stream must finish quickly),
# with the edges that once overflowed (issue: `max_tokens: 10**400`).
counts = st.one_of(
    st.integers(-2, 24),
    st.sampled_from([0, 4097, 2**31, 2**63, 10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True),
    scalars,
)
small_n = st.one_of(st.integers(-1, 3), st.sampled_from([10**400, 2**31, 2**63]), scalars)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), scalars)
texts = st.text(max_size=120)
stops = st.one_of(texts, st.lists(st.text(max_size=8), max_size=4), json_values)

text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(texts, scalars)})
image_part = st.fixed_dictionaries(
    {
        "type": st.just("image_url"),
        "image_url": st.one_of(st.fixed_dictionaries({"url": texts}), scalars),
    }
)
contents = st.one_of(
    texts, st.none(), st.lists(st.one_of(text_part, image_part, json_values), max_size=3)
)
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), scalars)
tool_calls = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {
                "id": st.text(max_size=8),
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {"name": st.text(max_size=8), "arguments": texts}
                ),
            }
        ),
        max_size=2,
    ),
    json_values,
)
messages = st.fixed_dictionaries(
    {"role": roles, "content": contents},
    optional={
        "name": st.text(max_size=8),
        "tool_calls": tool_calls,
        "tool_call_id": st.text(max_size=8),
    },
)
tools = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {"name": st.text(max_size=8)},
                    optional={"parameters": json_values, "description": texts},
                ),
            }
        ),
        max_size=2,
    ),
    json_values,
)
stream_options = st.one_of(
    st.fixed_dictionaries(
        {}, optional={"include_usage": scalars, "continuous_usage_stats": scalars}
    ),
    json_values,
)
models = st.one_of(st.just(MODEL), st.just(MODEL), scalars)

_COMMON = {
    "max_tokens": counts,
    "stream": st.one_of(st.booleans(), scalars),
    "stream_options": stream_options,
    "n": small_n,
    "temperature": floats,
    "top_p": floats,
    "top_k": counts,
    "seed": st.one_of(st.integers(), scalars),
    "stop": stops,
    "priority": counts,
    "return_token_ids": scalars,
    "user": st.one_of(texts, scalars),
    "logit_bias": json_values,
    "presence_penalty": floats,
}

chat_bodies = st.fixed_dictionaries(
    {"model": models, "messages": st.one_of(st.lists(messages, max_size=4), json_values)},
    optional={
        **_COMMON,
        "max_completion_tokens": counts,
        "tools": tools,
        "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), json_values),
        "response_format": json_values,
        "logprobs": scalars,
        "top_logprobs": counts,
        "add_generation_prompt": scalars,
        "chat_template_kwargs": json_values,
    },
)
prompts = st.one_of(
    texts,
    st.lists(st.text(max_size=20), max_size=3),
    st.lists(st.integers(-5, 160_000), max_size=20),
    st.lists(st.lists(st.integers(-1, 160_000), max_size=8), max_size=3),
    json_values,
)
completion_bodies = st.fixed_dictionaries(
    {"model": models, "prompt": prompts},
    optional={**_COMMON, "echo": scalars, "logprobs": counts, "suffix": st.one_of(texts, scalars)},
)
passthrough_bodies = st.one_of(
    st.fixed_dictionaries(
        {"model": models}, optional={"prompt": prompts, "input": prompts, "tokens": prompts}
    ),
    st.fixed_dictionaries({"model": models, "messages": st.lists(messages, max_size=2)}),
)

# Anthropic Messages: content blocks of its own types, system, tools, thinking.
anthropic_blocks = st.one_of(
    text_part,
    st.fixed_dictionaries(
        {
            "type": st.just("image"),
            "source": st.one_of(
                st.fixed_dictionaries(
                    {"type": st.just("base64"), "media_type": st.just("image/png"), "data": texts}
                ),
                json_values,
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": st.text(max_size=8),
            "name": st.text(max_size=8),
            "input": json_values,
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": st.text(max_size=8),
            "content": st.one_of(texts, st.lists(text_part, max_size=2), json_values),
        }
    ),
    json_values,
)
anthropic_messages = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["user", "assistant"]), scalars),
        "content": st.one_of(texts, st.lists(anthropic_blocks, max_size=3), json_values),
    }
)
messages_bodies = st.fixed_dictionaries(
    {
        "model": models,
        "max_tokens": counts,
        "messages": st.one_of(st.lists(anthropic_messages, max_size=3), json_values),
    },
    optional={
        "system": st.one_of(texts, st.lists(text_part, max_size=2), json_values),
        "stream": st.one_of(st.booleans(), scalars),
        "temperature": floats,
        "top_p": floats,
        "top_k": counts,
        "stop_sequences": stops,
        "tools": json_values,
        "thinking": st.one_of(
            st.fixed_dictionaries({"type": st.just("enabled"), "budget_tokens": counts}),
            json_values,
        ),
        "metadata": json_values,
    },
)
# OpenAI Responses: input as a string or items, instructions, previous_response_id (an id
# the gateway never saw: its 404).
responses_items = st.one_of(
    st.fixed_dictionaries(
        {
            "role": roles,
            "content": st.one_of(
                texts,
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.just("input_text"), "text": st.one_of(texts, scalars)}
                    ),
                    max_size=2,
                ),
                json_values,
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": st.text(max_size=8),
            "output": st.one_of(texts, json_values),
        }
    ),
    json_values,
)
responses_bodies = st.fixed_dictionaries(
    {
        "model": models,
        "input": st.one_of(texts, st.lists(responses_items, max_size=3), json_values),
    },
    optional={
        "instructions": st.one_of(texts, scalars),
        "max_output_tokens": counts,
        "stream": st.one_of(st.booleans(), scalars),
        "temperature": floats,
        "tools": json_values,
        "previous_response_id": st.one_of(st.text(max_size=12), scalars),
        "store": scalars,
    },
)


def _dumps(body: Any) -> bytes:
    # allow_nan: NaN and Infinity go out as the bare words Python writes (not JSON): a client
    # library may send them, and the gateway must answer 400, not fail.
    return json.dumps(body, allow_nan=True).encode()


def _mutate(body: dict[str, Any], op: str, index: int, key: str, value: Any) -> Any:
    """One field-level mutation of a valid body (``index`` picks the field)."""
    if op == "replace" and body:
        keys = sorted(body)
        return {**body, keys[index % len(keys)]: value}
    if op == "drop" and body:
        drop = sorted(body)[index % len(body)]
        return {k: v for k, v in body.items() if k != drop}
    if op == "add":
        return {**body, key: value}
    return value  # "whole": the body is any JSON value, an array or a number included


def _corrupt(raw: bytes, op: str, at: int, noise: bytes) -> bytes:
    """Bytes-level damage to an encoded body."""
    if not raw:
        return noise
    i = at % len(raw)
    if op == "cut":
        return raw[:i]
    if op == "flip":
        return raw[:i] + bytes([raw[i] ^ (1 << (at % 8))]) + raw[i + 1 :]
    if op == "insert":
        return raw[:i] + noise + raw[i:]
    return noise


def _for_path(path: str) -> st.SearchStrategy[dict[str, Any]]:
    return {
        CHAT: chat_bodies,
        COMPLETIONS: completion_bodies,
        MESSAGES: messages_bodies,
        RESPONSES: responses_bodies,
    }.get(path, passthrough_bodies)


paths = st.sampled_from(
    [CHAT, CHAT, COMPLETIONS, COMPLETIONS, MESSAGES, MESSAGES, RESPONSES, RESPONSES, *PASSTHROUGH]
)
content_types = st.one_of(
    st.just("application/json"),
    st.just("application/json"),
    st.just("application/json"),
    st.sampled_from(["text/plain", "application/json; charset=latin-1", "multipart/form-data", ""]),
)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """One fuzzed request: a schema body, a mutated one, or raw bytes."""
    path = draw(paths)
    kind = draw(st.sampled_from(["schema", "mutated", "bytes"]))
    ctype = draw(content_types)
    body = draw(_for_path(path))
    if kind == "schema":
        return Case(path, _dumps(body), ctype)
    if kind == "mutated":
        op = draw(st.sampled_from(["replace", "drop", "add", "whole"]))
        index, key = draw(st.integers(0, 63)), draw(st.text(max_size=12))
        mutated = _mutate(body, op, index, key, draw(json_values))
        return Case(path, _dumps(mutated), ctype)
    op = draw(st.sampled_from(["cut", "flip", "insert", "noise"]))
    raw = _corrupt(_dumps(body), op, draw(st.integers(0, 2**16)), draw(st.binary(max_size=64)))
    return Case(path, raw, ctype)
