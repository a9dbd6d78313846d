"""``tokenlane demo``: a simulated fleet and a gateway on one machine (what ``make run`` runs).

One simulator process per replica of the demo policy, on the replica's port, under a supervisor
that restarts a replica after a ``crash`` fault; the gateway in this process. Ctrl-C or SIGTERM
drains the gateway, then stops every simulator: no process is left behind (the simulators
also exit when this process dies, as their stdin closes).

The policy the demo serves is a real file it watches: ``--policy PATH``, else
``./tokenlane-demo.yaml``, written from the embedded default when missing. So a newcomer edits an
ordinary file in a checkout, after ``pip install`` and in the container alike, and every save
(in place, by rename, or by ``sed -i``) reloads the gateway.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from urllib.parse import urlsplit

from proxy.config import Policy
from proxy.policyfile import PolicyError, load_policy

DEMO_POLICY = Path(__file__).with_name("policy.demo.yaml")
DEMO_FILE = "tokenlane-demo.yaml"

log = logging.getLogger("tokenlane.demo")


def demo_policy_file(explicit: str | None, cwd: Path) -> tuple[Path, bool]:
    """The file the demo serves and watches, and whether it was just written: ``explicit``,
    else ``cwd/tokenlane-demo.yaml`` with the embedded default copied in when missing (an
    existing one is the newcomer's edits: never overwritten)."""
    if explicit:
        return Path(explicit), False
    path = cwd / DEMO_FILE
    if path.exists():
        return path, False
    path.write_text(DEMO_POLICY.read_text(encoding="utf-8"), encoding="utf-8")
    return path, True


# Engine settings per pool, as a GPU operator would tune the real replicas: the interactive
# replica takes small steps so a long prompt never holds a short one for long; the bulk
# replicas batch big prefills and cache prefixes.
POOL_ENGINE_ARGS: dict[str, list[str]] = {
    "interactive": [
        "--max-num-batched-tokens",
        "512",
        "--enable-chunked-prefill",
        "--max-num-seqs",
        "64",
    ],
    "bulk": ["--enable-prefix-caching", "--max-num-seqs", "128"],
}


def sim_specs(policy: Policy) -> list[tuple[str, list[str]]]:
    """(name, ``tokenlane sim`` arguments) for every replica of ``policy``."""
    specs = []
    for pool_name, pool in policy.pools.items():
        for replica in pool.replicas:
            parts = urlsplit(replica.url)
            args = [
                "--host",
                parts.hostname or "127.0.0.1",
                "--port",
                str(parts.port or 80),
                "--name",
                replica.label,
                *POOL_ENGINE_ARGS.get(pool_name, []),
            ]
            specs.append((replica.label, args))
    return specs


def banner(policy: Policy, urls: dict[str, str], policy_path: str = "") -> str:
    base = f"http://{policy.server.host}:{policy.server.port}"
    lines = ["", "Tokenlane demo: a simulated vLLM fleet behind the gateway", ""]
    if policy_path:
        lines += [
            f"  policy       {policy_path}",
            "               edit it: each save reloads the gateway (a change it cannot apply is",
            "               logged and the running policy stays)",
            "",
        ]
    for pool_name, pool in policy.pools.items():
        for replica in pool.replicas:
            lines.append(f"  {pool_name:<12} {replica.label:<8} {urls.get(replica.label, '?')}")
    lines += [
        "",
        f"  gateway      {base}   (metrics {base}/metrics, admin {base}/admin/replicas)",
        "",
        "Try:",
        f"  curl -sN {base}/v1/chat/completions -H 'content-type: application/json' \\",
        '    -d \'{"model": "Qwen/Qwen2.5-0.5B-Instruct", "stream": true, '
        '"max_tokens": 32, "messages": [{"role": "user", "content": "Say hello"}]}\'',
        "",
        "  python -c 'from openai import OpenAI; c = OpenAI(base_url=\"" + base + '/v1", '
        'api_key="x"); print(c.chat.completions.create(model="Qwen/Qwen2.5-0.5B-Instruct", '
        'messages=[{"role": "user", "content": "hi"}], max_tokens=16)'
        ".choices[0].message.content)'",
        "",
        "  fault a replica: curl -s -XPOST "
        + urls.get("bulk-0", "http://127.0.0.1:8102")
        + '/sim/fault -d \'{"fault": "stall", "duration_s": 30}\'',
        "",
        "Ctrl-C stops everything.",
        "",
    ]
    return "\n".join(lines)


def run_demo(policy_path: str | None = None, port: int | None = None) -> int:
    from loadtest.sim.supervisor import SimSpec, Supervisor
    from proxy.edge.routes import configure_logging
    from proxy.edge.serve import serve

    configure_logging("info")
    try:
        file, created = demo_policy_file(policy_path, Path.cwd())
    except OSError as exc:
        print(f"demo: cannot write {DEMO_FILE} here ({exc}); pass --policy PATH", file=sys.stderr)
        return 1
    path = str(file.resolve())
    if created:
        log.info("demo: wrote the default policy to %s", path)
    log.info("demo policy %s: editing it reloads the gateway", path)
    try:
        policy = load_policy(path, overrides={"server.port": port})
    except PolicyError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    supervisor = Supervisor([SimSpec(name, args) for name, args in sim_specs(policy)])
    try:
        urls = supervisor.start()
    except RuntimeError as exc:
        print(f"demo: {exc} (is a port of {path} in use?)", file=sys.stderr)
        return 1
    try:
        print(banner(policy, urls, path), flush=True)
        return serve(policy, policy_path=path)
    finally:
        supervisor.stop()
