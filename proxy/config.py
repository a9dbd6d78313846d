"""The policy: what Tokenlane routes where, and how it judges replicas.

The YAML file is the external schema (DESIGN 4.2). It is validated in two stages, as pydantic
cannot name cross-field problems by path: first the shape (unknown keys, types, ranges), then the
relations between sections (unknown pools, duplicate names, lane order). Every problem comes back
as ``path: message`` so that ``tokenlane check`` can list them all at once.

Precedence for every key: command-line flag, then ``TOKENLANE_`` environment variables
(``TOKENLANE_SERVER__PORT=9000``), then the file, then the default here.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from proxy.errors import PolicyError, TokenizerError
from proxy.routing.tokens import load_counter

ENV_PREFIX = "TOKENLANE_"


def package_version() -> str:
    """The installed distribution's version (``tokenlane --version``, ``tokenlane_build_info``);
    ``0+unknown`` when run from a tree that was never installed."""
    try:
        return metadata.version("tokenlane")
    except metadata.PackageNotFoundError:
        return "0+unknown"


MiB = 1024 * 1024

# Keys that a reload cannot change (DESIGN 4.2 marks the others with †); a reload that changes
# one of these is applied for the rest and reported as needing a restart.
RESTART_KEYS: tuple[str, ...] = (
    "server.host",
    "server.port",
    "server.max_body_bytes",
    "server.admin_token_env",
    "server.api_keys_env",
    "server.shutdown_grace_s",
    "estimate.tokenizer_file",
    "redis.url",
)


class _Strict(BaseModel):
    # A typo in a key must not pass silently, and a loaded policy is never mutated in place:
    # a reload swaps in a whole new one.
    model_config = ConfigDict(extra="forbid", frozen=True)


def key(
    default: Any,
    description: str,
    unit: str | None = None,
    **constraints: Any,
) -> Any:
    """A policy key's one description: the JSON Schema (`tokenlane schema`), the editors' hover
    text and docs/policy.md's table are all generated from it, so they cannot disagree."""
    extra: dict[str, Any] = {"x-unit": unit} if unit else {}
    return Field(default, description=description, json_schema_extra=extra or None, **constraints)


class ServerConfig(_Strict):
    """The listening socket, limits and secrets of the gateway itself."""

    host: str = key("0.0.0.0", "Listen address.")
    port: int = key(8080, "Listen port.", ge=0, le=65535)
    max_body_bytes: int = key(
        16 * MiB, "Larger request bodies get 413 while being read.", "bytes", gt=0
    )
    response_headers: bool = key(
        True, "Send `x-tokenlane-lane` and `x-tokenlane-replica` response headers."
    )
    admin_token_env: str = key(
        "TOKENLANE_ADMIN_TOKEN",
        "Environment variable holding the admin token; unset → the admin API answers loopback "
        "clients only.",
    )
    api_keys_env: str = key(
        "TOKENLANE_API_KEYS",
        "Environment variable holding comma-separated client keys; unset → no client auth.",
    )
    shutdown_grace_s: float = key(
        30.0, "Requests in flight get this long to finish after SIGTERM.", "s", ge=0
    )
    # Bounds on what a client may hold before its request is complete (and before it is
    # authenticated). Header bounds are Envoy's defaults; a refusal is a 431 and a close.
    max_request_header_bytes: int = key(
        60 * 1024,
        "The URL, header names and values of one request; over it: 431 and close.",
        "bytes",
        ge=1024,
    )
    max_request_headers: int = key(
        100, "Header fields of one request; more: 431 and close.", "headers", ge=1
    )
    request_head_timeout_s: float = key(
        10.0, "From a request head's first byte to its end; longer: 408 and close.", "s", gt=0
    )
    request_body_timeout_s: float = key(
        60.0, "The longest gap between request body bytes; longer: 408 and close.", "s", gt=0
    )
    silent_connection_timeout_s: float = key(
        10.0, "A new connection that sends nothing for this long is closed.", "s", gt=0
    )
    # Each open client connection is one fd (and a relayed stream one more upstream). Well
    # above the 1,000-stream benchmark.
    max_connections: int = key(
        4096,
        "Open client connections; past it a new one gets 503 and is closed.",
        "connections",
        ge=1,
    )


class ReplicaConfig(_Strict):
    """One vLLM OpenAI-compatible server."""

    url: str = key(..., "Base URL of a vLLM OpenAI server (`http(s)://host[:port]`, no path).")
    name: str | None = key(None, "Label in metrics, logs and the admin API (default: `host:port`).")
    max_in_flight: int = key(
        256,
        "The gateway never sends more requests at once (match vLLM's `max_num_seqs`).",
        "requests",
        ge=1,
    )
    api_key_env: str | None = key(
        None,
        "Environment variable holding the key the replica was started with (`--api-key`); a "
        "client's own credentials never reach a replica.",
    )
    dns: bool = key(False, "Expand the host into one replica per DNS address.")

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, url: str) -> str:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"malformed URL {url!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"malformed URL {url!r}: expected http(s)://host[:port]")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"malformed URL {url!r}: give the server's base URL, without a path")
        del port
        return url.rstrip("/")

    @property
    def label(self) -> str:
        """The replica's name in metrics, logs and admin: ``name``, else ``host:port``."""
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{parts.hostname}:{port}"


Balance = Literal["cache_aware", "least_loaded", "prefix_affinity", "round_robin"]


class CacheAwareConfig(_Strict):
    """The ``cache_aware`` balance's knobs (``proxy/routing/cache_aware.py`` uses each)."""

    block_tokens: int = key(
        64,
        "Tokens per prefix-index block; a block is this many × `estimate.chars_per_token` "
        "characters of the prompt.",
        "tokens",
        ge=1,
    )
    kv_tokens: int = key(
        1_000_000,
        "A replica's KV capacity when its /metrics does not report one "
        "(`vllm:cache_config_info` num_gpu_blocks × block_size).",
        "tokens",
        ge=1,
    )
    kv_fraction: float = key(
        0.9,
        "Share of that capacity the index may claim (running requests' own blocks take the rest).",
        None,
        gt=0,
        le=1,
    )
    miss_weight: float = key(
        1.5,
        "Weight of the prompt tokens a replica would prefill again against the prefill tokens "
        "already queued on it; above 1 favours keeping a prefix where it is.",
        None,
        gt=0,
    )
    request_tokens: int = key(
        64,
        "Cost of one request in flight or waiting, in prefill tokens (decode steps slow a batch).",
        "tokens",
        ge=0,
    )


class PoolConfig(_Strict):
    """Replicas that serve the same model, and how requests are spread over them."""

    balance: Balance = key(
        "least_loaded",
        "How a replica is picked: `cache_aware`, `least_loaded`, `prefix_affinity`, `round_robin`.",
    )
    prefix_chars: int = key(
        1024,
        "Characters of the rendered prompt's start the balancer sees (`cache_aware` pools "
        "default to a 64 Ki-character head).",
        "characters",
        ge=1,
    )
    bounded_load: float = key(
        1.25,
        "Prefix affinity yields when a replica would be over this × the pool's mean load.",
        "× mean",
        ge=1.0,
    )
    cache_aware: CacheAwareConfig = key(
        CacheAwareConfig(), "The `cache_aware` balance's knobs (used only by such pools)."
    )
    replicas: list[ReplicaConfig] = key(..., "The pool's replicas.", min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _cache_aware_head(cls, data: Any) -> Any:
        # cache_aware matches the whole prompt, not a fixed head: index up to 64 Ki characters
        # (16 Ki tokens at 4 characters a token) unless the pool says otherwise.
        if (
            isinstance(data, dict)
            and data.get("balance") == "cache_aware"
            and "prefix_chars" not in data
        ):
            return {**data, "prefix_chars": CACHE_AWARE_PREFIX_CHARS}
        return data


CACHE_AWARE_PREFIX_CHARS = 65_536


class LaneWhen(_Strict):
    """What a request must look like to take this lane (every given condition must hold)."""

    stream: bool | None = key(None, "Streaming requests only (true) or non-streaming (false).")
    prompt_tokens_min: int | None = key(None, "Estimated prompt at least this.", "tokens", ge=0)
    prompt_tokens_max: int | None = key(None, "Estimated prompt at most this.", "tokens", ge=0)
    output_tokens_max: int | None = key(None, "Requested max tokens at most this.", "tokens", ge=0)
    model: str | None = key(None, 'A glob on the request\'s model, such as "qwen*".')


class LaneConfig(_Strict):
    """A class of requests, its pool, and its queue and timeouts (the first match wins)."""

    name: str = key(..., "The lane's name in metrics, logs and response headers.")
    pool: str = key(..., "The pool that serves this lane (a key of `pools`).")
    when: LaneWhen | None = key(
        None, "Conditions to take this lane; only the last lane has none and takes the rest."
    )
    default_output_tokens: int | None = key(
        None,
        "Assumed when a request names no max tokens; without it such a request never matches "
        "`output_tokens_max`.",
        "tokens",
        ge=0,
    )
    spill_to: str | None = key(
        None, "A pool used when the lane's pool has no healthy replica or is saturated."
    )
    priority: int = key(
        0, "Higher is served first when lanes share a pool (inside the gateway only)."
    )
    max_in_flight: int | None = key(None, "Lane-wide dispatch limit.", "requests", ge=1)
    max_queue: int = key(256, "Bounded wait queue; full → 429.", "requests", ge=0)
    queue_timeout_s: float = key(10.0, "Longest wait before dispatch; then 503.", "s", gt=0)
    first_token_timeout_s: float = key(
        30.0, "No content within this → retried elsewhere if nothing was sent.", "s", gt=0
    )
    stream_idle_timeout_s: float = key(
        60.0, "A running stream silent this long is ended.", "s", gt=0
    )
    ttft_slo_s: float | None = key(
        None, "Time-to-first-token objective for dashboards, alerts and goodput.", "s", gt=0
    )
    continuation: bool = key(
        True,
        "Continue this lane's eligible streams on another replica when theirs fails "
        "mid-answer (with `continuation.enabled`).",
    )


class RetryConfig(_Strict):
    """When a failed attempt is tried again on another replica."""

    max_attempts: int = key(3, "Attempts per request, the first included.", "attempts", ge=1)
    budget_ratio: float = key(
        0.2, "Retries in flight ≤ this × requests in flight (at least 3).", "ratio", ge=0
    )
    on_5xx_after_send: bool = key(
        False,
        "Also retry 500/502/504, or a reset, received after the request was sent (at most once).",
    )
    # From the start of the first attempt (the queue has its own timeout): no attempt starts
    # after it, and a stream's first-token watchdog fires at it at the latest.
    deadline_s: float = key(
        60.0,
        "All attempts share this deadline from the first one's start: no attempt starts after "
        "it, and a stream's first-token wait ends at it.",
        "s",
        gt=0,
    )


class ContinuationConfig(_Strict):
    """Finishing a stream on another replica, token-exact, when its replica fails mid-answer."""

    enabled: bool = key(
        True,
        "Forward eligible streams with `return_token_ids` and continue them on another "
        "replica after a reset, early close, 5xx error event, abort or stall.",
    )
    max_attempts: int = key(1, "Continuations per request.", "continuations", ge=0, le=3)
    start_timeout_s: float = key(
        15.0, "From the failure to the continuation's first token; then the error event.",
        "s", gt=0,
    )  # fmt: skip
    keepalive_s: float = key(
        5.0, "SSE comments sent to the client this often while switching.", "s", gt=0
    )
    max_seq_len: int = key(
        32768, "Prompt + generated tokens above this are not continued.", "tokens", ge=1
    )
    refuse_when_seeded: bool = key(
        False,
        "Do not continue a seeded request with temperature > 0 (a continued one is a valid "
        "sample, not the one a run without failure would have given).",
    )


class EstimateConfig(_Strict):
    """How prompt tokens are estimated before a request is sent."""

    chars_per_token: float = key(
        4.0,
        "Starting ratio; learned online per model from reported usage.",
        "characters/token",
        gt=0,
    )
    image_tokens: int = key(576, "Cost of one image part.", "tokens", ge=0)
    tokenizer_file: str | None = key(
        None, "A Hugging Face tokenizer.json for exact prompt token counts."
    )

    @field_validator("tokenizer_file")
    @classmethod
    def _tokenizer_loads(cls, path: str | None) -> str | None:
        # Loaded here, so `tokenlane check` and a reload refuse a file that is no tokenizer.
        if path is not None:
            try:
                load_counter(path)
            except TokenizerError as exc:
                raise ValueError(str(exc)) from None
        return path


class HealthConfig(_Strict):
    """How replicas are judged, ejected and readmitted."""

    interval_s: float = key(1.0, "Scrape period.", "s", gt=0)
    timeout_s: float = key(2.0, "Timeout of one scrape.", "s", gt=0)
    stall_after_s: float = key(
        10.0, "Requests running and token counters flat this long → eject.", "s", gt=0
    )
    unhealthy_threshold: int = key(3, "`/health` failures in a row → eject.", "failures", ge=1)
    consecutive_failures: int = key(
        5, "Connect errors, resets or 5xx in a row → eject.", "failures", ge=1
    )
    eject_base_s: float = key(
        30.0, "The n-th ejection lasts this × n (capped by `eject_max_s`).", "s", gt=0
    )
    eject_max_s: float = key(300.0, "Longest ejection.", "s", gt=0)
    max_ejected_percent: int = key(
        50,
        "Cap on failure-based ejections per pool (a stall is never capped).",
        "%",
        ge=0,
        le=100,
    )
    canary_timeout_s: float = key(
        10.0, "A readmission canary must return one token within this.", "s", gt=0
    )
    slow_start_s: float = key(
        0.0, "After readmission, ramp the replica's share up over this long.", "s", ge=0
    )


class RedisConfig(_Strict):
    """Shared state between gateway instances."""

    url: str | None = key(None, "Redis URL; absent → state kept in-process.")
    timeout_ms: int = key(50, "Timeout of one Redis call.", "ms", ge=1)
    heartbeat_s: float = key(2.0, "How often this instance rewrites its load.", "s", gt=0)
    ttl_s: float = key(10.0, "Shared keys expire this long after their last write.", "s", gt=0)


class RateLimitsConfig(_Strict):
    """Per client key limits."""

    requests_per_min: int | None = key(None, "Requests per client key.", "requests/min", ge=1)
    tokens_per_min: int | None = key(None, "Tokens per client key.", "tokens/min", ge=1)


class Policy(_Strict):
    """A Tokenlane policy: what goes where."""

    server: ServerConfig = key(ServerConfig(), ServerConfig.__doc__ or "")
    pools: dict[str, PoolConfig] = key(..., "Pools by name.", min_length=1)
    lanes: list[LaneConfig] = key(
        ..., "Lanes in order: a request takes the first that matches.", min_length=1
    )
    retry: RetryConfig = key(RetryConfig(), RetryConfig.__doc__ or "")
    continuation: ContinuationConfig = key(ContinuationConfig(), ContinuationConfig.__doc__ or "")
    estimate: EstimateConfig = key(EstimateConfig(), EstimateConfig.__doc__ or "")
    health: HealthConfig = key(HealthConfig(), HealthConfig.__doc__ or "")
    redis: RedisConfig = key(RedisConfig(), RedisConfig.__doc__ or "")
    rate_limits: RateLimitsConfig = key(RateLimitsConfig(), RateLimitsConfig.__doc__ or "")

    def lane(self, name: str) -> LaneConfig:
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise KeyError(name)


# ---------------------------------------------------------------------------- loading

Loc = tuple[int | str, ...]


@dataclass(frozen=True)
class Problem:
    """One fault of a policy, with where it came from: a line and column of the file, or the
    environment variable that set it."""

    loc: Loc
    message: str
    hint: str = ""
    line: int | None = None  # 1-based
    column: int | None = None  # 1-based
    env: str | None = None  # "TOKENLANE_X__Y=raw" when an override set the value
    has_path: bool = True  # False for faults of the text itself (YAML syntax)

    def plain(self) -> str:
        """``path: message``, as the reload log and the admin API report it."""
        if not self.has_path:
            return self.message
        return f"{format_path(self.loc)}: {self.message}"

    def located(self, name: str) -> str:
        """The line ``tokenlane check`` prints: where, path, message and hint."""
        text = f"{self.plain()}{self.hint}"
        if self.env is not None:
            return f"{self.env} (environment): {text}"
        if self.line is None:
            return f"{name}: {text}"
        return f"{name}:{self.line}:{self.column}: {text}"


Marks = dict[Loc, tuple[int, int]]


def _positions(node: yaml.Node, loc: Loc, keys: Marks, values: Marks, out: list[Problem]) -> None:
    """Record where every key and value of the composed YAML starts; name duplicate keys
    (PyYAML would keep the last one silently)."""
    values[loc] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            here = (*loc, key)
            mark = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            if key in seen:
                out.append(Problem(here, f"duplicate key {key!r}", line=mark[0], column=mark[1]))
                continue
            seen.add(key)
            keys[here] = mark
            _positions(value_node, here, keys, values, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _positions(item, (*loc, i), keys, values, out)


def _yaml_error(exc: yaml.YAMLError, name: str) -> Problem:
    mark = getattr(exc, "problem_mark", None)
    what = " ".join(
        str(part) for part in (getattr(exc, "context", None), getattr(exc, "problem", None)) if part
    )
    message = f"not valid YAML in {name}: {what or exc}"
    if mark is None:
        return Problem((), message, has_path=False)
    return Problem((), message, line=mark.line + 1, column=mark.column + 1, has_path=False)


def parse_yaml(text: str, name: str = "<policy>") -> Any:
    """Plain data from YAML text; ``PolicyError`` naming ``name``, the line and the column for
    a syntax error or a duplicate key."""
    data, _, _, problems = _compose(text, name)
    if problems:
        raise PolicyError.of(problems)
    return data


def _compose(text: str, name: str) -> tuple[Any, Marks, Marks, list[Problem]]:
    keys: Marks = {}
    values: Marks = {}
    problems: list[Problem] = []
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            return None, keys, values, problems
        _positions(node, (), keys, values, problems)
        data = yaml.SafeLoader("").construct_document(node)
    except yaml.YAMLError as exc:
        return None, keys, values, [_yaml_error(exc, name)]
    return data, keys, values, problems


def format_path(loc: tuple[int | str, ...]) -> str:
    """``("lanes", 1, "pool")`` → ``lanes[1].pool``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The model whose keys live at ``loc`` (``("lanes", 0)`` → LaneConfig)."""
    model: type[BaseModel] = Policy
    i = 0
    while i < len(loc):
        part = loc[i]
        if not isinstance(part, str) or part not in model.model_fields:
            return None
        found = _models_in(model.model_fields[part].annotation)
        if found is None:
            return None
        suffix, model = found
        i += 1 + suffix.count(".<name>") + suffix.count("[]")
    return model


def did_you_mean(loc: Loc) -> str:
    """`` (did you mean `spill_to`?)`` for an unknown key close to a real one, else ``""``."""
    model = _model_at(loc[:-1])
    if model is None or not isinstance(loc[-1], str):
        return ""
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _shape_problems(exc: ValidationError) -> list[Problem]:
    problems = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
        msg = err["msg"]
        hint = ""
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            hint = did_you_mean(loc)
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        problems.append(Problem(loc, msg, hint))
    return problems


def _reference_problems(data: Mapping[str, Any]) -> list[Problem]:
    """The cross-references that can be judged on data whose shape failed: lanes naming pools
    that do not exist, lane names used twice. So one run names them with the shape faults."""
    pools = data.get("pools")
    lanes = data.get("lanes")
    if not isinstance(pools, Mapping) or not isinstance(lanes, list):
        return []
    problems = []
    seen: set[Any] = set()
    for i, lane in enumerate(lanes):
        if not isinstance(lane, Mapping):
            continue
        name = lane.get("name")
        if isinstance(name, str):
            if name in seen:
                problems.append(Problem(("lanes", i, "name"), f"duplicate lane name {name!r}"))
            seen.add(name)
        for key in ("pool", "spill_to"):
            ref = lane.get(key)
            if isinstance(ref, str) and ref not in pools:
                problems.append(Problem(("lanes", i, key), f"unknown pool {ref!r}"))
    return problems


def relation_problems(policy: Policy) -> list[str]:
    """Faults between sections that the shape cannot express."""
    return [p.plain() for p in _relations(policy)]


def _relations(policy: Policy) -> list[Problem]:
    problems: list[Problem] = []
    seen_lanes: set[str] = set()
    last = len(policy.lanes) - 1
    for i, lane in enumerate(policy.lanes):
        if lane.name in seen_lanes:
            problems.append(Problem(("lanes", i, "name"), f"duplicate lane name {lane.name!r}"))
        seen_lanes.add(lane.name)
        if lane.pool not in policy.pools:
            problems.append(Problem(("lanes", i, "pool"), f"unknown pool {lane.pool!r}"))
        if lane.spill_to is not None:
            where = ("lanes", i, "spill_to")
            if lane.spill_to not in policy.pools:
                problems.append(Problem(where, f"unknown pool {lane.spill_to!r}"))
            elif lane.spill_to == lane.pool:
                problems.append(Problem(where, f"spills to its own pool {lane.pool!r}"))
        if i == last and lane.when is not None:
            problems.append(
                Problem(
                    ("lanes", i, "when"),
                    "the last lane takes every request left and must have no `when`",
                )
            )
        if i != last and lane.when is None:
            problems.append(
                Problem(
                    ("lanes", i, "when"),
                    "only the last lane may omit `when` (this one would hide the lanes after it)",
                )
            )
        when = lane.when
        if (
            when is not None
            and when.prompt_tokens_min is not None
            and when.prompt_tokens_max is not None
            and when.prompt_tokens_min > when.prompt_tokens_max
        ):
            problems.append(
                Problem(("lanes", i, "when"), "prompt_tokens_min is above prompt_tokens_max")
            )
    for pool_name, pool in policy.pools.items():
        names: set[str] = set()
        urls: set[str] = set()
        for j, replica in enumerate(pool.replicas):
            where = ("pools", pool_name, "replicas", j)
            if replica.label in names:
                problems.append(
                    Problem((*where, "name"), f"duplicate replica name {replica.label!r}")
                )
            if replica.url in urls:
                problems.append(Problem((*where, "url"), f"duplicate replica URL {replica.url!r}"))
            names.add(replica.label)
            urls.add(replica.url)
    if policy.health.eject_max_s < policy.health.eject_base_s:
        problems.append(Problem(("health", "eject_max_s"), "below health.eject_base_s"))
    if policy.redis.ttl_s <= policy.redis.heartbeat_s:
        # The load key would expire before its next rewrite: a live instance would flicker.
        problems.append(Problem(("redis", "ttl_s"), "must be above redis.heartbeat_s"))
    return problems


def _validate(data: Any) -> tuple[Policy | None, list[Problem]]:
    if not isinstance(data, Mapping):
        return None, [Problem((), "expected a mapping with `pools` and `lanes`")]
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        return None, _shape_problems(exc) + _reference_problems(data)
    return policy, _relations(policy)


def build_policy(data: Any) -> Policy:
    """Validate plain data (parsed YAML with overrides applied) into a ``Policy``."""
    policy, problems = _validate(data)
    if problems or policy is None:
        raise PolicyError.of(problems)
    return policy


def _env_items(environ: Mapping[str, str]) -> list[tuple[str, str, list[str], Any]]:
    out = []
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX) :].split("__")]
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        out.append((key, raw, path, value))
    return sorted(out, key=lambda item: (item[2], item[0]))


def env_overrides(environ: Mapping[str, str]) -> list[tuple[list[str], Any]]:
    """``TOKENLANE_SERVER__PORT=9000`` → ``(["server", "port"], 9000)``.

    Only variables with ``__`` count: the single-level ones (``TOKENLANE_ADMIN_TOKEN``,
    ``TOKENLANE_API_KEYS``) are secrets the policy points at, not policy keys. Values are read as
    YAML scalars so that ``true``, ``1.5`` and ``null`` mean what they say.
    """
    return [(path, value) for _, _, path, value in _env_items(environ)]


def apply_override(data: dict[str, Any], path: list[str], value: Any) -> Loc:
    """Set ``path`` in ``data``; return the path as the data spells it (pool names keep their
    case, list items are indexes)."""
    node: Any = data
    loc: list[int | str] = []
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise PolicyError([f"{ENV_PREFIX}{'__'.join(path).upper()}: no such list item"])
            loc.append(int(part))
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
            continue
        # Pool names are free text; match them without regard to case.
        match = next((k for k in node if isinstance(k, str) and k.lower() == part), part)
        loc.append(match)
        if last:
            node[match] = value
        else:
            node = node.setdefault(match, {})
            if not isinstance(node, (dict, list)):
                raise PolicyError([f"{ENV_PREFIX}{'__'.join(path).upper()}: not a section"])
    return tuple(loc)


def analyse(
    text: str,
    name: str,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[Policy | None, list[Problem]]:
    """Every problem of a policy text in one pass (syntax, shape and cross-references), each
    placed at its line and column or at the environment variable that caused it."""
    data, keys, values, problems = _compose(text, name)
    if problems and data is None:
        return None, problems
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return None, [*problems, Problem((), "expected a mapping with `pools` and `lanes`")]
    from_env: dict[Loc, str] = {}
    for var, raw, env_path, value in _env_items(os.environ if environ is None else environ):
        try:
            from_env[apply_override(data, env_path, value)] = f"{var}={raw}"
        except PolicyError as exc:
            problems.extend(
                Problem((), m, env=f"{var}={raw}", has_path=False) for m in exc.problems
            )
    for dotted, value in (overrides or {}).items():
        if value is not None:
            apply_override(data, dotted.split("."), value)
    policy, found = _validate(data)
    for problem in found:
        problems.append(_place(problem, keys, values, from_env))
    return (policy if not problems else None), problems


def _place(problem: Problem, keys: Marks, values: Marks, from_env: dict[Loc, str]) -> Problem:
    loc = problem.loc
    for n in range(len(loc), 0, -1):
        if loc[:n] in from_env:
            return replace(problem, env=from_env[loc[:n]])
    # An unknown key points at the key; a bad value at the value; a missing key at the
    # nearest section that exists.
    exact = keys.get(loc) if problem.message == "unknown key" else values.get(loc)
    if exact is None:
        exact = next((values[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in values), None)
    if exact is None:
        return problem
    return replace(problem, line=exact[0], column=exact[1])


def load_policy(
    path: str | Path,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Policy:
    """Read, override and validate a policy file; raise ``PolicyError`` naming every problem.

    ``overrides`` are dotted keys from the command line (``{"server.port": 9000}``).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError([f"{path}: {exc.strerror or exc}"]) from None
    return policy_from_text(text, environ=environ, overrides=overrides, name=str(path))


def policy_from_text(
    text: str,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    name: str = "<policy>",
) -> Policy:
    policy, problems = analyse(text, name, environ=environ, overrides=overrides)
    if problems or policy is None:
        raise PolicyError.of(problems)
    return policy


# ---------------------------------------------------------------------------- reloading


def _get(policy: Policy, dotted: str) -> Any:
    node: Any = policy
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def restart_changes(old: Policy, new: Policy) -> list[str]:
    """Keys a reload changed that only a restart can apply (``RESTART_KEYS``)."""
    return [key for key in RESTART_KEYS if _get(old, key) != _get(new, key)]


def keep_restart_keys(old: Policy, new: Policy) -> Policy:
    """``new`` with the restart-only keys as they were: the process keeps running with what
    it started with, and the rest of the reload applies."""
    changed = restart_changes(old, new)
    if not changed:
        return new
    sections: dict[str, dict[str, Any]] = {}
    for key in changed:
        section, field = key.split(".", 1)
        sections.setdefault(section, {})[field] = _get(old, key)
    return new.model_copy(
        update={s: getattr(new, s).model_copy(update=f) for s, f in sections.items()}
    )


# ---------------------------------------------------------------------------- schema and docs

SCHEMA_URL = "https://json-schema.org/draft/2020-12/schema"


def policy_schema() -> dict[str, Any]:
    """The policy's JSON Schema (``tokenlane schema``, config/policy.schema.json): what editors
    (yaml-language-server) use to complete keys and flag typos."""
    schema = Policy.model_json_schema()
    return {
        "$schema": SCHEMA_URL,
        "title": "Tokenlane policy",
        **{k: v for k, v in schema.items() if k != "title"},
    }


def _models_in(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """For a field's annotation, the suffix its keys take and the model they belong to:
    ``dict[str, PoolConfig]`` → (``.<name>``, PoolConfig), ``list[LaneConfig]`` → (``[]``, ...)."""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "", annotation
    if origin is dict and len(args) == 2:
        inner = _models_in(args[1])
        return (".<name>" + inner[0], inner[1]) if inner else None
    if origin is list and args:
        inner = _models_in(args[0])
        return ("[]" + inner[0], inner[1]) if inner else None
    for arg in args:  # X | None
        if arg is not type(None):
            found = _models_in(arg)
            if found:
                return found
    return None


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return "enum"
    args = [a for a in get_args(annotation) if a is not type(None)]
    if origin is not None and args and origin not in (list, dict):
        return " | ".join(_type_name(a) for a in args)
    return getattr(annotation, "__name__", str(annotation))


def policy_keys(
    model: type[BaseModel] = Policy, prefix: str = ""
) -> list[tuple[str, str, str, str, str]]:
    """Every leaf key of the policy as (path, type, unit, default, description), in file order:
    the rows of docs/policy.md."""
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        nested = _models_in(field.annotation)
        if nested is not None:
            rows.extend(policy_keys(nested[1], f"{path}{nested[0]}."))
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if field.is_required():
            default = "required"
        elif field.default is None:
            default = "none"
        else:
            default = json.dumps(field.default)
        rows.append(
            (
                path,
                _type_name(field.annotation),
                str(extra.get("x-unit", "")),
                default,
                field.description or "",
            )
        )
    return rows


DOCS_BEGIN = "<!-- BEGIN generated by `tokenlane schema --markdown` from proxy/config.py -->"
DOCS_END = "<!-- END generated -->"


def policy_markdown() -> str:
    """docs/policy.md's key table (``tokenlane schema --markdown``), between its markers;
    ``tokenlane schema --write-docs docs/policy.md`` puts it there."""
    restart = set(RESTART_KEYS)
    lines = [
        DOCS_BEGIN,
        "| key | type | unit | default | reload | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for path, type_name, unit, default, description in policy_keys():
        plain = path.replace(".<name>", "").replace("[]", "")
        applies = "restart" if plain in restart else "yes"
        cell = description.replace("|", "\\|")
        lines.append(f"| `{path}` | {type_name} | {unit} | `{default}` | {applies} | {cell} |")
    lines.append(DOCS_END)
    return "\n".join(lines) + "\n"


def with_key_table(doc: str) -> str:
    """``doc`` (docs/policy.md) with the text between its markers replaced by the generated
    table: the prose around it stays hand-written."""
    start, end = doc.find(DOCS_BEGIN), doc.find(DOCS_END)
    if start < 0 or end < start:
        raise ValueError(f"no {DOCS_BEGIN} ... {DOCS_END} markers")
    return doc[:start] + policy_markdown() + doc[end + len(DOCS_END) + 1 :]
