"""The policy: what Tokenlane routes where, and how it judges replicas.

The models here are the policy file's schema: each key is declared once with ``key()`` (its
default, description and unit), from which ``proxy.schema`` generates the JSON Schema and
docs/policy.md's table. Reading a file, environment overrides and naming every problem of a
file at its line and column live in ``proxy.policyfile``.

Precedence for every key: command-line flag, then ``TOKENLANE_`` environment variables
(``TOKENLANE_SERVER__PORT=9000``), then the file, then the default here.

Length: one job, the schema: every key the policy file accepts is declared here once, as
docs/policy.md lists them in one table; splitting it would scatter the declarations.
"""

from __future__ import annotations

import ipaddress
from importlib import metadata
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from proxy.errors import TokenizerError
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

# Keys that a reload cannot change (docs/policy.md marks them *restart*); a reload that changes
# one of these is applied for the rest and reported as needing a restart.
RESTART_KEYS: tuple[str, ...] = (
    "server.host",
    "server.port",
    "server.workers",
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
    # Several processes accepting on one port as one gateway (docs/workers.md); `auto` is
    # the CPUs this process may use: the smaller of its affinity and its cgroup's quota.
    workers: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = key(
        1,
        "Worker processes, 1–256 (`auto`: the CPUs allowed by affinity and cgroup quota). "
        "Several act as one gateway: limits, health, metrics and admin are shared.",
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
    # Who may tell the gateway a client's address: from these peers an incoming
    # X-Forwarded-For / Forwarded is kept and the peer appended; from any other, replaced.
    trusted_proxies: list[str] = key(
        [],
        "Peers (CIDRs) whose X-Forwarded-For / Forwarded headers are kept (the peer's address "
        "appended); from any other peer they are replaced by the peer's address.",
    )

    # Browsers' cross-origin calls, answered as vLLM's --allowed-origins does (preflights,
    # Access-Control-* headers); empty: no CORS headers, a preflight is a 405.
    cors_allowed_origins: list[str] = key(
        [],
        "Origins whose browser requests are allowed (CORS), e.g. https://app.example or *; "
        "preflights are answered as vLLM answers them. Empty: no CORS.",
    )

    @field_validator("trusted_proxies")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as exc:
                raise ValueError(f"not a CIDR: {cidr!r}") from exc
        return value

    # A client that stops reading a response holds its replica's slot and sequence: past this
    # long without the client taking a byte (the write buffer full), the stream is cut.
    write_stall_timeout_s: float = key(
        60.0,
        "A response the client reads nothing of for this long (its socket buffer full) is cut, "
        "its upstream request cancelled.",
        "s",
        gt=0,
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
    kv_events: str | None = key(
        None,
        "ZMQ endpoint of the replica's KV cache events as this gateway reaches it (vLLM "
        "`--kv-events-config` `endpoint`, e.g. `tcp://vllm-0:5557`): a `cache_aware` pool then "
        "routes on the blocks the replica really holds.",
    )
    kv_events_replay: str | None = key(
        None,
        "Its replay endpoint (`replay_endpoint`), to fetch batches missed after a gap.",
    )
    kv_events_topic: str = key("", "Its `topic` (the first frame of every event message).")

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
    render_timeout_s: float = key(
        2.0,
        "Precise mode (replicas with `kv_events`): how long to wait for a replica's render "
        "endpoint to give the prompt's token ids; past it the request is routed on the "
        "approximate index.",
        "seconds",
        gt=0,
    )
    events_stale_s: float = key(
        5.0,
        "Precise mode: a replica sent a request this long ago and no event batch since, or its "
        "event stream lost batches it could not replay: it is routed on the approximate index "
        "until its events flow again.",
        "seconds",
        gt=0,
    )
    speculative_s: float = key(
        2.0,
        "Precise mode: a prompt's blocks count as held on the replica it was sent to for this "
        "long, until its own events say so (a burst sees its own placements).",
        "seconds",
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
        30.0,
        "No content within this (noticed within 10 ms) → retried elsewhere if nothing was sent.",
        "s",
        gt=0,
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
        "Also retry 500/502/504, or a reset, received after the request was sent (at most "
        "once). Without it, only a suspect replica's 500/502/504 is replayed "
        "(docs/reliability.md).",
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

    # On by default: an eligible stream's token chunks are read without parsing them, +8-10 %
    # CPU per relayed chunk (docs/benchmarks.md, "What continuation and tracing cost").
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
    # A replica that dies with many streams must not send them all to re-prefill on one
    # survivor at once: a continuation waits (the client gets keep-alives) for a slot, up to
    # start_timeout_s.
    max_in_flight: int = key(
        64, "Continuations re-prefilling at once (start to first token), gateway-wide.",
        "continuations", ge=1,
    )  # fmt: skip
    max_in_flight_per_replica: int = key(
        32, "Continuations re-prefilling at once on one target replica.", "continuations", ge=1
    )
    # What a re-prefill costs the survivor is its tokens, not its count: 32 short streams are
    # a few engine steps, 32 long contexts could stall its other streams for seconds. About
    # four steps of vLLM's chunked-prefill budget (max_num_batched_tokens 8,192) by default.
    max_tokens_in_flight_per_replica: int = key(
        32768,
        "Prompt tokens (the original prompt and the tokens generated) re-prefilling at once on "
        "one target replica; a continuation larger than this still starts alone.",
        "tokens",
        ge=1,
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
