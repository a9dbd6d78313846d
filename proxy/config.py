"""The policy: what Tokenlane routes where, and how it judges replicas.

The YAML file is the external schema (DESIGN 4.2). It is validated in two stages, as pydantic
cannot name cross-field problems by path: first the shape (unknown keys, types, ranges), then the
relations between sections (unknown pools, duplicate names, lane order). Every problem comes back
as ``path: message`` so that ``tokenlane check`` can list them all at once.

Precedence for every key: command-line flag, then ``TOKENLANE_`` environment variables
(``TOKENLANE_SERVER__PORT=9000``), then the file, then the default here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
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

from proxy.routing.tokens import TokenizerError, load_counter

ENV_PREFIX = "TOKENLANE_"
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


class PolicyError(ValueError):
    """A policy that cannot be used; ``problems`` names each fault by its path."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class _Strict(BaseModel):
    # A typo in a key must not pass silently, and a loaded policy is never mutated in place:
    # a reload swaps in a whole new one.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Strict):
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(16 * MiB, gt=0)
    response_headers: bool = True
    admin_token_env: str = "TOKENLANE_ADMIN_TOKEN"
    api_keys_env: str = "TOKENLANE_API_KEYS"
    shutdown_grace_s: float = Field(30.0, ge=0)


class ReplicaConfig(_Strict):
    url: str
    name: str | None = None
    max_in_flight: int = Field(256, ge=1)
    api_key_env: str | None = None
    dns: bool = False

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

    # Tokens per index block; the block is this many times estimate.chars_per_token characters.
    block_tokens: int = Field(64, ge=1)
    # A replica's KV capacity in tokens when its /metrics does not report one
    # (vllm:cache_config_info num_gpu_blocks x block_size).
    kv_tokens: int = Field(1_000_000, ge=1)
    # Share of that capacity the index may claim: running requests' own blocks take the rest.
    kv_fraction: float = Field(0.9, gt=0, le=1)
    # Weight of the prompt tokens a replica would have to prefill (not in its cache) against the
    # prefill tokens already queued on it; above 1 favours keeping a prefix where it is.
    miss_weight: float = Field(1.5, gt=0)
    # Cost of one request in flight or waiting, in prefill tokens (decode steps slow a batch).
    request_tokens: int = Field(64, ge=0)


class PoolConfig(_Strict):
    balance: Balance = "least_loaded"
    # The prompt head the balancer sees; cache_aware defaults to a longer one (below).
    prefix_chars: int = Field(1024, ge=1)
    bounded_load: float = Field(1.25, ge=1.0)
    cache_aware: CacheAwareConfig = Field(default_factory=CacheAwareConfig)
    replicas: list[ReplicaConfig] = Field(min_length=1)

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
    stream: bool | None = None
    prompt_tokens_min: int | None = Field(None, ge=0)
    prompt_tokens_max: int | None = Field(None, ge=0)
    output_tokens_max: int | None = Field(None, ge=0)
    model: str | None = None  # a glob: "qwen*"


class LaneConfig(_Strict):
    name: str
    pool: str
    when: LaneWhen | None = None
    default_output_tokens: int | None = Field(None, ge=0)
    spill_to: str | None = None
    priority: int = 0
    max_in_flight: int | None = Field(None, ge=1)
    max_queue: int = Field(256, ge=0)
    queue_timeout_s: float = Field(10.0, gt=0)
    first_token_timeout_s: float = Field(30.0, gt=0)
    stream_idle_timeout_s: float = Field(60.0, gt=0)
    ttft_slo_s: float | None = Field(None, gt=0)


class RetryConfig(_Strict):
    max_attempts: int = Field(3, ge=1)
    budget_ratio: float = Field(0.2, ge=0)
    on_5xx_after_send: bool = False
    # From the start of the first attempt (the queue has its own timeout): no attempt starts
    # after it, and a stream's first-token watchdog fires at it at the latest.
    deadline_s: float = Field(60.0, gt=0)


class EstimateConfig(_Strict):
    chars_per_token: float = Field(4.0, gt=0)
    image_tokens: int = Field(576, ge=0)
    tokenizer_file: str | None = None

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
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    stall_after_s: float = Field(10.0, gt=0)
    unhealthy_threshold: int = Field(3, ge=1)
    consecutive_failures: int = Field(5, ge=1)
    eject_base_s: float = Field(30.0, gt=0)
    eject_max_s: float = Field(300.0, gt=0)
    max_ejected_percent: int = Field(50, ge=0, le=100)
    canary_timeout_s: float = Field(10.0, gt=0)
    slow_start_s: float = Field(0.0, ge=0)


class RedisConfig(_Strict):
    url: str | None = None
    timeout_ms: int = Field(50, ge=1)
    heartbeat_s: float = Field(2.0, gt=0)
    ttl_s: float = Field(10.0, gt=0)


class RateLimitsConfig(_Strict):
    requests_per_min: int | None = Field(None, ge=1)
    tokens_per_min: int | None = Field(None, ge=1)


class Policy(_Strict):
    server: ServerConfig = ServerConfig()
    pools: dict[str, PoolConfig] = Field(min_length=1)
    lanes: list[LaneConfig] = Field(min_length=1)
    retry: RetryConfig = RetryConfig()
    estimate: EstimateConfig = EstimateConfig()
    health: HealthConfig = HealthConfig()
    redis: RedisConfig = RedisConfig()
    rate_limits: RateLimitsConfig = RateLimitsConfig()

    def lane(self, name: str) -> LaneConfig:
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise KeyError(name)


# ---------------------------------------------------------------------------- loading


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate mapping keys (PyYAML keeps the last one silently)."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)  # type: ignore[no-untyped-call]
        if key in seen:
            mark = key_node.start_mark
            raise PolicyError([f"line {mark.line + 1}: duplicate key {key!r}"])
        seen.add(key)
    loader.flatten_mapping(node)
    return dict(loader.construct_pairs(node))  # type: ignore[no-untyped-call]


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_unique_mapping,  # type: ignore[arg-type]
)


def parse_yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise PolicyError([f"not valid YAML: {exc}"]) from None


def format_path(loc: tuple[int | str, ...]) -> str:
    """``("lanes", 1, "pool")`` → ``lanes[1].pool``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _shape_problems(exc: ValidationError) -> list[str]:
    problems = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        problems.append(f"{format_path(loc)}: {msg}")
    return problems


def relation_problems(policy: Policy) -> list[str]:
    """Faults between sections that the shape cannot express."""
    problems: list[str] = []
    seen_lanes: set[str] = set()
    last = len(policy.lanes) - 1
    for i, lane in enumerate(policy.lanes):
        where = f"lanes[{i}]"
        if lane.name in seen_lanes:
            problems.append(f"{where}.name: duplicate lane name {lane.name!r}")
        seen_lanes.add(lane.name)
        if lane.pool not in policy.pools:
            problems.append(f"{where}.pool: unknown pool {lane.pool!r}")
        if lane.spill_to is not None:
            if lane.spill_to not in policy.pools:
                problems.append(f"{where}.spill_to: unknown pool {lane.spill_to!r}")
            elif lane.spill_to == lane.pool:
                problems.append(f"{where}.spill_to: spills to its own pool {lane.pool!r}")
        if i == last and lane.when is not None:
            problems.append(
                f"{where}.when: the last lane takes every request left and must have no `when`"
            )
        if i != last and lane.when is None:
            problems.append(
                f"{where}.when: only the last lane may omit `when` (this one would hide the "
                "lanes after it)"
            )
        when = lane.when
        if (
            when is not None
            and when.prompt_tokens_min is not None
            and when.prompt_tokens_max is not None
            and when.prompt_tokens_min > when.prompt_tokens_max
        ):
            problems.append(f"{where}.when: prompt_tokens_min is above prompt_tokens_max")
    for pool_name, pool in policy.pools.items():
        names: set[str] = set()
        urls: set[str] = set()
        for j, replica in enumerate(pool.replicas):
            where = f"pools.{pool_name}.replicas[{j}]"
            if replica.label in names:
                problems.append(f"{where}.name: duplicate replica name {replica.label!r}")
            if replica.url in urls:
                problems.append(f"{where}.url: duplicate replica URL {replica.url!r}")
            names.add(replica.label)
            urls.add(replica.url)
    if policy.health.eject_max_s < policy.health.eject_base_s:
        problems.append("health.eject_max_s: below health.eject_base_s")
    if policy.redis.ttl_s <= policy.redis.heartbeat_s:
        # The load key would expire before its next rewrite: a live instance would flicker.
        problems.append("redis.ttl_s: must be above redis.heartbeat_s")
    return problems


def build_policy(data: Any) -> Policy:
    """Validate plain data (parsed YAML with overrides applied) into a ``Policy``."""
    if not isinstance(data, Mapping):
        raise PolicyError(["(top level): expected a mapping with `pools` and `lanes`"])
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(_shape_problems(exc)) from None
    problems = relation_problems(policy)
    if problems:
        raise PolicyError(problems)
    return policy


def env_overrides(environ: Mapping[str, str]) -> list[tuple[list[str], Any]]:
    """``TOKENLANE_SERVER__PORT=9000`` → ``(["server", "port"], 9000)``.

    Only variables with ``__`` count: the single-level ones (``TOKENLANE_ADMIN_TOKEN``,
    ``TOKENLANE_API_KEYS``) are secrets the policy points at, not policy keys. Values are read as
    YAML scalars so that ``true``, ``1.5`` and ``null`` mean what they say.
    """
    out = []
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX) :].split("__")]
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        out.append((path, value))
    return sorted(out)


def apply_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node: Any = data
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise PolicyError([f"{ENV_PREFIX}{'__'.join(path).upper()}: no such list item"])
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
            continue
        # Pool names are free text; match them without regard to case.
        match = next((k for k in node if isinstance(k, str) and k.lower() == part), part)
        if last:
            node[match] = value
        else:
            node = node.setdefault(match, {})
            if not isinstance(node, (dict, list)):
                raise PolicyError([f"{ENV_PREFIX}{'__'.join(path).upper()}: not a section"])


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
    return policy_from_text(text, environ=environ, overrides=overrides)


def policy_from_text(
    text: str,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Policy:
    data = parse_yaml(text)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(["(top level): expected a mapping with `pools` and `lanes`"])
    for env_path, value in env_overrides(os.environ if environ is None else environ):
        apply_override(data, env_path, value)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            apply_override(data, dotted.split("."), value)
    return build_policy(data)


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
