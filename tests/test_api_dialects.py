"""The Messages and Responses APIs as plain data: how their bodies are profiled, how their typed
stream events are read (first content, errors, usage, the stored response's id), the gateway's
own errors in each API's shape, and the map of stored responses to their replicas."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.errors import Dialect, NotFound, Rejected, StreamCut, dialect_of, sse_error_event
from proxy.relay import sse
from proxy.relay.homes import ResponseHomes
from proxy.routing.profile import (
    guess_kind,
    messages_as_chat,
    profile_request,
    responses_as_chat,
)


class Rates:
    image_tokens = 100
    counter = None

    def ratio(self, model: str | None) -> float:
        return 4.0


def profile(body: dict[str, Any], kind: str) -> Any:
    return profile_request(body, kind, Rates(), 256)


# -- profiles ------------------------------------------------------------------------------


def test_a_messages_body_is_profiled_as_the_chat_it_renders_into() -> None:
    body = {
        "model": "m",
        "system": "You are terse.",
        "max_tokens": 64,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a" * 400}]},
            {"role": "assistant", "content": [{"type": "tool_use", "input": {"q": "x" * 40}}]},
            {"role": "user", "content": [{"type": "tool_result", "content": "y" * 80}]},
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]},
        ],
        "stream": True,
    }
    chat = {
        "model": "m",
        "max_tokens": 64,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "a" * 400},
            {"role": "assistant", "content": json.dumps({"q": "x" * 40})},
            {"role": "user", "content": "y" * 80},
            {"role": "user", "content": [{"type": "image"}]},
        ],
        "stream": True,
    }
    got, want = profile(body, "messages"), profile(chat, "chat")
    assert got.kind == "messages"
    assert got.prompt_tokens_est == want.prompt_tokens_est
    assert got.images == 1
    assert got.output_tokens == 64
    assert got.stream is True
    assert got.prompt_head.startswith("system\nYou are terse.\nuser\naaaa")


@pytest.mark.parametrize(
    ("thinking", "output"),
    [(None, 100), ({"type": "enabled", "budget_tokens": 50}, 150), ({"type": "disabled"}, 100)],
)
def test_a_thinking_budget_adds_to_the_output(thinking: Any, output: int) -> None:
    body: dict[str, Any] = {"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
    if thinking is not None:
        body["thinking"] = thinking
    assert messages_as_chat(body)["max_tokens"] == output
    assert profile(body, "messages").output_tokens == output


@pytest.mark.parametrize(
    ("body", "messages"),
    [
        ({"input": "hello"}, [{"role": "user", "content": "hello"}]),
        (
            {"instructions": "be brief", "input": "hello"},
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        ),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "look"}]},
                    {"type": "function_call", "name": "f", "arguments": '{"a":1}'},
                    {"type": "function_call_output", "call_id": "c", "output": "42"},
                    {"type": "item_reference", "id": "x"},
                ]
            },
            [
                {"role": "user", "content": [{"type": "input_text", "text": "look"}]},
                {"role": "assistant", "content": 'f({"a":1})'},
                {"role": "tool", "content": "42"},
            ],
        ),
        ({"previous_response_id": "resp_1"}, []),
    ],
)
def test_a_responses_body_renders_as_chat_messages(body: Any, messages: Any) -> None:
    assert responses_as_chat(body)["messages"] == messages


def test_a_responses_profile_counts_input_tools_and_max_output_tokens() -> None:
    body = {
        "input": "b" * 800,
        "tools": [{"type": "function", "name": "f"}],
        "max_output_tokens": 9,
    }
    got = profile(body, "responses")
    chat = profile(
        {"messages": [{"role": "user", "content": "b" * 800}], "tools": body["tools"]}, "chat"
    )
    assert got.kind == "responses"
    assert got.prompt_tokens_est == chat.prompt_tokens_est
    assert got.output_tokens == 9


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown request kind"):
        profile({}, "embeddings")


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "chat"),
        ({"prompt": "hi"}, "completion"),
        ({"input": "hi"}, "responses"),
        ({"previous_response_id": "resp_1"}, "responses"),
        ({"system": "x", "messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "1"}]}]},
         "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "chat"),
    ],
)  # fmt: skip
def test_the_api_of_a_body_is_guessed_from_its_fields(body: Any, kind: str) -> None:
    assert guess_kind(body) == kind


# -- typed stream events -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "content"),
    [
        ({"type": "message_start", "message": {"usage": {"input_tokens": 3}}}, False),
        ({"type": "content_block_start", "content_block": {"type": "text", "text": ""}}, False),
        ({"type": "ping"}, False),
        ({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}}, True),
        ({"type": "content_block_delta", "delta": {"type": "text_delta", "text": ""}}, False),
        ({"type": "content_block_delta", "delta": {"partial_json": '{"a'}}, True),
        ({"type": "content_block_delta", "delta": {"thinking": "hmm"}}, True),
        ({"type": "content_block_delta", "delta": "oops"}, False),
        ({"type": "response.created", "response": {"id": "resp_1"}}, False),
        ({"type": "response.output_item.added", "item": {"type": "message"}}, False),
        ({"type": "response.output_text.delta", "delta": "Hi"}, True),
        ({"type": "response.output_text.delta", "delta": ""}, False),
        ({"type": "response.function_call_arguments.delta", "delta": "{"}, True),
        ({"type": "response.reasoning_text.delta", "delta": "so"}, True),
        ({"type": "response.completed", "response": {}}, False),
        ({"choices": [{"delta": {"content": "x"}}]}, True),
    ],
)
def test_first_content_is_found_in_typed_events(event: Any, content: bool) -> None:
    assert sse.carries_content(event) is content


@pytest.mark.parametrize(
    ("event", "error", "message"),
    [
        ({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}, True, "busy"),
        ({"type": "error", "code": "x", "message": "engine died"}, True, "engine died"),
        ({"type": "response.failed", "response": {"error": {"message": "bad"}}}, True, "bad"),
        ({"error": {"message": "vllm says no"}}, True, "vllm says no"),
        ({"type": "message_stop"}, False, None),
        ({"type": "content_block_delta", "delta": {"text": "error"}}, False, None),
    ],
)
def test_typed_error_events_are_errors(event: Any, error: bool, message: str | None) -> None:
    assert sse.is_error(event) is error
    if message is not None:
        assert sse.error_message(event) == message


@pytest.mark.parametrize(
    ("obj", "prompt", "completion"),
    [
        ({"usage": {"input_tokens": 5, "output_tokens": 7}}, 5, 7),  # a Messages answer
        ({"type": "message_delta", "usage": {"output_tokens": 7}}, None, 7),
        ({"type": "response.completed", "response": {"usage": {"input_tokens": 2, "output_tokens": 3}}}, 2, 3),
        ({"usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}, 1, 2),
    ],
)  # fmt: skip
def test_usage_is_read_in_chat_words(obj: Any, prompt: int | None, completion: int) -> None:
    usage = sse.usage_of(obj)
    assert usage is not None
    assert usage["prompt_tokens"] == prompt
    assert usage["completion_tokens"] == completion


def test_a_responses_streams_usage_is_found_in_its_last_event() -> None:
    completed = {
        "type": "response.completed",
        "response": {"output": [{"text": "x" * 5000}], "usage": {"input_tokens": 4, "output_tokens": 9}},
    }  # fmt: skip
    stream = (
        b"event: response.output_text.delta\ndata: "
        + json.dumps({"type": "response.output_text.delta", "delta": "x"}).encode()
        + b"\n\nevent: response.completed\ndata: "
        + json.dumps(completed).encode()
        + b"\n\n"
    )
    usage = sse.last_usage(stream)
    assert usage is not None and usage["completion_tokens"] == 9


@pytest.mark.parametrize(
    ("obj", "rid"),
    [
        ({"object": "response", "id": "resp_abc", "status": "completed"}, "resp_abc"),
        ({"type": "response.created", "response": {"id": "resp_def"}}, "resp_def"),
        ({"type": "response.in_progress", "response": {"id": "resp_def"}}, None),
        ({"object": "chat.completion", "id": "chatcmpl-1"}, None),
        ({"object": "response", "id": ""}, None),
        ([], None),
    ],
)
def test_the_stored_responses_id_is_read_where_it_is_created(obj: Any, rid: str | None) -> None:
    assert sse.response_id(obj) == rid


# -- the gateway's own errors, per dialect -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "dialect"),
    [
        ("/v1/messages", Dialect.ANTHROPIC),
        ("/v1/messages/count_tokens", Dialect.ANTHROPIC),
        ("/v1/responses", Dialect.RESPONSES),
        ("/v1/responses/resp_1/cancel", Dialect.RESPONSES),
        ("/v1/chat/completions", Dialect.OPENAI),
        ("/v1/embeddings", Dialect.OPENAI),
    ],
)
def test_each_path_speaks_its_apis_dialect(path: str, dialect: Dialect) -> None:
    assert dialect_of(path) is dialect


@pytest.mark.parametrize(
    ("err", "kind"),
    [
        (Rejected("queue full", status=429, reason="queue_full", retry_after_s=2), "rate_limit_error"),
        (Rejected("no replica", status=503, reason="no_replica", retry_after_s=1), "overloaded_error"),
        (NotFound("nope"), "not_found_error"),
        (StreamCut("cut"), "overloaded_error"),
    ],
)  # fmt: skip
def test_anthropic_clients_get_anthropics_error_shape(err: Any, kind: str) -> None:
    assert err.body(Dialect.ANTHROPIC) == {
        "type": "error",
        "error": {"type": kind, "message": err.message},
    }
    assert err.body()["error"]["message"] == err.message  # OpenAI's shape elsewhere


def test_a_cut_stream_ends_in_its_own_dialect() -> None:
    err = StreamCut("replica r1 closed the connection mid-stream")
    openai = sse_error_event(err)
    assert openai.endswith(b"data: [DONE]\n\n") and openai.startswith(b"data: {")
    anthropic = sse_error_event(err, Dialect.ANTHROPIC)
    assert anthropic.startswith(b"event: error\ndata: ") and b"[DONE]" not in anthropic
    obj = sse.parse_event(anthropic.strip())
    assert sse.is_error(obj) and sse.error_message(obj) == err.message
    responses = sse_error_event(err, Dialect.RESPONSES)
    assert responses.startswith(b"event: error\ndata: ") and b"[DONE]" not in responses
    obj = sse.parse_event(responses.strip())
    assert obj["type"] == "error" and sse.error_message(obj) == err.message


# -- stored responses' homes ---------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_homes_are_bounded_oldest_first() -> None:
    homes = ResponseHomes(max_entries=2)
    homes.remember("a", "http://r1")
    homes.remember("b", "http://r2")
    assert homes.home_of("a") == "http://r1"  # a use makes "a" the newest
    homes.remember("c", "http://r1")
    assert len(homes) == 2
    assert homes.home_of("b") is None
    assert homes.home_of("a") == "http://r1" and homes.home_of("c") == "http://r1"


def test_homes_age_out_unless_used() -> None:
    clock = Clock()
    homes = ResponseHomes(ttl_s=10, clock=clock)
    homes.remember("a", "http://r1")
    homes.remember("b", "http://r2")
    clock.t = 8
    assert homes.home_of("a") == "http://r1"
    clock.t = 15
    assert homes.home_of("a") == "http://r1"  # used at 8: 7 s ago
    assert homes.home_of("b") is None  # 15 s since it was made
    assert len(homes) == 1
