"""The command line: `tokenlane explain`, the dispatch of `sim` / `loadtest`, and `demo`
starting a fleet and a gateway and leaving no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from proxy.config import package_version
from proxy.demo import DEMO_FILE, DEMO_POLICY, demo_policy_file
from proxy.observe.metrics import Metrics

from .servers import free_ports, wait_http_ok
from .waiting import WaitTimeout, wait_until_sync

ROOT = Path(__file__).resolve().parent.parent


def tokenlane(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_explain_prints_profile_lane_reasons_and_candidates(tmp_path: Path) -> None:
    request = tmp_path / "req.json"
    request.write_text(
        json.dumps(
            {
                "model": "Qwen/Qwen2.5-0.5B-Instruct",
                "stream": True,
                "max_tokens": 64,
                "messages": [{"role": "user", "content": "hello " * 50}],
            }
        )
    )
    result = tokenlane("explain", "--config", "config/policy.example.yaml", str(request), "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    text = json.dumps(out)
    assert "short" in text and "fast-0" in text
    # On unless the policy turns it off (the example policy does not).
    assert out["continuation"]["eligible"] is True
    assert out["continuation"]["refusal"] is None
    long_request = tmp_path / "long.json"
    long_request.write_text(json.dumps({"messages": [{"role": "user", "content": "x " * 9000}]}))
    result = tokenlane("explain", "--config", "config/policy.example.yaml", str(long_request))
    assert result.returncode == 0, result.stderr
    assert "long" in result.stdout and "bulk-0" in result.stdout
    assert "eligible: False" in result.stdout and "not a stream" in result.stdout


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"model": "m", "system": "terse", "max_tokens": 64, "stream": True,
          "messages": [{"role": "user", "content": [{"type": "text", "text": "hi " * 50}]}]},
         "messages"),
        ({"model": "m", "input": "hi " * 50, "max_output_tokens": 64, "stream": True},
         "responses"),
    ],
)  # fmt: skip
def test_explain_reads_messages_and_responses_bodies(
    tmp_path: Path, body: dict[str, object], kind: str
) -> None:
    request = tmp_path / "req.json"
    request.write_text(json.dumps(body))
    result = tokenlane("explain", "--config", "config/policy.example.yaml", str(request), "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["profile"]["kind"] == kind
    assert out["profile"]["output_tokens"] == 64
    assert out["profile"]["prompt_tokens_est"] >= 150 // 4  # 150 characters at ~4 a token
    assert "short" in json.dumps(out["lane"])


def test_explain_names_a_bad_request_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    result = tokenlane("explain", "--config", "config/policy.example.yaml", str(bad))
    assert result.returncode == 1
    assert "bad.json" in result.stderr


def test_sim_and_loadtest_take_their_own_arguments() -> None:
    sim = tokenlane("sim", "--help")
    assert sim.returncode == 0 and "--max-num-seqs" in sim.stdout
    load = tokenlane("loadtest", "--help")
    assert load.returncode == 0 and "--base-url" in load.stdout


def replace_file(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_metric(port: int, line: str, timeout_s: float = 30) -> None:
    def shown() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        return False

    wait_until_sync(shown, timeout=timeout_s, what=f"{line!r} in /metrics", poll=0.1)


def _listening(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
        return True
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_demo_serves_and_leaves_no_process_behind(tmp_path: Path) -> None:
    policy = yaml.safe_load((ROOT / "config/policy.demo.yaml").read_text())
    replicas = [r for pool in policy["pools"].values() for r in pool["replicas"]]
    *sim_ports, gw_port = free_ports(len(replicas) + 1)
    for replica, port in zip(replicas, sim_ports, strict=True):
        replica["url"] = f"http://127.0.0.1:{port}"
    policy["server"]["port"] = gw_port
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(policy))
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "demo", "--policy", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        start_new_session=True,
    )
    ready = False
    try:
        with contextlib.suppress(WaitTimeout):
            wait_http_ok(f"http://127.0.0.1:{gw_port}/ready", timeout_s=120)
            ready = True
        if not ready:
            return  # reported below, with what the demo wrote
        r = httpx.post(
            f"http://127.0.0.1:{gw_port}/v1/chat/completions",
            json={
                "model": "Qwen/Qwen2.5-0.5B-Instruct",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            },
            timeout=10,
        )
        assert r.status_code == 200
        assert all(_listening(p) for p in sim_ports)
        # Saved by rename, as editors and `sed -i` do: the demo reloads it; a broken save is
        # refused and logged, the running policy stays.
        edited = path.read_text()
        replace_file(path, edited + "\nretry:\n  max_attempts: 2\n")
        wait_metric(gw_port, 'tokenlane_policy_reloads_total{result="ok"} 1.0')
        replace_file(path, edited + "\nretry:\n  max_atempts: 2\n")
        wait_metric(gw_port, 'tokenlane_policy_reloads_total{result="invalid"} 1.0')
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert ready, f"the demo never got ready:\n{err.decode()[-3000:]}"
    assert proc.returncode == 0
    assert f"http://127.0.0.1:{gw_port}" in out.decode()  # the banner names the URLs
    assert f"policy       {path.resolve()}" in out.decode()  # and the file it watches
    log = err.decode()
    assert f"demo policy {path.resolve()}: editing it reloads the gateway" in log
    assert "policy reload refused" in log and "retry.max_atempts: unknown key" in log
    wait_until_sync(
        lambda: not any(_listening(p) for p in sim_ports),
        what="the simulators end with the demo",
        poll=0.1,
    )


def test_demo_writes_the_embedded_default_once_and_never_overwrites(tmp_path: Path) -> None:
    path, created = demo_policy_file(None, tmp_path)
    assert (path, created) == (tmp_path / DEMO_FILE, True)
    assert path.read_text() == DEMO_POLICY.read_text() and not path.is_symlink()
    path.write_text(path.read_text() + "# mine\n")
    again, created = demo_policy_file(None, tmp_path)
    assert (again, created) == (path, False)
    assert path.read_text().endswith("# mine\n")
    explicit, created = demo_policy_file(str(tmp_path / "x.yaml"), tmp_path)
    assert (explicit, created) == (tmp_path / "x.yaml", False)
    assert not explicit.exists()


def test_version_in_cli_and_build_info() -> None:
    out = tokenlane("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"tokenlane {package_version()}"
    assert package_version() not in ("", "0+unknown")  # the dev install is installed
    registry = Metrics().registry
    assert registry.get_sample_value("tokenlane_build_info", {"version": package_version()}) == 1
