"""`tokenlane check` names every problem of a file in one run, each where it is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.policyfile import PolicyError, analyse, did_you_mean, parse_yaml

ROOT = Path(__file__).resolve().parent.parent

# Three unknown keys, two wrong types, two unknown pools and a duplicate lane name.
PLANTED = """\
server:
  prot: 8080
pools:
  interactive:
    balence: least_loaded
    replicas: [{url: "http://a:8000", max_in_fligth: 3}]
lanes:
  - name: short
    pool: interactiv
    spill_to: nowhere
    max_queue: lots
    when: {stream: true}
  - name: short
    pool: interactive
health:
  interval_s: soon
"""


def located(text: str, environ: dict[str, str] | None = None) -> list[str]:
    policy, problems = analyse(text, "p.yaml", environ=environ or {})
    assert policy is None
    return [p.located("p.yaml") for p in problems]


def test_every_kind_of_problem_is_named_in_one_run_with_line_and_column() -> None:
    assert sorted(located(PLANTED)) == sorted(
        [
            "p.yaml:2:3: server.prot: unknown key (did you mean `port`?)",
            "p.yaml:5:5: pools.interactive.balence: unknown key (did you mean `balance`?)",
            "p.yaml:6:39: pools.interactive.replicas[0].max_in_fligth: unknown key "
            "(did you mean `max_in_flight`?)",
            "p.yaml:11:16: lanes[0].max_queue: Input should be a valid integer, unable to parse "
            "string as an integer",
            "p.yaml:16:15: health.interval_s: Input should be a valid number, unable to parse "
            "string as a number",
            "p.yaml:9:11: lanes[0].pool: unknown pool 'interactiv'",
            "p.yaml:10:15: lanes[0].spill_to: unknown pool 'nowhere'",
            "p.yaml:13:11: lanes[1].name: duplicate lane name 'short'",
        ]
    )


def test_relations_of_a_well_shaped_file_are_placed_too() -> None:
    text = PLANTED.replace("  prot: 8080\n", "  port: 8080\n")
    text = text.replace("    balence: least_loaded\n", "").replace(", max_in_fligth: 3", "")
    text = text.replace("max_queue: lots", "max_queue: 3").replace("soon", "1")
    text += "  eject_base_s: 60\n  eject_max_s: 30\n"
    assert sorted(located(text)) == sorted(
        [
            "p.yaml:8:11: lanes[0].pool: unknown pool 'interactiv'",
            "p.yaml:9:15: lanes[0].spill_to: unknown pool 'nowhere'",
            "p.yaml:12:11: lanes[1].name: duplicate lane name 'short'",
            "p.yaml:17:16: health.eject_max_s: below health.eject_base_s",
        ]
    )


def test_environment_overrides_are_reported_as_such() -> None:
    text = PLANTED.replace("max_queue: lots", "max_queue: 3")
    found = located(
        text, {"TOKENLANE_LANES__0__MAX_QUEUE": "abc", "TOKENLANE_LANES__9__PRIORITY": "1"}
    )
    assert (
        "TOKENLANE_LANES__0__MAX_QUEUE=abc (environment): lanes[0].max_queue: Input should be a "
        "valid integer, unable to parse string as an integer"
    ) in found
    assert (
        "TOKENLANE_LANES__9__PRIORITY=1 (environment): TOKENLANE_LANES__9__PRIORITY: no such "
        "list item"
    ) in found
    assert not any(p.startswith("p.yaml:") and "max_queue" in p for p in found)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("pools: [1\nlanes: 2\n", "p.yaml:2:6: not valid YAML in p.yaml:"),
        ("pools:\n  a: {b: 1\n", "p.yaml:3:1: not valid YAML in p.yaml:"),
        ("server:\n\tport: 1\n", "p.yaml:2:1: not valid YAML in p.yaml:"),
    ],
)
def test_yaml_syntax_errors_name_the_file_line_and_column(text: str, where: str) -> None:
    (found,) = located(text)
    assert found.startswith(where)
    assert "<unicode string>" not in found


def test_duplicate_keys_are_placed_and_reported_with_the_rest() -> None:
    text = "pools:\n  a: {replicas: [{url: 'http://a:1'}]}\n  a: {replicas: [{url: 'http://b:1'}]}\nlanes: [{name: x, pool: b}]\n"
    assert located(text) == [
        "p.yaml:3:3: pools.a: duplicate key 'a'",
        "p.yaml:4:25: lanes[0].pool: unknown pool 'b'",
    ]


def test_parse_yaml_names_the_file() -> None:
    with pytest.raises(PolicyError) as info:
        parse_yaml("a: [1\n", "mine.yaml")
    assert "mine.yaml" in info.value.problems[0]


@pytest.mark.parametrize(
    ("loc", "hint"),
    [
        (("lanes", 0, "spil_to"), " (did you mean `spill_to`?)"),
        (("pools", "bulk", "replicas", 2, "urll"), " (did you mean `url`?)"),
        (("lanes", 1, "when", "streem"), " (did you mean `stream`?)"),
        (("helth",), " (did you mean `health`?)"),
        (("server", "zzzzzz"), ""),
    ],
)
def test_did_you_mean(loc: tuple[int | str, ...], hint: str) -> None:
    assert did_you_mean(loc) == hint


def test_check_command_prints_every_problem_and_fails(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(PLANTED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLANE_")}
    env["TOKENLANE_SERVER__PORT"] = "high"
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "check", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert lines[0] == f"{path}: 9 problem(s)"
    assert f"  {path}:2:3: server.prot: unknown key (did you mean `port`?)" in lines
    assert any(
        line.startswith("  TOKENLANE_SERVER__PORT=high (environment): server.port:")
        for line in lines
    )
