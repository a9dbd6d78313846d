"""The head-of-line report: its settings and policies (pure), and a two-round smoke run.

Timings are the report's business, not the tests': these check what runs where and the
shape of what comes out.
"""

from __future__ import annotations

import json

import pytest

from loadtest import hol_report
from loadtest.hol_report import (
    IDLE,
    SETUPS,
    idle_requests,
    judge,
    lanes_policy,
    lights_done,
    markdown_table,
    round_robin_policy,
    sim_flags,
    sim_settings,
)
from loadtest.runner import request_body
from loadtest.sim.cli import _parser, settings_from_args
from loadtest.stats import OK, PENDING, RequestResult
from loadtest.workload import load_trace
from proxy.policyfile import build_policy
from proxy.routing.explain import explain_request

URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"]


@pytest.mark.parametrize("chunked", [False, True])
def test_sim_flags_start_replicas_with_the_settings_the_report_prints(chunked):
    settings = sim_settings(chunked)
    args = _parser().parse_args(sim_flags(settings))
    started = settings_from_args(args)
    assert started.replace(name="") == settings.replace(name="")
    assert started.enable_chunked_prefill is chunked and started.enable_prefix_caching
    # vLLM's budgets: 2048 tokens a step with chunking, the whole context without.
    assert settings.batched_tokens == (2048 if chunked else 32768)


def test_lanes_policy_sends_only_the_light_requests_to_the_interactive_replica():
    policy = build_policy(lanes_policy(URLS, 8080))
    for row in load_trace(hol_report.TRACE):
        body = request_body(row, model="m", seed=1)
        got = explain_request(policy, body, "chat")
        assert got["lane"]["name"] == ("short" if row.cls == "light" else "long"), row
        want = ["sim0"] if row.cls == "light" else ["sim1", "sim2"]
        assert sorted(c["name"] for c in got["candidates"]) == want


def test_round_robin_policy_spreads_every_request_over_the_whole_fleet():
    policy = build_policy(round_robin_policy(URLS, 8080))
    (pool,) = policy.pools.values()
    assert pool.balance == "round_robin" and [r.url for r in pool.replicas] == URLS
    assert len(policy.lanes) == 1 and policy.lanes[0].when is None


def test_idle_requests_are_the_light_rows_sent_at_once():
    rows = idle_requests(load_trace(hol_report.TRACE))
    assert [(r.cls, r.at_ms, r.max_tokens) for r in rows] == [("light", 0, 32), ("light", 0, 64)]


def result(cls: str, outcome: str = OK) -> RequestResult:
    r = RequestResult(index=0, cls=cls, stream=True, prompt_tokens=1, max_tokens=1, scheduled_s=0)
    r.outcome = outcome
    return r


def test_a_round_may_stop_once_every_light_request_has_ended():
    assert not lights_done([result("heavy", PENDING), result("light"), result("light", PENDING)])
    assert lights_done([result("heavy", PENDING), result("light"), result("light", "timeout")])


def summary(p50: float, p99: float) -> dict:
    return {"ttft_ms": {"p50": p50, "p99": p99, "max": p99}, "slo_met": 1.0, "n": 2, "failed": 0}


def test_judge_holds_lanes_p99_to_one_and_a_half_times_the_idle_median():
    run = {
        "idle": summary(20.0, 30.0),
        "setups": {"single": summary(150.0, 170.0), "lanes": summary(22.0, 30.0)},
    }
    verdict = judge(run)
    assert verdict["ratios"]["single"] == {"p50": 7.5, "p99": 8.5}
    assert verdict["ratios"]["lanes"]["p99"] == 1.5 and verdict["target_met"] is True
    run["setups"]["lanes"] = summary(22.0, 30.2)
    assert judge(run)["target_met"] is False


def test_report_smoke_two_rounds_of_lanes(tmp_path, capsys):
    plot = tmp_path / "hol.png"
    argv = ["--rounds", "2", "--warmup", "0", "--replicas", "2", "--chunked-prefill", "on",
            "--setups", "lanes", "--out", str(tmp_path), "--plot", str(plot)]  # fmt: skip
    assert hol_report.main(argv) == 0

    doc = json.loads((tmp_path / "hol_report.json").read_text())
    assert doc["rounds"] == 2 and doc["replicas"] == 2 and isinstance(doc["runtime_s"], float)
    (run,) = doc["runs"]
    assert run["chunked_prefill"] is True
    assert run["sim_settings"]["enable_chunked_prefill"] is True
    assert run["sim_settings"]["max_num_batched_tokens"] == 2048
    assert set(run["setups"]) == {"lanes"}
    lanes = run["setups"]["lanes"]
    assert lanes["n"] == 4 and lanes["failed"] == 0 and len(lanes["samples_ms"]) == 4
    assert lanes["replicas"] == {"sim0": 4}  # the interactive replica, every time
    for kind in IDLE:
        assert run[kind]["n"] == 2 and run[kind]["failed"] == 0
    assert run["idle_gateway"]["replicas"] == {"sim0": 2}
    assert isinstance(run["verdict"]["target_met"], bool)
    assert all(r["state"] == "healthy" for r in run["gateway_replicas_at_end"]["lanes"])

    printed = capsys.readouterr().out
    assert markdown_table(doc) in printed
    assert SETUPS["lanes"] in printed and "max_num_batched_tokens=2048" in printed
    assert plot.read_bytes().startswith(b"\x89PNG")
