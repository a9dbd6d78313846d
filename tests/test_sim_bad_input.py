"""No request body makes the simulator fail with anything but vLLM's 4xx: a seeded sweep of odd
values through the request parsers and the first output tokens, where any exception other than
``ApiError`` would have been an HTTP 500."""

from __future__ import annotations

import random
from typing import Any

from loadtest.sim import protocol
from loadtest.sim.generate import Output

MODELS = ("m",)
VALUES: list[Any] = [
    None, True, False, 0, 1, -1, 2**70, 10**400, 1.5, float("inf"), float("nan"), "", "x",
    "\ud800", [], [1], [[1]], [""], {}, {"a": 1}, [None], [{"type": "text"}],
    [{"type": "text", "text": 5}], [{"type": "image_url"}], 151_700, [-1], [2**64],
]  # fmt: skip
CHAT_KEYS = [
    "model", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "stop",
    "seed", "priority", "temperature", "top_p", "tools", "add_generation_prompt", "logprobs",
    "top_logprobs", "include_stop_str_in_output", "return_token_ids", "user", "top_k",
]  # fmt: skip
COMPLETION_KEYS = [
    "prompt", "model", "max_tokens", "n", "stream", "stream_options", "stop", "seed", "echo",
    "logprobs", "return_token_ids", "priority",
]  # fmt: skip
MESSAGES: list[Any] = [
    *({"role": "user", "content": v} for v in VALUES),
    *({"role": v, "content": "x"} for v in VALUES),
    *({"role": "assistant", "content": "x", "tool_calls": v} for v in VALUES),
    *VALUES,
]


def _body(rng: random.Random, kind: str) -> dict[str, Any]:
    keys = COMPLETION_KEYS if kind == "completion" else CHAT_KEYS
    body = {k: rng.choice(VALUES) for k in rng.sample(keys, rng.randint(1, 5))}
    if kind in ("chat", "tokenize") and rng.random() < 0.8:
        body["messages"] = [rng.choice(MESSAGES) for _ in range(rng.randint(0, 3))]
    if kind == "completion" and rng.random() < 0.5:
        body["prompt"] = rng.choice(["hi", [1, 2], [[1], [2]], ["a", "b"], "\udfff"])
    if kind == "detokenize":
        body = {"tokens": rng.choice(VALUES), "model": rng.choice(VALUES)}
    return body


def _handle(kind: str, body: dict[str, Any], priority: bool) -> None:
    """What the routes do with a body before the engine: parse, budget, first tokens."""
    if kind == "tokenize":
        protocol.tokenize(body, MODELS, 32_768)
        return
    if kind == "detokenize":
        protocol.detokenize(body, MODELS)
        return
    parse = protocol.parse_chat if kind == "chat" else protocol.parse_completion
    g = parse(body, MODELS, priority_enabled=priority)
    for prompt in g.prompts:
        limit = protocol.effective_max_tokens(len(prompt), g.sampling.max_tokens, 32_768)
        natural = (16, 256) if g.sampling.max_tokens is None else None
        out = Output(1, max_tokens=limit, prompt=prompt, stop=g.sampling.stop,
                     natural_range=natural)  # fmt: skip
        for _ in range(3):
            if out.advance():
                break


def test_odd_bodies_get_api_errors_only() -> None:
    rng = random.Random(1)
    crashes: dict[tuple[str, str], dict[str, Any]] = {}
    for _ in range(4000):
        kind = rng.choice(["chat", "completion", "tokenize", "detokenize"])
        body = _body(rng, kind)
        try:
            _handle(kind, body, rng.random() < 0.5)
        except protocol.ApiError as exc:
            assert 400 <= exc.status < 500
        except Exception as exc:  # any other exception would be a 500
            crashes.setdefault((kind, f"{type(exc).__name__}: {exc}"[:120]), body)
    assert not crashes, crashes
