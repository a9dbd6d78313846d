"""The Helm chart (deploy/helm/tokenlane), checked without a cluster: rendered by Helm's own Go
engine (helm-python-sdk ships it), every object validated against the Kubernetes API schemas
(kubernetes-validate), the rendered policy through `tokenlane check`, the alert rules through
promtool, and the readiness route the chart probes over a real socket."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm  # the dev extra: Helm's Go engine, no helm binary needed
import httpx
import kubernetes_validate
import pytest
import yaml

from proxy.policyfile import analyse

from .gateway import policy_for, running_gateway
from .servers import free_port

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy/helm/tokenlane"
K8S_VERSION = "1.33.0"  # a recent release; kubernetes-validate ships its schemas
PROFILES = {
    "default": {},
    "minimal": yaml.safe_load((CHART / "ci/minimal-values.yaml").read_text()),
    "production": yaml.safe_load((CHART / "ci/production-values.yaml").read_text()),
}
CRD_GROUPS = ("monitoring.coreos.com/",)


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        out = chart.render(values, name="tl", namespace="ai")
    return [
        doc
        for name, text in sorted(out.items())
        if name.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(values) for name, values in PROFILES.items()}


@pytest.mark.parametrize("profile", PROFILES)
def test_every_object_validates_against_the_kubernetes_api(
    rendered: dict[str, list[dict[str, Any]]], profile: str
) -> None:
    kinds = []
    for obj in rendered[profile]:
        kinds.append(obj["kind"])
        if obj["apiVersion"].startswith(CRD_GROUPS):
            continue  # Prometheus Operator kinds: not in the Kubernetes schemas (see below)
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert {"Deployment", "Service", "ConfigMap"} <= set(kinds)
    if profile == "production":
        assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor"} <= set(kinds)
        assert {"PrometheusRule"} <= set(kinds)
        assert sum(k == "ConfigMap" for k in kinds) == 1 + len(
            list(CHART.glob("files/dashboards/*.json"))
        )


def test_validation_would_catch_a_broken_object(rendered: dict[str, list[dict[str, Any]]]) -> None:
    broken = copy.deepcopy(one(rendered["default"], "Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.parametrize("profile", PROFILES)
def test_rendered_policy_passes_tokenlane_check(
    rendered: dict[str, list[dict[str, Any]]], profile: str, tmp_path: Path
) -> None:
    config_map = next(o for o in rendered[profile] if o["metadata"]["name"].endswith("-policy"))
    path = tmp_path / "policy.yaml"
    path.write_text(config_map["data"]["policy.yaml"])
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "check", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    policy, _ = analyse(path.read_text(), str(path), environ={})
    assert policy is not None
    port = container(rendered[profile])["ports"][0]["containerPort"]
    assert port == policy.server.port


def test_probes_drain_and_security(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["production"]
    c = container(objects)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready/gateway"
    pause = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pause > 0
    grace = PROFILES["production"]["policy"]["server"]["shutdown_grace_s"]
    assert pod["terminationGracePeriodSeconds"] > pause + grace
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # The ConfigMap is mounted as a directory: a subPath mount would never see an update.
    mount = next(m for m in c["volumeMounts"] if m["name"] == "policy")
    assert "subPath" not in mount and c["args"][2] == mount["mountPath"] + "/policy.yaml"
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] > 0
    assert "replicas" not in one(objects, "Deployment")["spec"]  # the HPA owns it


def test_secrets_become_environment_references(rendered: dict[str, list[dict[str, Any]]]) -> None:
    env = {e["name"]: e for e in container(rendered["production"])["env"]}
    assert env["TOKENLANE_REDIS__URL"]["valueFrom"]["secretKeyRef"]["name"] == "tokenlane-redis"
    assert env["TOKENLANE_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "tokenlane-keys"
    assert env["TOKENLANE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "tokenlane-admin"
    assert "env" not in container(rendered["default"]) or not container(rendered["default"])["env"]


def test_workers_are_auto_unless_set(rendered: dict[str, list[dict[str, Any]]]) -> None:
    args = container(rendered["default"])["args"]
    assert args[args.index("--workers") + 1] == "auto"
    args = container(rendered["production"])["args"]
    assert args[args.index("--workers") + 1] == "2"


def checksum(values: dict[str, Any]) -> str:
    pod = one(render(values), "Deployment")["spec"]["template"]
    return str(pod["metadata"]["annotations"]["checksum/restart-keys"])


def test_only_restart_keys_roll_the_pods() -> None:
    base = copy.deepcopy(PROFILES["production"])
    reloadable = copy.deepcopy(base)
    reloadable["policy"]["lanes"][0]["ttft_slo_s"] = 0.8
    restart = copy.deepcopy(base)
    restart["policy"]["server"]["shutdown_grace_s"] = 60
    assert checksum(reloadable) == checksum(base)
    assert checksum(restart) != checksum(base)


def test_alerts_and_dashboards_come_from_the_tested_files(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    objects = rendered["production"]
    rules = one(objects, "PrometheusRule")["spec"]
    source = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    assert rules["groups"] == source["groups"]
    promtool = shutil.which("promtool")
    if promtool is not None:  # scripts/system-deps.sh installs it for `make test`
        path = tmp_path / "rules.yml"
        path.write_text(yaml.safe_dump(rules))
        out = subprocess.run(
            [promtool, "check", "rules", str(path)], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stdout + out.stderr
    dashboards = [
        o for o in objects if o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    files = sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))
    assert len(dashboards) == len(files)
    for cm in dashboards:
        ((name, text),) = cm["data"].items()
        assert json.loads(text) == json.loads(
            (ROOT / "deploy/grafana/dashboards" / name).read_text()
        )


def test_helm_lint_finds_no_error() -> None:
    helm.disable_logging()
    for values in PROFILES.values():
        report = helm.lint(CHART, values, kube_version=f"v{K8S_VERSION}")
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 3] == []


def test_values_schema_refuses_a_typo() -> None:
    helm.disable_logging()
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError):
        chart.validate_schema({"autoscalling": {"enabled": True}})


async def test_gateway_readiness_ignores_replica_health_but_not_draining() -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: no replica is ever healthy
    async with running_gateway(policy_for({"p": [dead]}), ready=False) as (url, app):
        async with httpx.AsyncClient(timeout=5) as client:
            assert (await client.get(url + "/ready")).status_code == 503
            gateway_ready = await client.get(url + "/ready/gateway")
            assert gateway_ready.status_code == 200
            assert gateway_ready.json()["status"] == "ready"
            app.gateway.begin_shutdown()
            draining = await client.get(url + "/ready/gateway")
            assert (draining.status_code, draining.json()["status"]) == (503, "draining")
