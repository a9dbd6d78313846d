"""A real Prometheus (Debian's ``prometheus``, installed by scripts/system-deps.sh) for tests:
on a free loopback port, scraping the given targets every second and evaluating the project's
alert rules every second, storage in a temporary directory.

It fails, not skips, when ``prometheus`` is missing, like tests/redis_server.py."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from .redis_server import _die_with_parent
from .servers import free_port

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "alerts.yml"


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen[bytes]) -> None:
        self.url = url
        self.proc = proc

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query through the HTTP API; raises on a PromQL error."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        r = httpx.get(self.url + "/api/v1/query", params=params, timeout=10)
        body = r.json()
        assert body.get("status") == "success", (expr, body)
        return body["data"]["result"]

    def alerts(self) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/api/v1/alerts", timeout=10)
        return r.json()["data"]["alerts"]

    def targets_up(self) -> dict[str, float]:
        return {s["metric"]["instance"]: float(s["value"][1]) for s in self.query("up")}

    def last_scrape(self) -> float:
        """The oldest of the targets' latest scrape times (Unix seconds)."""
        result = self.query("timestamp(up)")
        return min(float(s["value"][1]) for s in result) if result else 0.0


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.fail(
            "prometheus is not installed: run scripts/system-deps.sh (make test does) or "
            "apt-get install prometheus",
            pytrace=False,
        )
    return found


@contextlib.contextmanager
def running_prometheus(
    tmp: Path, jobs: Mapping[str, Sequence[str]], *, rules: Path = RULES
) -> Iterator[Prometheus]:
    """Prometheus scraping ``jobs`` (job name -> host:port targets) every second."""
    shutil.copy(rules, tmp / "alerts.yml")
    config = {
        # A scrape a loaded machine answers late fails and leaves a gap; range functions
        # read across it, and the incident test evaluates after a successful scrape.
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": ["alerts.yml"],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(targets)}]}
            for job, targets in jobs.items()
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            prometheus_binary(),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"prometheus exited at start:\n{err[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("prometheus not ready after 30 s")
            time.sleep(0.05)
        yield Prometheus(url, proc)
    finally:
        proc.kill()
        proc.wait(10)
