"""``tokenlane serve / check / schema / explain / sim / demo / loadtest`` (docs/operations.md)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.config import package_version
from proxy.demo import DEMO_FILE
from proxy.policyfile import PolicyError, analyse, load_policy
from proxy.schema import policy_markdown, policy_schema, with_key_table


def _serve(args: argparse.Namespace) -> int:
    from proxy.edge.serve import serve

    overrides = {"server.host": args.host, "server.port": args.port, "server.workers": args.workers}
    try:
        policy = load_policy(args.config, overrides=overrides)
    except PolicyError as exc:
        _print_problems(args.config, exc)
        return 1
    # What each worker is started with (the socket comes from the supervisor).
    worker_args = ["--host", args.host] if args.host is not None else []
    return serve(
        policy, policy_path=str(args.config), log_level=args.log_level, worker_args=worker_args
    )


def _worker(args: argparse.Namespace) -> int:
    import socket

    from proxy.edge.serve import serve_worker
    from proxy.workers.link import WorkerPlace
    from proxy.workers.supervisor import end_with_supervisor

    if not end_with_supervisor(args.supervisor):
        print("tokenlane worker: its supervisor is gone", file=sys.stderr)
        return 1
    # Its stdout is the supervisor's pipe: a worker draining after its supervisor died has
    # nowhere to write its access lines, and logging would print a traceback for each.
    logging.raiseExceptions = False

    overrides = {"server.host": args.host, "server.workers": 1}
    place = WorkerPlace(rundir=args.rundir, index=args.index, count=args.workers)
    # A restarted worker starts from the text the leader runs, not the file as it is now.
    source = place.policy_source(args.config)
    try:
        policy = load_policy(source, overrides=overrides)
    except PolicyError as exc:
        _print_problems(source, exc)
        return 1
    sock = socket.socket(fileno=args.fd)
    return serve_worker(
        policy, policy_path=str(args.config), place=place, sock=sock, log_level=args.log_level
    )


def _workers_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number or auto") from None


def _print_problems(path: str, exc: PolicyError) -> None:
    print(f"{path}: {len(exc.problems)} problem(s)", file=sys.stderr)
    for problem in exc.problems:
        print(f"  {problem}", file=sys.stderr)


def _check(args: argparse.Namespace) -> int:
    try:
        text = Path(args.path).read_text(encoding="utf-8")
    except OSError as exc:
        print(f"{args.path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    policy, problems = analyse(text, args.path)
    if problems or policy is None:
        print(f"{args.path}: {len(problems)} problem(s)", file=sys.stderr)
        for problem in problems:
            print(f"  {problem.located(args.path)}", file=sys.stderr)
        return 1
    replicas = sum(len(p.replicas) for p in policy.pools.values())
    print(
        f"{args.path}: ok ({len(policy.pools)} pools, {replicas} replicas, "
        f"{len(policy.lanes)} lanes)"
    )
    return 0


def _explain(args: argparse.Namespace) -> int:
    from proxy.relay import continuation
    from proxy.routing.explain import explain_request
    from proxy.routing.profile import guess_kind
    from proxy.routing.tokens import TokenizerError, load_counter

    try:
        policy = load_policy(args.config)
    except PolicyError as exc:
        _print_problems(args.config, exc)
        return 1
    try:
        body: Any = json.loads(Path(args.request).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"{args.request}: cannot read a JSON request: {exc}", file=sys.stderr)
        return 1
    if not isinstance(body, dict):
        print(f"{args.request}: the request must be a JSON object", file=sys.stderr)
        return 1
    kind = args.kind or guess_kind(body)
    tokenizer_file = policy.estimate.tokenizer_file
    try:
        counter = load_counter(tokenizer_file) if tokenizer_file else None
    except TokenizerError as exc:
        print(f"{args.config}: estimate.tokenizer_file: {exc}", file=sys.stderr)
        return 1
    result = explain_request(policy, body, kind, args.chars_per_token, counter=counter)
    lane = result["lane"]
    lane_switch = policy.lanes[lane["index"]].continuation
    result["continuation"] = continuation.explain(policy.continuation, lane_switch, kind, body)
    for pool in (lane["pool"], lane["spill_to"]):
        if pool is not None and policy.pools[pool].balance == "cache_aware":
            from proxy.routing import cache_aware

            earlier = [json.loads(Path(p).read_text(encoding="utf-8")) for p in args.after]
            result.setdefault("cache_aware", []).append(
                cache_aware.explain(policy, pool, body, kind, earlier, args.chars_per_token)
            )
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(_render_explanation(result))
        for ca in result.get("cache_aware", []):
            rows = ", ".join(f"{c['name']} {c['matched_tokens']}" for c in ca["candidates"])
            print(f"cache_aware {ca['pool']}: matched tokens {rows}; {ca['reason']}: {ca['why']}")
    return 0


def _render_explanation(result: dict[str, Any]) -> str:
    def show(value: Any) -> str:
        if isinstance(value, str) and ("\n" in value or value != value.strip()):
            return repr(value)
        if isinstance(value, dict) and "url" in value:  # a candidate replica
            return (
                f"{value.get('pool')}/{value.get('name')} {value.get('url')} "
                f"({value.get('role')}, {value.get('balance')}, "
                f"max_in_flight {value.get('max_in_flight')})"
            )
        return str(value)

    lines = []
    for key, value in result.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines.extend(f"  {k}: {show(v)}" for k, v in value.items())
        elif isinstance(value, list):
            lines.append(f"{key}:")
            lines.extend(f"  - {show(v)}" for v in value)
        else:
            lines.append(f"{key}: {show(value)}")
    return "\n".join(lines)


def _schema(args: argparse.Namespace) -> int:
    if args.write_docs:
        path = Path(args.write_docs)
        try:
            path.write_text(with_key_table(path.read_text(encoding="utf-8")), encoding="utf-8")
        except (OSError, ValueError) as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            return 1
        return 0
    print(policy_markdown() if args.markdown else json.dumps(policy_schema(), indent=2), end="")
    if not args.markdown:
        print()
    return 0


def _demo(args: argparse.Namespace) -> int:
    from proxy.demo import run_demo

    return run_demo(args.policy, port=args.port)


def _top(args: argparse.Namespace) -> int:
    from proxy.observe.top import run

    return run(args.url, args.admin_token or os.environ.get("TOKENLANE_ADMIN_TOKEN"),
               interval_s=args.interval, iterations=args.iterations)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenlane", description="A latency-aware gateway in front of vLLM replicas."
    )
    parser.add_argument("--version", action="version", version=f"tokenlane {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gateway with a policy file")
    p.add_argument("--config", required=True, help="policy YAML")
    p.add_argument("--host", default=None, help="overrides server.host")
    p.add_argument("--port", type=int, default=None, help="overrides server.port")
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--workers",
        type=_workers_arg,
        default=None,
        help="worker processes, a number or auto (overrides server.workers)",
    )
    p.set_defaults(func=_serve)

    # A worker of `serve --workers N`, started by its supervisor (not for people).
    p = sub.add_parser("worker")
    p.add_argument("--config", required=True)
    p.add_argument("--host", default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--rundir", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--supervisor", type=int, required=True, help="the supervisor's pid")
    p.set_defaults(func=_worker)

    p = sub.add_parser("check", help="validate a policy file")
    p.add_argument("path")
    p.set_defaults(func=_check)

    p = sub.add_parser("schema", help="print the policy's JSON Schema (or its key table)")
    p.add_argument("--markdown", action="store_true", help="docs/policy.md's table instead")
    p.add_argument("--write-docs", metavar="PATH", help="update the table in PATH (docs/policy.md)")
    p.set_defaults(func=_schema)

    p = sub.add_parser("explain", help="show how a request would be routed (no network)")
    p.add_argument("--config", required=True)
    p.add_argument("request", help="a JSON request body")
    p.add_argument("--chars-per-token", type=float, default=None)
    p.add_argument(
        "--kind",
        choices=["chat", "completion", "messages", "responses"],
        default=None,
        help="the API the body is for (default: guessed from its fields; an Anthropic Messages "
        "body is guessed by its max_tokens with system or content blocks, say --kind messages "
        "to be sure)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="REQUEST",
        help="cache_aware pools: route these request bodies first (repeatable)",
    )
    p.set_defaults(func=_explain)

    p = sub.add_parser("demo", help="a simulated fleet and a gateway on this machine")
    p.add_argument(
        "--policy",
        default=None,
        help=f"the policy file to serve and watch (default: ./{DEMO_FILE}, "
        "written from the embedded default when missing)",
    )
    p.add_argument("--port", type=int, default=None, help="gateway port (default 8080)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("top", help="a live view of a running gateway")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the gateway")
    p.add_argument("--admin-token", default=None, help="default: $TOKENLANE_ADMIN_TOKEN")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--iterations", type=int, default=None, help="stop after N refreshes")
    p.set_defaults(func=_top)

    # `sim` and `loadtest` take their own arguments; they are dispatched before parsing.
    sub.add_parser("sim", help="one simulated vLLM replica", add_help=False)
    sub.add_parser("loadtest", help="replay a trace or scenario against a URL", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "sim":
        from loadtest.sim.cli import main as sim_main

        return sim_main(args_list[1:])
    if args_list and args_list[0] == "loadtest":
        from loadtest.runner import main as loadtest_main

        return loadtest_main(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    result: int = args.func(args)
    return result
