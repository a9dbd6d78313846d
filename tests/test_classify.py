"""Token estimation, request profiles and lane matching."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import random
from typing import Any

import pytest

from proxy.config import LaneConfig, LaneWhen, Policy
from proxy.policyfile import build_policy
from proxy.routing.balance import rendezvous_order
from proxy.routing.estimate import Estimator
from proxy.routing.explain import explain_request
from proxy.routing.lanes import LaneMatch, NoLaneMatched, _lane_conditions, _lane_holds, match_lane
from proxy.routing.profile import (
    AUDIO_URL_TOKENS,
    CHAT_OVERHEAD_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
    VIDEO_IMAGES,
    Profile,
    affinity_key,
    max_prefix_chars,
    output_tokens_for,
    profile_request,
)

IMAGE_TOKENS = 576


def est(chars_per_token: float = 4.0) -> Estimator:
    return Estimator(chars_per_token, IMAGE_TOKENS)


def chat(body: dict[str, Any], max_prefix_chars: int = 1024) -> Profile:
    return profile_request(body, "chat", est(), max_prefix_chars)


def completion(body: dict[str, Any], max_prefix_chars: int = 1024) -> Profile:
    return profile_request(body, "completion", est(), max_prefix_chars)


def overhead(messages: int) -> int:
    return MESSAGE_OVERHEAD_TOKENS * messages + CHAT_OVERHEAD_TOKENS


# ------------------------------------------------------------------------- chat bodies


def test_profile_chat_string_content_counts_chars_and_template_overhead() -> None:
    p = chat(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "s" * 400},
                {"role": "user", "content": "u" * 401},
            ],
        }
    )
    assert p.kind == "chat"
    assert p.model == "m"
    assert p.prompt_chars == 801
    assert p.prompt_tokens_est == math.ceil(801 / 4) + overhead(2)
    assert p.fixed_tokens == overhead(2)
    assert (p.images, p.n, p.batch, p.stream) == (0, 1, 1, False)


def test_profile_chat_parts_count_text_and_images() -> None:
    p = chat(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in these pictures?"},  # 26 chars
                        {"type": "image_url", "image_url": {"url": "https://x/a.png"}},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        {"type": "text", "text": "Be brief."},  # 9 chars
                    ],
                }
            ]
        }
    )
    assert p.prompt_chars == 35
    assert p.images == 2
    assert p.prompt_tokens_est == math.ceil(35 / 4) + overhead(1) + 2 * IMAGE_TOKENS


def test_profile_chat_tools_are_counted_as_their_json_text() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city, in °C",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    base = {"messages": [{"role": "user", "content": "hi"}]}
    without = chat(base)
    with_tools = chat({**base, "tools": tools})
    tool_chars = len(json.dumps(tools, ensure_ascii=False))
    assert with_tools.prompt_chars == without.prompt_chars + tool_chars
    assert with_tools.prompt_tokens_est == math.ceil((2 + tool_chars) / 4) + overhead(1)


def test_profile_chat_assistant_tool_calls_are_counted() -> None:
    p = chat(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "-3"},
            ]
        }
    )
    assert p.prompt_chars == len("weather?") + len("get_weather") + len('{"city":"Oslo"}') + 2


def test_profile_chat_audio_costs_by_encoded_size_or_a_fixed_window() -> None:
    ten_seconds_b64 = "A" * (160_000 * 4 // 3)  # 160 kB at 16 kB/s
    p = chat(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_audio", "input_audio": {"data": ten_seconds_b64}},
                        {"type": "audio_url", "audio_url": {"url": "https://x/a.mp3"}},
                    ],
                }
            ]
        }
    )
    assert p.audios == 2
    assert p.prompt_tokens_est == overhead(1) + 10 * 25 + AUDIO_URL_TOKENS


def test_profile_chat_video_counts_as_several_images() -> None:
    p = chat({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]})
    assert p.videos == 1
    assert p.prompt_tokens_est == overhead(1) + VIDEO_IMAGES * IMAGE_TOKENS


@pytest.mark.parametrize(
    "messages, chars, counted",
    [
        pytest.param([{"role": "user", "content": None}], 0, 1, id="content None"),
        pytest.param([{"role": "user", "content": 42}], 0, 1, id="content int"),
        pytest.param([{"role": "user", "content": {"text": "x"}}], 0, 1, id="content dict"),
        pytest.param(
            [{"role": "user", "content": [None, 3, "plain", {"type": "text", "text": 5}, {}]}],
            5,
            1,
            id="odd parts",
        ),
        pytest.param(["not a message", None, {"content": "abc"}], 3, 1, id="odd messages"),
        pytest.param(
            [{"role": 7, "content": "ab", "tool_calls": [None, {"function": 1}]}],
            2,
            1,
            id="odd role and tool calls",
        ),
        pytest.param("not a list", 0, 0, id="messages not a list"),
    ],
)
def test_profile_chat_odd_values_count_what_is_countable(
    messages: Any, chars: int, counted: int
) -> None:
    p = chat({"messages": messages, "n": "2", "model": 5})
    assert p.prompt_chars == chars
    assert p.prompt_tokens_est == math.ceil(chars / 4) + overhead(counted)
    assert (p.n, p.model) == (1, None)


def test_profile_chat_tools_that_are_not_json_count_their_text() -> None:
    tools = [{"x": object()}]  # a caller's own object, not parsed JSON: must not raise
    p = chat({"messages": [], "tools": tools})
    assert p.prompt_chars == len(str(tools))


def test_profile_chat_head_renders_roles_and_text_in_order() -> None:
    p = chat(
        {
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]},
            ]
        }
    )
    assert p.prompt_head == "system\nBe terse.\nuser\nHi\n"


def test_profile_chat_head_is_capped_and_shared_by_a_common_system_prompt() -> None:
    system = {"role": "system", "content": "You are a support agent for ACME. " * 50}
    a = chat({"messages": [system, {"role": "user", "content": "order 1"}]}, 512)
    b = chat({"messages": [system, {"role": "user", "content": "refund 2"}]}, 512)
    assert len(a.prompt_head) == 512
    assert a.prompt_head == b.prompt_head
    assert a.prompt_head.startswith("system\nYou are a support agent")


# ------------------------------------------------------------------------- completions


@pytest.mark.parametrize(
    "prompt, chars, exact, batch, head",
    [
        pytest.param("Once upon a time", 16, 0, 1, "Once upon a time", id="string"),
        pytest.param(["abcd", "efghij"], 10, 0, 2, "abcd", id="list of strings"),
        pytest.param([1, 2, 3, 4, 5], 0, 5, 1, "1, 2, 3, 4, 5", id="token ids"),
        pytest.param([[1, 2, 3], [4, 5]], 0, 5, 2, "1, 2, 3", id="list of id lists"),
        pytest.param([], 0, 0, 1, "", id="empty list"),
        pytest.param(None, 0, 0, 1, "", id="missing"),
    ],
)
def test_profile_completion_prompt_shapes(
    prompt: Any, chars: int, exact: int, batch: int, head: str
) -> None:
    p = completion({"model": "m", "prompt": prompt, "max_tokens": 10})
    assert p.kind == "completion"
    assert p.prompt_chars == chars
    assert p.batch == batch
    text_prompts = batch if chars else 0  # each text prompt gets a BOS token
    assert p.prompt_tokens_est == math.ceil(chars / 4) + exact + text_prompts
    assert p.prompt_head == head
    assert p.output_tokens == 10 * batch  # every prompt of a batch generates


def test_profile_completion_ids_head_is_bounded() -> None:
    p = completion({"prompt": list(range(100_000, 110_000))}, max_prefix_chars=256)
    assert p.prompt_tokens_est == 10_000
    assert len(p.prompt_head) == 256
    assert p.prompt_head.startswith("100000, 100001, ")


def test_profile_unknown_kind_raises() -> None:
    with pytest.raises(ValueError, match="unknown request kind 'embedding'"):
        profile_request({}, "embedding", est(), 1024)


# ------------------------------------------------------------------------- output tokens


@pytest.mark.parametrize(
    "fields, expected",
    [
        pytest.param({"max_tokens": 100}, 100, id="max_tokens"),
        pytest.param({"max_completion_tokens": 50, "max_tokens": 100}, 50, id="mct wins"),
        pytest.param({"max_completion_tokens": None, "max_tokens": 100}, 100, id="mct null"),
        pytest.param({"max_tokens": 100, "n": 3}, 300, id="times n"),
        pytest.param({"max_tokens": True}, None, id="bool is not a count"),
        pytest.param({"max_tokens": 0}, 0, id="zero"),
        pytest.param({}, None, id="missing"),
        pytest.param({"n": 4}, None, id="missing with n"),
    ],
)
def test_profile_output_tokens(fields: dict[str, Any], expected: int | None) -> None:
    p = chat({"messages": [{"role": "user", "content": "x"}], **fields})
    assert p.output_tokens == expected


@pytest.mark.parametrize(
    "fields, default, expected",
    [
        pytest.param({"max_tokens": 100}, 500, 100, id="request max wins over default"),
        pytest.param({}, 200, 200, id="default"),
        pytest.param({"n": 3}, 200, 600, id="default times n"),
        pytest.param({}, None, None, id="no max, no default"),
    ],
)
def test_output_tokens_for_uses_lane_default_only_without_request_max(
    fields: dict[str, Any], default: int | None, expected: int | None
) -> None:
    p = chat({"messages": [{"role": "user", "content": "x"}], **fields})
    lane = LaneConfig(name="l", pool="p", default_output_tokens=default)
    assert output_tokens_for(p, lane) == expected


def test_output_tokens_for_completion_batch_multiplies_default() -> None:
    p = completion({"prompt": ["a", "b"], "n": 2})
    lane = LaneConfig(name="l", pool="p", default_output_tokens=10)
    assert output_tokens_for(p, lane) == 40


# ------------------------------------------------------------------------- estimator


def test_estimator_converges_toward_reported_ratio() -> None:
    e = est(4.0)
    for _ in range(100):
        e.observe_usage("qwen", 3000, 1000)  # 3.0 chars per token
    assert abs(e.ratio("qwen") - 3.0) < 0.01
    assert e.ratio("llama") == 4.0  # per model
    p = profile_request({"model": "qwen", "prompt": "x" * 3000}, "completion", e, 64)
    assert p.prompt_tokens_est == 1000 + 1  # learned ratio plus BOS


@pytest.mark.parametrize(
    "chars, tokens, bound",
    [pytest.param(1000, 10_000, 1.5, id="floor"), pytest.param(10_000, 100, 8.0, id="ceiling")],
)
def test_estimator_stays_clamped(chars: int, tokens: int, bound: float) -> None:
    e = est(4.0)
    for _ in range(500):
        e.observe_usage("m", chars, tokens)
    assert e.ratio("m") == pytest.approx(bound, abs=1e-6)
    assert 1.5 <= e.ratio("m") <= 8.0


@pytest.mark.parametrize(
    "chars, tokens, fixed",
    [
        pytest.param(50, 10, 0, id="tiny prompt"),
        pytest.param(1000, 0, 0, id="no tokens"),
        pytest.param(1000, 20, 30, id="all fixed"),
    ],
)
def test_estimator_ignores_unusable_observations(chars: int, tokens: int, fixed: int) -> None:
    e = est(4.0)
    e.observe_usage("m", chars, tokens, fixed)
    assert e.learned() == {}


def test_estimator_observe_subtracts_fixed_tokens_and_skips_media() -> None:
    e = est(4.0)
    body = {"model": "m", "messages": [{"role": "user", "content": "y" * 1200}]}
    p = chat(body)
    for _ in range(200):
        e.observe(p, 400 + p.fixed_tokens)  # the text was 400 tokens: 3 chars per token
    assert e.ratio("m") == pytest.approx(3.0, abs=0.01)
    with_image = chat(
        {"model": "v", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    )
    e.observe(with_image, 5000)
    assert "v" not in e.learned()


def test_estimator_bounds_the_number_of_models() -> None:
    e = Estimator(4.0, IMAGE_TOKENS, max_models=3)
    for i in range(10):
        e.observe_usage(f"m{i}", 1000, 250)
    assert sorted(e.learned(), key=str) == ["m0", "m1", "m2"]


# ------------------------------------------------------------------------- lanes


def profile(**kw: Any) -> Profile:
    fields: dict[str, Any] = {
        "kind": "chat",
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "stream": True,
        "prompt_chars": 0,
        "prompt_tokens_est": 500,
        "output_tokens": 100,
        "n": 1,
        "images": 0,
        "prompt_head": "",
    }
    fields.update(kw)
    return Profile(**fields)


def lanes(when: dict[str, Any], **lane_kw: Any) -> list[LaneConfig]:
    return [
        LaneConfig(name="special", pool="p", when=LaneWhen(**when), **lane_kw),
        LaneConfig(name="rest", pool="p"),
    ]


@pytest.mark.parametrize(
    "when, lane_kw, prof, expected",
    [
        ({"stream": True}, {}, {"stream": True}, "special"),
        ({"stream": True}, {}, {"stream": False}, "rest"),
        ({"stream": False}, {}, {"stream": False}, "special"),
        ({"prompt_tokens_min": 500}, {}, {"prompt_tokens_est": 500}, "special"),
        ({"prompt_tokens_min": 501}, {}, {"prompt_tokens_est": 500}, "rest"),
        ({"prompt_tokens_max": 500}, {}, {"prompt_tokens_est": 500}, "special"),
        ({"prompt_tokens_max": 499}, {}, {"prompt_tokens_est": 500}, "rest"),
        ({"output_tokens_max": 100}, {}, {"output_tokens": 100}, "special"),
        ({"output_tokens_max": 99}, {}, {"output_tokens": 100}, "rest"),
        ({"output_tokens_max": 256}, {}, {"output_tokens": None}, "rest"),
        (
            {"output_tokens_max": 256},
            {"default_output_tokens": 128},
            {"output_tokens": None},
            "special",
        ),
        (
            {"output_tokens_max": 256},
            {"default_output_tokens": 128},
            {"output_tokens": None, "n": 3},
            "rest",
        ),
        ({"model": "Qwen/*"}, {}, {}, "special"),
        ({"model": "Qwen/Qwen2.5-0.5B-Instruct"}, {}, {}, "special"),
        ({"model": "qwen/*"}, {}, {}, "rest"),  # model ids are case-sensitive
        ({"model": "*-7B-*"}, {}, {}, "rest"),
        ({"model": "Qwen/Qwen2.5-?.5B-*"}, {}, {}, "special"),
        ({"model": "*"}, {}, {"model": None}, "rest"),  # no model named: a glob cannot hold
        ({"stream": True, "prompt_tokens_max": 1024, "output_tokens_max": 256}, {}, {}, "special"),
        ({"stream": True, "prompt_tokens_max": 1024, "model": "llama*"}, {}, {}, "rest"),
    ],
)
def test_match_lane_each_when_key(
    when: dict[str, Any], lane_kw: dict[str, Any], prof: dict[str, Any], expected: str
) -> None:
    got = match_lane(profile(**prof), lanes(when, **lane_kw))
    assert got.lane.name == expected
    assert got.index == (0 if expected == "special" else 1)
    assert got.reasons == []  # the hot path builds no strings


def test_match_lane_first_matching_lane_wins() -> None:
    ls = [
        LaneConfig(name="a", pool="p", when=LaneWhen(stream=False)),
        LaneConfig(name="b", pool="p", when=LaneWhen(prompt_tokens_max=1000)),
        LaneConfig(name="c", pool="p", when=LaneWhen(stream=True)),
        LaneConfig(name="rest", pool="p"),
    ]
    assert match_lane(profile(), ls).lane.name == "b"


def test_match_lane_without_catch_all_raises() -> None:
    with pytest.raises(NoLaneMatched):
        match_lane(
            profile(stream=False), [LaneConfig(name="a", pool="p", when=LaneWhen(stream=True))]
        )


def test_match_lane_explain_says_why_lanes_were_skipped_and_chosen() -> None:
    ls = [
        LaneConfig(
            name="short",
            pool="p",
            when=LaneWhen(stream=True, prompt_tokens_max=1024, output_tokens_max=256),
        ),
        LaneConfig(name="qwen", pool="p", when=LaneWhen(model="Qwen/*", prompt_tokens_min=100)),
        LaneConfig(name="rest", pool="p"),
    ]
    got = match_lane(
        profile(stream=False, prompt_tokens_est=2000, output_tokens=None), ls, explain=True
    )
    assert got.lane.name == "qwen"
    assert got.reasons == [
        "lanes[0] 'short' skipped: stream=false, lane wants stream=true",
        "lanes[0] 'short' skipped: prompt_tokens_est 2000 > prompt_tokens_max 1024",
        "lanes[0] 'short' skipped: no max tokens in the request and no default_output_tokens: "
        "never matches output_tokens_max",
        "lanes[1] 'qwen' chosen: prompt_tokens_est 2000 >= prompt_tokens_min 100",
        "lanes[1] 'qwen' chosen: model 'Qwen/Qwen2.5-0.5B-Instruct' matches 'Qwen/*'",
    ]
    rest = match_lane(profile(stream=False, model=None, prompt_tokens_est=10), ls, explain=True)
    assert rest.lane.name == "rest"
    assert rest.reasons[-2:] == [
        "lanes[1] 'qwen' skipped: request names no model; lane wants 'Qwen/*'",
        "lanes[2] 'rest' chosen: no `when`: takes every request left",
    ]


def test_lane_holds_agrees_with_explained_conditions() -> None:
    """The hot-path check and the explain path are two spellings of one rule."""
    rng = random.Random(5)
    for _ in range(3000):
        when = LaneWhen(
            stream=rng.choice([None, True, False]),
            prompt_tokens_min=rng.choice([None, 0, 100, 1000]),
            prompt_tokens_max=rng.choice([None, 0, 100, 1000, 5000]),
            output_tokens_max=rng.choice([None, 0, 64, 256]),
            model=rng.choice([None, "*", "Qwen/*", "llama*", "?"]),
        )
        lane = LaneConfig(
            name="l", pool="p", when=when, default_output_tokens=rng.choice([None, 32, 512])
        )
        p = profile(
            stream=rng.random() < 0.5,
            prompt_tokens_est=rng.choice([0, 50, 100, 999, 1000, 1001, 6000]),
            output_tokens=rng.choice([None, 0, 64, 65, 300]),
            n=rng.choice([1, 2]),
            model=rng.choice([None, "Qwen/Q", "llama-3", "x"]),
        )
        conditions = _lane_conditions(lane, p)
        assert _lane_holds(lane, p) == all(held for held, _ in conditions), (when, p)


# ------------------------------------------------------------------------- explain


def policy() -> Policy:
    return build_policy(
        {
            "pools": {
                "fast": {"replicas": [{"url": "http://fast-0:8000", "name": "fast-0"}]},
                "bulk": {
                    "balance": "prefix_affinity",
                    "prefix_chars": 256,
                    "replicas": [{"url": f"http://bulk-{i}:8000"} for i in range(3)],
                },
            },
            "lanes": [
                {
                    "name": "short",
                    "pool": "fast",
                    "when": {"stream": True, "prompt_tokens_max": 1024, "output_tokens_max": 256},
                    "spill_to": "bulk",
                },
                {"name": "long", "pool": "bulk"},
            ],
        }
    )


def test_explain_request_prints_profile_lane_reasons_and_candidates() -> None:
    pol = policy()
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": 64,
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    }
    out = explain_request(pol, body, "chat")
    json.dumps(out)  # printable as JSON
    assert out["profile"]["prompt_tokens_est"] == math.ceil(11 / 4) + overhead(2)
    assert out["profile"]["prompt_head"] == "system\nBe terse.\nuser\nHi\n"
    assert out["lane"] == {
        "index": 0,
        "name": "short",
        "pool": "fast",
        "spill_to": "bulk",
        "output_tokens": 64,
    }
    assert out["reasons"][0] == "lanes[0] 'short' chosen: stream=true matches"
    assert next((c["pool"], c["role"], c["name"]) for c in out["candidates"]) == (
        "fast",
        "pool",
        "fast-0",
    )
    spill = [c["name"] for c in out["candidates"] if c["role"] == "spill_to"]
    key = affinity_key(chat(body), 256)
    assert key is not None
    assert spill == rendezvous_order(key, [f"bulk-{i}:8000" for i in range(3)])


def test_explain_request_chars_per_token_override_changes_the_lane() -> None:
    pol = policy()
    body = {"stream": True, "max_tokens": 8, "prompt": "z" * 3000}
    assert explain_request(pol, body, "completion")["lane"]["name"] == "short"  # 751 tokens
    slow = explain_request(pol, body, "completion", chars_per_token=2.0)  # 1501 tokens
    assert slow["lane"]["name"] == "long"
    assert slow["chars_per_token"] == 2.0
    assert {c["pool"] for c in slow["candidates"]} == {"bulk"}


def test_max_prefix_chars_and_affinity_key() -> None:
    assert max_prefix_chars(policy()) == 1024  # fast keeps the default
    p = chat({"messages": [{"role": "system", "content": "a" * 2000}]})
    assert affinity_key(p, 256) == p.prompt_head[:256]
    assert affinity_key(p, 5000) == p.prompt_head
    assert affinity_key(chat({"messages": []}), 256) is None


PROFILE_FIELDS: dict[str, Any] = {
    "kind": "chat", "model": "m", "stream": True, "prompt_chars": 11, "prompt_tokens_est": 12,
    "output_tokens": 13, "n": 14, "images": 15, "prompt_head": "h", "batch": 16, "audios": 17,
    "videos": 18, "fixed_tokens": 19,
}  # fmt: skip
LANE_MATCH_FIELDS: dict[str, Any] = {"lane": LaneConfig(name="l", pool="p"), "index": 3,
                                     "reasons": ["r"]}  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "values"), [(Profile, PROFILE_FIELDS), (LaneMatch, LANE_MATCH_FIELDS)]
)
def test_a_written_out_init_sets_every_field_of_the_dataclass(
    cls: type, values: dict[str, Any]
) -> None:
    """``Profile`` and ``LaneMatch`` write their ``__init__`` out (compiled, the generated one
    stays interpreted): it takes and sets every field, with the field's default."""
    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in params] == [f.name for f in fields]
    for param, field in zip(params, fields, strict=True):
        assert param.default == (
            inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        )
    made = cls(**values)
    assert {f.name: getattr(made, f.name) for f in fields} == values
