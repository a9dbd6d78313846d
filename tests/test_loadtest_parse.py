"""Traces, scenarios and the arrival schedule of the load-test runner: pure, no sockets."""

from __future__ import annotations

import itertools
import json
import random
import statistics
from pathlib import Path

import pytest

from loadtest import runner, workload
from loadtest.runner import request_body
from loadtest.workload import (
    Dist,
    TraceError,
    load_scenario,
    load_trace,
    parse_scenario,
    parse_trace,
    poisson_arrivals,
    scenario_requests,
)

ROOT = Path(__file__).resolve().parents[1]


def row(**over):
    base = {"at_ms": 0, "class": "light", "prompt_tokens": 128, "max_tokens": 32}
    base.update(over)
    return base


def test_trace_rows_parse_with_defaults_and_sorted_by_arrival():
    reqs = parse_trace([row(at_ms=20, **{"class": "b"}), row(at_ms=5, stream=False, priority=2)])
    assert [r.at_ms for r in reqs] == [5, 20]
    assert reqs[0].stream is False and reqs[0].priority == 2
    assert reqs[1].cls == "b" and reqs[1].stream is True and reqs[1].prefix_tokens == 0


def test_trace_errors_name_every_row_and_field():
    with pytest.raises(TraceError) as err:
        parse_trace(
            [
                row(),
                {"at_ms": 0, "class": "x", "prompt_tokens": 10},  # no max_tokens
                row(prefix_tokens=500),
                row(stream="yes", max_tokns=3),
                row(prompt_tokens=True),
            ],
            "t.yaml",
        )
    text = str(err.value)
    assert text.startswith("t.yaml:")
    assert "[1].max_tokens: required" in text
    assert "[2].prefix_tokens: 500 is more than prompt_tokens (128)" in text
    assert "[3].stream: must be true or false" in text
    assert "[3].max_tokns: unknown key" in text
    assert "[4].prompt_tokens: must be an integer" in text
    assert len(err.value.problems) == 5


def test_trace_that_is_not_a_list_is_refused():
    with pytest.raises(TraceError, match="a trace is a list"):
        parse_trace({"at_ms": 0})
    with pytest.raises(TraceError, match="no requests"):
        parse_trace([])


def test_jsonl_trace_errors_name_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "# a comment\n" + json.dumps(row()) + "\n\n" + json.dumps(row(at_ms=-1)) + "\n{oops\n"
    )
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert "line 5: not JSON" in str(err.value)
    path.write_text("# a comment\n" + json.dumps(row()) + "\n\n" + json.dumps(row(at_ms=-1)) + "\n")
    with pytest.raises(TraceError, match=r"line 4\.at_ms: must be at least 0"):
        load_trace(path)


def test_jsonl_and_yaml_traces_load_the_same(tmp_path):
    rows = [row(at_ms=0), row(at_ms=10, stream=False, ttft_slo_ms=97)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "t.yaml").write_text(json.dumps(rows))  # JSON is YAML
    assert load_trace(tmp_path / "t.jsonl") == load_trace(tmp_path / "t.yaml")


def test_missing_trace_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.yaml")


def test_hol_trace_matches_issue_37308():
    reqs = load_trace(ROOT / "loadtest/traces/hol_37308.yaml")
    heavy = [r for r in reqs if r.cls == "heavy"]
    light = [r for r in reqs if r.cls == "light"]
    assert [(r.prompt_tokens, r.max_tokens, r.stream) for r in heavy] == [
        (2048, 256, True),
        (2048, 128, False),
        (2048, 512, True),
        (2048, 128, True),
    ]
    assert [(r.prompt_tokens, r.max_tokens, r.stream) for r in light] == [
        (128, 32, True),
        (128, 64, True),
    ]
    assert {r.prefix_tokens for r in reqs} == {32}
    assert max(r.at_ms for r in reqs) - min(r.at_ms for r in reqs) <= 40


SCENARIO = {
    "rate": 50,
    "duration_s": 20,
    "seed": 7,
    "mix": [
        {
            "class": "chat",
            "weight": 3,
            "prompt_tokens": {"dist": "lognormal", "median": 200, "sigma": 0.5, "max": 1000},
            "max_tokens": {"dist": "uniform", "min": 16, "max": 64},
            "prefix_tokens": 100,
            "ttft_slo_ms": 250,
        },
        {
            "class": "batch",
            "weight": 1,
            "prompt_tokens": {"dist": "normal", "mean": 2000, "std": 300, "min": 1000},
            "max_tokens": 128,
            "stream": False,
        },
    ],
}


def test_scenario_parses_classes_and_distributions():
    sc = parse_scenario(SCENARIO)
    assert (sc.rate, sc.duration_s, sc.seed) == (50, 20, 7)
    chat, batch = sc.mix
    assert chat.prompt_tokens == Dist("lognormal", {"median": 200, "sigma": 0.5, "max": 1000})
    assert chat.ttft_slo_ms == 250 and chat.stream is True
    assert batch.max_tokens == Dist("fixed", {"value": 128}) and batch.stream is False


def test_scenario_errors_name_their_path():
    bad = {
        "rate": 0,
        "mix": [
            {"class": "a", "prompt_tokens": {"dist": "zipf"}, "max_tokens": 10},
            {
                "class": "a",
                "prompt_tokens": {"dist": "uniform", "min": 50, "max": 10},
                "max_tokens": {"dist": "normal", "mean": 5},
                "weight": -1,
            },
        ],
        "durationn_s": 3,
    }
    with pytest.raises(TraceError) as err:
        parse_scenario(bad, "s.yaml")
    problems = err.value.problems
    assert (
        "durationn_s: unknown key (expected one of duration_s, mix, model, rate, seed)" in problems
    )
    assert "duration_s: required" in problems
    assert "rate: must be greater than 0, got 0" in problems
    assert (
        "mix[0].prompt_tokens.dist: must be one of lognormal, normal, uniform, got 'zipf'"
        in problems
    )
    assert "mix[1].prompt_tokens: min (50) is more than max (10)" in problems
    assert "mix[1].max_tokens.std: required" in problems
    assert "mix[1].weight: must be greater than 0, got -1" in problems


def test_scenario_duplicate_class_is_refused():
    bad = {**SCENARIO, "mix": [SCENARIO["mix"][0], SCENARIO["mix"][0]]}
    with pytest.raises(TraceError, match=r"mix\[1\]\.class: duplicate class 'chat'"):
        parse_scenario(bad)


def test_example_scenario_file_is_valid():
    sc = load_scenario(ROOT / "loadtest/scenarios/mixed.yaml")
    assert {c.name for c in sc.mix} == {"chat", "document", "batch"}


def test_poisson_arrivals_mean_rate_and_exponential_gaps():
    times = poisson_arrivals(200.0, 100.0, random.Random(1))
    assert all(0 <= t < 100.0 for t in times) and times == sorted(times)
    # 20 000 expected arrivals: the count's standard deviation is ~141 (0.7 %).
    assert abs(len(times) / 100.0 - 200.0) < 200.0 * 0.03
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Exponential: standard deviation equals the mean.
    assert statistics.mean(gaps) == pytest.approx(1 / 200, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / 200, rel=0.05)


def test_poisson_arrivals_are_deterministic_by_seed():
    a = poisson_arrivals(10, 10, random.Random(3))
    assert a == poisson_arrivals(10, 10, random.Random(3))
    assert a != poisson_arrivals(10, 10, random.Random(4))


def test_scenario_requests_follow_weights_and_bounds_and_seed():
    sc = parse_scenario(SCENARIO)
    reqs = scenario_requests(sc)
    assert reqs == scenario_requests(sc)
    assert abs(len(reqs) - 1000) < 100
    chat = [r for r in reqs if r.cls == "chat"]
    batch = [r for r in reqs if r.cls == "batch"]
    assert len(chat) / len(reqs) == pytest.approx(0.75, abs=0.05)
    assert all(16 <= r.max_tokens <= 64 and r.prompt_tokens <= 1000 for r in chat)
    assert all(r.prefix_tokens == min(100, r.prompt_tokens) for r in chat)
    assert all(r.ttft_slo_ms == 250 and r.stream for r in chat)
    assert all(r.prompt_tokens >= 1000 and r.max_tokens == 128 and not r.stream for r in batch)
    assert statistics.median(r.prompt_tokens for r in chat) == pytest.approx(200, rel=0.1)


def test_scenario_arrivals_do_not_move_when_the_mix_changes():
    sc = parse_scenario(SCENARIO)
    other = parse_scenario({**SCENARIO, "mix": SCENARIO["mix"][:1]})
    assert [r.at_ms for r in scenario_requests(sc)] == [r.at_ms for r in scenario_requests(other)]


def test_request_body_asks_for_usage_on_streams_only():
    stream, plain = parse_trace([row(), row(stream=False, priority=-1)])
    body = request_body(stream, model="m", seed=1)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m" and body["max_tokens"] == 32
    assert body["messages"][0]["role"] == "user"
    body = request_body(plain, model="m", seed=1, api="completions")
    assert "stream_options" not in body and body["stream"] is False
    assert isinstance(body["prompt"], str) and body["priority"] == -1


def test_runner_still_exports_the_workload_names_it_used_to_define():
    # Callers import these from loadtest.runner; the split must not break them.
    for name in workload.__all__:
        assert getattr(runner, name) is getattr(workload, name)
    for name in ("run_trace", "run_scenario", "main", "write_results", "request_body"):
        assert callable(getattr(runner, name))
