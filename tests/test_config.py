"""The policy file: shape, relations between sections, precedence, and `tokenlane check`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proxy.policyfile import PolicyError, load_policy, policy_from_text

ROOT = Path(__file__).resolve().parent.parent

GOOD = """
pools:
  interactive:
    replicas: [{url: "http://fast-0:8000"}]
  bulk:
    balance: prefix_affinity
    replicas: [{url: "http://bulk-0:8000"}, {url: "http://bulk-1:8000", name: b1}]
lanes:
  - name: short
    pool: interactive
    when: {stream: true, prompt_tokens_max: 1024, output_tokens_max: 256}
    spill_to: bulk
  - name: long
    pool: bulk
"""


def problems(text: str, **kw: object) -> list[str]:
    with pytest.raises(PolicyError) as info:
        policy_from_text(text, environ={}, **kw)  # type: ignore[arg-type]
    return info.value.problems


def test_good_policy_gets_the_documented_defaults() -> None:
    policy = policy_from_text(GOOD, environ={})
    assert policy.server.port == 8080
    assert policy.server.max_body_bytes == 16 * 1024 * 1024
    assert policy.pools["bulk"].bounded_load == 1.25
    assert policy.pools["interactive"].balance == "least_loaded"
    assert policy.lanes[1].max_queue == 256
    assert policy.retry.max_attempts == 3
    assert policy.health.stall_after_s == 10.0
    assert policy.pools["bulk"].replicas[0].label == "bulk-0:8000"
    assert policy.pools["bulk"].replicas[1].label == "b1"


def test_every_shipped_policy_is_valid() -> None:
    files = sorted((ROOT / "config").glob("*.yaml"))
    assert files
    for path in files:
        load_policy(path, environ={})


def test_unknown_key_is_named_by_path() -> None:
    text = GOOD.replace("spill_to: bulk", "spill_to: bulk\n    spil_to: bulk")
    assert problems(text) == ["lanes[0].spil_to: unknown key"]


def test_unknown_pool_is_named_by_path() -> None:
    text = GOOD.replace("pool: bulk\n", "pool: bluk\n")
    assert problems(text) == ["lanes[1].pool: unknown pool 'bluk'"]


def test_duplicate_lane_names_are_refused() -> None:
    text = GOOD.replace("name: long", "name: short")
    assert any("duplicate lane name 'short'" in p for p in problems(text))


def test_duplicate_pool_keys_are_refused() -> None:
    text = GOOD.replace("  bulk:\n", "  interactive:\n", 1)
    assert any("duplicate key 'interactive'" in p for p in problems(text))


def test_duplicate_replica_names_are_refused() -> None:
    text = GOOD.replace("name: b1", "name: bulk-0:8000")
    assert any("duplicate replica name" in p for p in problems(text))


def test_last_lane_with_when_is_refused() -> None:
    text = GOOD + "    when: {stream: false}\n"
    assert any(p.startswith("lanes[1].when:") for p in problems(text))


def test_spill_to_own_pool_is_refused() -> None:
    text = GOOD.replace("spill_to: bulk", "spill_to: interactive")
    assert problems(text) == ["lanes[0].spill_to: spills to its own pool 'interactive'"]


@pytest.mark.parametrize(
    "url", ["fast-0:8000", "ftp://fast-0", "http://", "http://fast-0:99999", "http://h/v1"]
)
def test_malformed_url_is_refused(url: str) -> None:
    text = GOOD.replace("http://fast-0:8000", url)
    found = problems(text)
    assert len(found) == 1
    assert found[0].startswith("pools.interactive.replicas[0].url: malformed URL")


def test_every_problem_is_listed_at_once() -> None:
    text = GOOD.replace("pool: bulk\n", "pool: bluk\n").replace("spill_to: bulk", "spill_to: x")
    assert len(problems(text)) == 2


def test_wrong_type_is_named_by_path() -> None:
    text = GOOD + "health:\n  interval_s: soon\n"
    found = problems(text)
    assert len(found) == 1 and found[0].startswith("health.interval_s:")


def test_environment_overrides_the_file() -> None:
    text = GOOD + "server:\n  port: 9000\n"
    env = {"TOKENLANE_SERVER__PORT": "9100", "TOKENLANE_HEALTH__STALL_AFTER_S": "2.5"}
    policy = policy_from_text(text, environ=env)
    assert policy.server.port == 9100
    assert policy.health.stall_after_s == 2.5


def test_flag_overrides_the_environment() -> None:
    env = {"TOKENLANE_SERVER__PORT": "9100"}
    policy = policy_from_text(GOOD, environ=env, overrides={"server.port": 9200})
    assert policy.server.port == 9200


def test_environment_reaches_pools_and_lanes_by_name_and_index() -> None:
    env = {
        "TOKENLANE_POOLS__BULK__BOUNDED_LOAD": "2",
        "TOKENLANE_LANES__1__MAX_QUEUE": "7",
    }
    policy = policy_from_text(GOOD, environ=env)
    assert policy.pools["bulk"].bounded_load == 2.0
    assert policy.lanes[1].max_queue == 7


def test_secret_env_vars_are_not_policy_keys() -> None:
    env = {"TOKENLANE_ADMIN_TOKEN": "x", "TOKENLANE_API_KEYS": "a,b"}
    assert policy_from_text(GOOD, environ=env).server.port == 8080


def test_bad_environment_value_is_named() -> None:
    with pytest.raises(PolicyError) as info:
        policy_from_text(GOOD, environ={"TOKENLANE_SERVER__PORT": "eighty"})
    assert info.value.problems[0].startswith("server.port:")


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_check_command_exits_zero_on_a_good_policy(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    result = _check(path)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_check_command_names_every_problem_and_exits_one(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        GOOD.replace("pool: bulk\n", "pool: bluk\n").replace(
            "spill_to: bulk", "spill_to: interactive"
        )
    )
    result = _check(path)
    assert result.returncode == 1
    assert "lanes[1].pool: unknown pool 'bluk'" in result.stderr
    assert "lanes[0].spill_to: spills to its own pool 'interactive'" in result.stderr


def test_check_command_reports_a_missing_file(tmp_path: Path) -> None:
    result = _check(tmp_path / "missing.yaml")
    assert result.returncode == 1
    assert "missing.yaml" in result.stderr


def test_instance_keys_that_would_expire_between_heartbeats_are_refused() -> None:
    # With ttl_s <= heartbeat_s a live instance's load key expires before its next rewrite:
    # the others would see it die and come back every heartbeat, and prune it each time.
    text = GOOD + "redis:\n  heartbeat_s: 10\n  ttl_s: 10\n"
    assert problems(text) == ["redis.ttl_s: must be above redis.heartbeat_s"]
