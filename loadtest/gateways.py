"""The gateways a benchmark puts side by side over the same upstreams, each started the way its
users start it, each measured the same way (CPU of its whole process tree, from /proc).

- ``tokenlane``: ``python -m proxy serve`` (``--workers N``; the access log on, as ``make run``);
- ``vllm-router``: the Rust router from PyPI, in its own virtualenv (``loadtest/peers.py``,
  the installer the cache benchmark uses too), round robin;
- ``nginx``: when an ``nginx`` binary is installed (Debian's ``nginx-light`` will do): a plain
  reverse proxy with upstream keep-alive and response buffering off, the floor any proxy in
  Python or Rust is measured against.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import peers
from .procs import free_port, process, wait_http

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


@dataclass(frozen=True)
class Running:
    name: str
    port: int
    pid: int  # the process whose tree's CPU is the gateway's


def tokenlane_policy(port: int, upstreams: list[int], workers: int) -> dict[str, Any]:
    server: dict[str, object] = {"host": "127.0.0.1", "port": port}
    if workers != 1:
        server["workers"] = workers
    return {
        "server": server,
        "pools": {
            "p": {
                "balance": "least_loaded",
                "replicas": [
                    {"url": f"http://127.0.0.1:{p}", "max_in_flight": 4096} for p in upstreams
                ],
            }
        },
        "lanes": [{"name": "all", "pool": "p"}],
    }


@contextlib.contextmanager
def tokenlane(
    upstreams: list[int],
    workers: int = 1,
    continuation: bool = True,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    redis_url: str | None = None,
    wrap: list[str] | None = None,
    ready_s: float = 60.0,
    health_interval_s: float | None = None,
) -> Iterator[Running]:
    """A Tokenlane gateway over ``upstreams``; ``continuation`` off relays every stream plain
    (ineligible). ``cwd``: the source tree it runs from (a git worktree; ours when None);
    ``env``: more of its environment; ``redis_url``: the shared state it uses; ``wrap``: a
    command it runs under (``valgrind ...``), given ``ready_s`` to answer ``/ready``;
    ``health_interval_s``: its replicas' scrape period (``health.interval_s``), when not the
    default."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "policy.yaml"
        policy = tokenlane_policy(port, upstreams, workers)
        policy["continuation"] = {"enabled": continuation}
        if redis_url:
            policy["redis"] = {"url": redis_url}
        if health_interval_s is not None:
            policy["health"] = {"interval_s": health_interval_s}
        path.write_text(yaml.safe_dump(policy))
        argv = [*(wrap or []), sys.executable, "-m", "proxy", "serve", "--config", str(path)]
        # As `make run`: info, so the access log writes its line per request.
        argv += ["--log-level", "info"]
        # Stopped as a process group: a gateway with workers leaves none behind.
        with process(argv, log=Path(tmp) / "gw.log", env=env, cwd=cwd) as proc:
            wait_http(f"http://127.0.0.1:{port}/ready", timeout_s=ready_s)
            name = "tokenlane" if workers == 1 else f"tokenlane x{workers}"
            name += "" if continuation else " (plain)"
            yield Running(name, port, proc.pid)


@contextlib.contextmanager
def vllm_router(upstreams: list[int]) -> Iterator[Running]:
    exe = peers.ensure("vllm-router")
    port = free_port()
    argv = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
    argv += ["--worker-urls", *(f"http://127.0.0.1:{p}" for p in upstreams)]
    argv += ["--prometheus-port", str(free_port()), "--log-level", "warning"]
    with tempfile.TemporaryDirectory() as tmp, process(argv, log=Path(tmp) / "r.log") as proc:
        wait_http(f"http://127.0.0.1:{port}/health", timeout_s=60)
        yield Running("vllm-router", port, proc.pid)


NGINX_CONF = """
worker_processes {workers};
error_log {dir}/error.log warn;
pid {dir}/nginx.pid;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    upstream vllm {{
        {servers}
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://vllm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
        location = /health {{ return 200; }}
    }}
}}
"""


@contextlib.contextmanager
def nginx(upstreams: list[int], workers: int = 1) -> Iterator[Running]:
    if NGINX is None:
        raise peers.PeerUnavailable("nginx is not installed (apt-get install nginx-light)")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "nginx.conf"
        servers = " ".join(f"server 127.0.0.1:{p};" for p in upstreams)
        conf.write_text(NGINX_CONF.format(workers=workers, dir=tmp, servers=servers, port=port))
        argv = [NGINX, "-c", str(conf), "-p", tmp, "-g", "daemon off;"]
        with process(argv, log=Path(tmp) / "out.log") as proc:
            wait_http(f"http://127.0.0.1:{port}/health", timeout_s=30)
            yield Running("nginx" if workers == 1 else f"nginx x{workers}", port, proc.pid)


__all__ = ["NGINX", "Running", "nginx", "tokenlane", "tokenlane_policy", "vllm_router"]
