"""The simulator speaks what token-exact continuation needs, over real sockets:
``return_token_ids`` in vLLM's places, token-id prompts, byte-fallback ids (a character spanning
several ids, no text until it completes), and output that is a function of the token context, so
a stream continued on another replica from prompt + generated ids equals the unfaulted run."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loadtest.sim import tokenizer
from loadtest.sim.generate import Output
from loadtest.sim.server import run_sim
from loadtest.sim.settings import SimSettings

from .gateway import data_events

SETTINGS = SimSettings(step_fixed_s=0.001, decode_per_seq_s=0.0, prefill_per_token_s=0.0,
                       request_overhead_s=0.0)  # fmt: skip
MESSAGES = [{"role": "user", "content": "Tell me a story about the sea."}]


async def _stream(client: httpx.AsyncClient, url: str, path: str, body: dict) -> list[Any]:
    resp = await client.post(url + path, json={**body, "stream": True})
    assert resp.status_code == 200, resp.text
    return data_events(resp.text)


def _run(out: Output) -> Output:
    while not out.advance():
        pass
    return out


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=30) as c:
        yield c


@pytest.fixture
async def two():
    async with run_sim(SETTINGS, name="a") as a, run_sim(SETTINGS, name="b") as b:
        yield a, b


async def test_chat_stream_returns_prompt_ids_on_the_role_chunk_and_ids_per_chunk(two, client):
    a, _ = two
    prompt = (await client.post(a.url + "/tokenize", json={"messages": MESSAGES})).json()
    events = await _stream(
        client, a.url, "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 30, "return_token_ids": True},
    )  # fmt: skip
    role, *chunks, done = events
    assert done == "[DONE]"
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert role["prompt_token_ids"] == prompt["tokens"]
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in chunks)
    assert all("prompt_token_ids" not in c for c in chunks)
    ids = [c["choices"][0]["token_ids"][0] for c in chunks]
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert len(ids) == 30 and tokenizer.decode(ids) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # Without the flag the fields stay null, as the fixtures show.
    plain = await _stream(client, a.url, "/v1/chat/completions",
                          {"messages": MESSAGES, "max_tokens": 3})  # fmt: skip
    assert plain[0]["prompt_token_ids"] is None
    assert plain[1]["choices"][0]["token_ids"] is None


async def test_completion_stream_and_plain_responses_carry_ids_where_vllm_puts_them(two, client):
    a, _ = two
    body = {"prompt": "Once upon a time", "max_tokens": 8, "return_token_ids": True}
    events = await _stream(client, a.url, "/v1/completions", body)
    first, *rest = [e for e in events if e != "[DONE]"]
    assert first["choices"][0]["prompt_token_ids"] == tokenizer.encode("Once upon a time")
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in rest)
    streamed = [i for e in [first, *rest] for i in e["choices"][0]["token_ids"]]
    plain = (await client.post(a.url + "/v1/completions", json=body)).json()["choices"][0]
    assert plain["prompt_token_ids"] == first["choices"][0]["prompt_token_ids"]
    assert plain["token_ids"] == streamed
    chat = (
        await client.post(
            a.url + "/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 5, "return_token_ids": True},
        )
    ).json()
    assert chat["prompt_token_ids"][:1] == [tokenizer.SPECIAL_TOKENS["<|im_start|>"]]
    assert (
        tokenizer.decode(chat["choices"][0]["token_ids"])
        == chat["choices"][0]["message"]["content"]
    )


@pytest.mark.parametrize("cut", [0, 1, 17, 40, 59])
async def test_a_stream_continued_on_another_replica_from_its_ids_equals_the_unfaulted_run(
    two, client, cut
):
    a, b = two
    events = await _stream(
        client, a.url, "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 60, "return_token_ids": True, "temperature": 0},
    )  # fmt: skip
    prompt = events[0]["prompt_token_ids"]
    chunks = [e for e in events[1:] if e != "[DONE]"]
    ids = [c["choices"][0]["token_ids"][0] for c in chunks]
    texts = [c["choices"][0]["delta"]["content"] for c in chunks]
    rest = await _stream(
        client, b.url, "/v1/completions",
        {"prompt": prompt + ids[:cut], "max_tokens": 60 - cut, "return_token_ids": True,
         "temperature": 0},
    )  # fmt: skip
    rest = [e for e in rest if e != "[DONE]"]
    assert [i for e in rest for i in e["choices"][0]["token_ids"]] == ids[cut:]
    assert "".join(e["choices"][0]["text"] for e in rest) == "".join(texts[cut:])
    assert rest[-1]["choices"][0]["finish_reason"] == "length"


async def test_an_answer_without_max_tokens_ends_at_the_same_token_when_continued(two, client):
    a, b = two
    events = await _stream(client, a.url, "/v1/chat/completions",
                           {"messages": MESSAGES, "return_token_ids": True})  # fmt: skip
    prompt = events[0]["prompt_token_ids"]
    chunks = [e for e in events[1:] if e != "[DONE]"]
    ids = [i for c in chunks for i in c["choices"][0]["token_ids"]]
    assert ids[-1] == tokenizer.EOS_ID and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    cut = len(ids) // 2
    # max_tokens null on completions lifts the limit (absent, it would be 16).
    rest = await _stream(
        client, b.url, "/v1/completions",
        {"prompt": prompt + ids[:cut], "max_tokens": None, "return_token_ids": True},
    )  # fmt: skip
    rest = [e for e in rest if e != "[DONE]"]
    assert [i for e in rest for i in e["choices"][0]["token_ids"]] == ids[cut:]
    assert rest[-1]["choices"][0]["finish_reason"] == "stop"


def _emoji_prompt() -> tuple[list[dict], int]:
    """A conversation whose answer has an emoji within its first 60 tokens, and its first
    byte's position."""
    for i in range(200):
        messages = [{"role": "user", "content": f"Question number {i}?"}]
        prompt = tokenizer.chat_prompt_ids(messages)
        seed = hash((SETTINGS.seed, 0, 0)) & 0xFFFF_FFFF_FFFF  # app.py's seed for choice 0
        out = _run(Output(seed, max_tokens=60, prompt=prompt))
        for j, token in enumerate(out.ids[:-4]):
            if token < tokenizer.NUM_BYTE_IDS:
                return messages, j
    raise AssertionError("no emoji in 200 answers")


async def test_an_emoji_spans_four_ids_and_a_seam_inside_it_regenerates_it(two, client):
    a, b = two
    messages, j = _emoji_prompt()
    events = await _stream(
        client,
        a.url,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 60, "return_token_ids": True},
    )
    prompt = events[0]["prompt_token_ids"]
    chunks = [e for e in events[1:] if e != "[DONE]"]
    ids = [c["choices"][0]["token_ids"][0] for c in chunks]
    texts = [c["choices"][0]["delta"]["content"] for c in chunks]
    assert ids[j : j + 4] == [0xF0, 0x9F, 0x98, ids[j + 3]]
    assert texts[j : j + 3] == ["", "", ""] and len(texts[j + 3].encode()) == 4
    full = "".join(texts)
    assert "\ufffd" not in full and tokenizer.encode(full) == ids
    # A cut inside the emoji: the gateway replays the ids up to the last one that produced text
    # (j - 1); the dropped byte ids are generated again.
    seam = j
    rest = await _stream(
        client, b.url, "/v1/completions",
        {"prompt": prompt + ids[:seam], "max_tokens": 60 - seam, "return_token_ids": True},
    )  # fmt: skip
    rest = [e for e in rest if e != "[DONE]"]
    assert "".join(texts[:seam]) + "".join(e["choices"][0]["text"] for e in rest) == full
    # A seam right inside it also goes on with the same bytes.
    inside = await _stream(
        client, b.url, "/v1/completions",
        {"prompt": prompt + ids[: j + 2], "max_tokens": 60 - j - 2, "return_token_ids": True},
    )  # fmt: skip
    inside = [e for e in inside if e != "[DONE]"]
    assert [i for e in inside for i in e["choices"][0]["token_ids"]] == ids[j + 2 :]


def test_output_is_a_function_of_the_token_context() -> None:
    prompt = tokenizer.chat_prompt_ids(MESSAGES)
    full = _run(Output(7, max_tokens=300, prompt=prompt))
    for g in range(0, 300, 13):
        cont = _run(Output(7, max_tokens=300 - g, prompt=prompt + full.ids[:g]))
        assert cont.ids == full.ids[g:]
    other = _run(Output(7, max_tokens=300, prompt=tokenizer.chat_prompt_ids(
        [{"role": "user", "content": "Something else entirely."}])))  # fmt: skip
    assert other.ids != full.ids
    assert _run(Output(8, max_tokens=300, prompt=prompt)).ids != full.ids  # the seed counts


async def test_render_routes_give_the_prompt_ids_and_budget_generation_would_use(two, client):
    a, _ = two
    chat = {"messages": MESSAGES, "max_tokens": 9, "stream": True, "temperature": 0}
    rendered = (await client.post(a.url + "/v1/chat/completions/render", json=chat)).json()
    events = await _stream(client, a.url, "/v1/chat/completions",
                           {**chat, "return_token_ids": True})  # fmt: skip
    assert rendered["token_ids"] == events[0]["prompt_token_ids"]
    assert rendered["request_id"].startswith("chatcmpl-")
    assert rendered["sampling_params"]["max_tokens"] == 9
    assert rendered["sampling_params"]["temperature"] == 0
    assert (rendered["stream"], rendered["features"], rendered["priority"]) == (True, None, 0)
    assert set(rendered) == {
        "request_id", "token_ids", "features", "sampling_params", "model", "stream",
        "stream_options", "cache_salt", "priority", "kv_transfer_params",
    }  # fmt: skip
    items = (
        await client.post(a.url + "/v1/completions/render",
                          json={"prompt": [[5, 6, 7], [8]], "max_tokens": None})
    ).json()  # fmt: skip
    assert [i["token_ids"] for i in items] == [[5, 6, 7], [8]]
    assert items[0]["sampling_params"]["max_tokens"] == SETTINGS.max_model_len - 3
    text = (await client.post(a.url + "/v1/completions/render", json={"prompt": "Hi there"})).json()
    assert text[0]["token_ids"] == tokenizer.encode("Hi there")
    assert text[0]["sampling_params"]["max_tokens"] == 16
    too_long = await client.post(
        a.url + "/v1/completions/render",
        json={"prompt": [1] * 10, "max_tokens": SETTINGS.max_model_len},
    )
    assert too_long.status_code == 400
    assert "maximum context length" in too_long.json()["error"]["message"]
