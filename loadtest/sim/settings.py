"""Every setting of one simulated replica, with its default and where the default comes from.

The defaults describe ``vllm serve Qwen/Qwen2.5-0.5B-Instruct`` (V1 engine) on one NVIDIA L4
(24 GB): vLLM's own defaults for a GPU under 70 GiB, and step costs fitted so that the
simulator reproduces a published run of that set-up (see ``loadtest/sim/README.md``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def _s(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class SimSettings:
    # -- identity --------------------------------------------------------------------------
    name: str = _s("sim", "label of this replica in logs and /sim/stats")
    models: tuple[str, ...] = _s(
        (DEFAULT_MODEL,), "served model ids; metrics are labelled with the first (vLLM's rule)"
    )
    api_key: str | None = _s(None, "like vLLM --api-key: /v1/* then needs 'Bearer KEY'")
    seed: int = _s(0, "seed of the output text and of error_rate draws")

    # -- scheduler (vLLM V1 defaults on a GPU under 70 GiB) ---------------------------------
    max_num_seqs: int = _s(256, "most requests running at once")
    max_num_batched_tokens: int | None = _s(
        None,
        "token budget of one step; default 2048 with chunked prefill, else max(max_model_len, "
        "2048), as vLLM picks it",
    )
    enable_chunked_prefill: bool = _s(True, "split long prefills across steps (V1 default on)")
    long_prefill_token_threshold: int = _s(
        0, "cap on one request's prefill tokens per step (0: none, vLLM's default)"
    )
    enable_prefix_caching: bool = _s(True, "reuse cached KV blocks of equal prefixes (V1 default)")
    scheduling_policy: str = _s("fcfs", "fcfs, or priority (lower 'priority' value first)")
    max_model_len: int = _s(32768, "context length (Qwen2.5-0.5B-Instruct's config)")
    block_size: int = _s(16, "tokens per KV block")
    num_gpu_blocks: int = _s(
        94_000,
        "KV blocks: ~18.5 GB left on an L4 at gpu_memory_utilization 0.9 / 196,608 bytes per "
        "block (24 layers x 2 KV heads x 64 dims x K,V x fp16 x 16 tokens)",
    )

    # -- step costs (fitted to the published L4 run, README) ----------------------------------
    step_fixed_s: float = _s(0.00500, "fixed time of every engine step, s")
    decode_per_seq_s: float = _s(0.0000650, "added step time per request in the batch, s")
    prefill_per_token_s: float = _s(0.0000190, "added step time per prefill token computed, s")
    request_overhead_s: float = _s(
        0.0140, "API-server time from receiving a request to the engine's queue, s"
    )
    natural_len_min: int = _s(16, "shortest answer when a request sets no max tokens")
    natural_len_max: int = _s(256, "longest answer when a request sets no max tokens")

    # -- KV cache events ----------------------------------------------------------------------
    kv_events_config: str | None = _s(
        None,
        "like vLLM --kv-events-config: JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\' (kv_events.py)',
    )

    # -- test observability -----------------------------------------------------------------
    request_log_size: int = _s(1000, "requests kept for GET /sim/requests (0: none)")

    @property
    def batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(self.max_model_len, 2048)

    def problems(self) -> list[str]:
        """Every inconsistency, worded like the flag that causes it; empty when valid."""
        out: list[str] = []
        if not isinstance(self.models, tuple) or not self.models or any(not m for m in self.models):
            out.append("--model: at least one non-empty model id is needed")
        for name in ("max_num_seqs", "max_model_len", "block_size", "num_gpu_blocks"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} must be at least 1")
        if self.batched_tokens < 1:
            out.append("--max-num-batched-tokens must be at least 1")
        if self.long_prefill_token_threshold < 0:
            out.append("--long-prefill-token-threshold must be >= 0")
        try:
            options_from_json(self.kv_events_config)
        except ValueError as exc:
            out.append(str(exc))
        if self.scheduling_policy not in ("fcfs", "priority"):
            out.append("--scheduling-policy must be fcfs or priority")
        if not self.enable_chunked_prefill and self.batched_tokens < self.max_model_len:
            # vLLM refuses this too: without chunking a prompt must fit in one step.
            out.append(
                f"--max-num-batched-tokens ({self.batched_tokens}) is smaller than "
                f"--max-model-len ({self.max_model_len}) with chunked prefill disabled"
            )
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            out.append(
                f"--num-gpu-blocks x --block-size ({self.num_gpu_blocks * self.block_size} tokens)"
                f" cannot hold one request of --max-model-len ({self.max_model_len})"
            )
        for name in ("step_fixed_s", "decode_per_seq_s", "prefill_per_token_s"):
            if getattr(self, name) < 0:
                out.append(f"--{name.replace('_', '-')} must be >= 0")
        if self.request_overhead_s < 0:
            out.append("--request-overhead-s must be >= 0")
        if not 1 <= self.natural_len_min <= self.natural_len_max:
            out.append("--natural-len-min must be >= 1 and <= --natural-len-max")
        return out

    def replace(self, **changes: Any) -> SimSettings:
        return dataclasses.replace(self, **changes)


class SettingsError(ValueError):
    """Settings that cannot describe a vLLM server; the message lists every problem."""


def validated(settings: SimSettings) -> SimSettings:
    problems = settings.problems()
    if problems:
        raise SettingsError("; ".join(problems))
    return settings


@dataclass(frozen=True)
class KvEventsOptions:
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    encoding: str = "map"


def options_from_json(text: str | None) -> KvEventsOptions | None:
    """vLLM's ``--kv-events-config`` JSON; None when events are off. ``ValueError`` for junk."""
    if not text:
        return None
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config: a JSON object is needed")
    if not raw.get("enable_kv_cache_events", False):
        return None
    if raw.get("publisher", "zmq") != "zmq":
        raise ValueError("--kv-events-config: only the zmq publisher is simulated")
    unknown = set(raw) - {
        "enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic",
        "buffer_steps", "hwm", "max_queue_size", "encoding",
    }  # fmt: skip
    if unknown:
        raise ValueError(f"--kv-events-config: unknown keys {sorted(unknown)}")
    opts = KvEventsOptions(
        endpoint=str(raw.get("endpoint", "tcp://*:5557")),
        replay_endpoint=raw.get("replay_endpoint"),
        topic=str(raw.get("topic", "")),
        buffer_steps=int(raw.get("buffer_steps", 10_000)),
        encoding=str(raw.get("encoding", "map")),
    )
    if opts.encoding not in ("map", "array"):
        raise ValueError("--kv-events-config: encoding is map or array")
    return opts
