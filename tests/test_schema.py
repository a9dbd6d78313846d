"""The policy's JSON Schema and key table: generated from the models' Field descriptions, the
committed copies up to date, and every example policy pointing editors at the schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from proxy.config import Policy
from proxy.schema import (
    DOCS_BEGIN,
    DOCS_END,
    policy_keys,
    policy_markdown,
    policy_schema,
    with_key_table,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = [*sorted((ROOT / "config").glob("*.yaml")), ROOT / "proxy/policy.demo.yaml"]


def test_committed_schema_is_up_to_date() -> None:
    committed = json.loads((ROOT / "config/policy.schema.json").read_text())
    assert committed == policy_schema(), "run: tokenlane schema > config/policy.schema.json"


def test_committed_key_table_is_up_to_date() -> None:
    committed = (ROOT / "docs/policy.md").read_text()
    assert policy_markdown() in committed, "run: tokenlane schema --write-docs docs/policy.md"
    assert with_key_table(committed) == committed


def test_write_docs_replaces_only_the_table(tmp_path: Path) -> None:
    doc = tmp_path / "policy.md"
    doc.write_text(f"# Prose\n\n{DOCS_BEGIN}\n| stale |\n{DOCS_END}\n\nMore prose.\n")
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "schema", "--write-docs", str(doc)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert doc.read_text() == f"# Prose\n\n{policy_markdown()}\nMore prose.\n"
    doc.write_text("no markers\n")
    assert (
        subprocess.run(
            [sys.executable, "-m", "proxy", "schema", "--write-docs", str(doc)], cwd=ROOT
        ).returncode
        == 1
    )


def test_tokenlane_schema_prints_the_schema() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "schema"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == policy_schema()


def test_every_key_has_a_description_and_units_reach_schema_and_docs() -> None:
    rows = policy_keys()
    assert len(rows) > 40
    assert [r[0] for r in rows if not r[4]] == []
    by_path = {r[0]: r for r in rows}
    assert by_path["lanes[].queue_timeout_s"][2] == "s"
    assert by_path["pools.<name>.replicas[].max_in_flight"][3] == "256"
    schema = policy_schema()
    lane = schema["$defs"]["LaneConfig"]["properties"]["queue_timeout_s"]
    assert lane["x-unit"] == "s" and lane["default"] == 10.0
    assert lane["description"] == by_path["lanes[].queue_timeout_s"][4]
    assert "| `lanes[].queue_timeout_s` | float | s | `10.0` | yes |" in policy_markdown()
    assert "| `server.port` | int |  | `8080` | restart |" in policy_markdown()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_policy_names_the_schema_and_passes_it(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# yaml-language-server: $schema=")
    target = (path.parent / first.split("$schema=", 1)[1]).resolve()
    assert target == (ROOT / "config/policy.schema.json").resolve()
    jsonschema.validate(yaml.safe_load(path.read_text()), policy_schema())


def test_schema_flags_what_the_models_refuse() -> None:
    data = yaml.safe_load((ROOT / "config/policy.example.yaml").read_text())
    data["server"]["prot"] = 80
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, policy_schema())
    with pytest.raises(ValueError):
        Policy.model_validate(data)


def test_checkout_demo_policy_is_a_real_file_equal_to_the_embedded_one() -> None:
    checkout = ROOT / "config/policy.demo.yaml"
    embedded = ROOT / "proxy/policy.demo.yaml"
    assert not checkout.is_symlink()
    assert checkout.read_text().splitlines()[1:] == embedded.read_text().splitlines()[1:]
