"""vLLM wire knowledge the health loop needs: which ``/metrics`` series say how busy a replica is
and whether it generates, under their current and older names, and what a canary looks like.

The scrape parser is deliberately not a Prometheus parser. A vLLM scrape is ~600 lines, of which
the detectors need ten samples; ``prometheus_client``'s parser builds every family, sample and
label dict (milliseconds per scrape, on the event loop, per replica, every second). Here each
wanted name is found with ``str.find`` (a memchr-speed scan) and only its own lines are read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.errors import ScrapeError


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape, summed over label sets (engines, model names). Counters are totals since the
    replica started; ``kv_cache_usage`` is a fraction 0–1 (the mean over engines)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    prompt_tokens_total: float = 0.0
    generation_tokens_total: float = 0.0
    prefix_cache_queries_total: float = 0.0
    prefix_cache_hits_total: float = 0.0
    # KV capacity from vllm:cache_config_info's labels (0 when not reported).
    num_gpu_blocks: float = 0.0
    block_size: float = 0.0


# field -> names in order of preference: the V1 name first, then the name older vLLM used.
# When a version exports both (0.10.x), only the first found is read, never their sum.
SERIES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prompt_tokens_total": ("vllm:prompt_tokens_total",),
    "generation_tokens_total": ("vllm:generation_tokens_total",),
    "prefix_cache_queries_total": (
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries_total",
    ),
    "prefix_cache_hits_total": (
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits_total",
    ),
}
# OpenMetrics output of prometheus_client >= 0.22 escapes ':' in sample names to '_'. The health
# loop asks for the plain text format, but a proxy in between may not: accept that spelling last.
SERIES = {f: names + tuple(n.replace(":", "_", 1) for n in names) for f, names in SERIES.items()}
# Gauges that are fractions per engine: averaging is the only sum that stays a fraction.
MEAN_FIELDS = frozenset({"kv_cache_usage"})
# The fields a scrape must carry to be of any use to the stall detector.
REQUIRED_FIELDS = ("running", "prompt_tokens_total", "generation_tokens_total")


def _samples(text: str, name: str) -> list[float]:
    """Values of every sample of ``name`` (any labels), in the order they appear.

    A sample line is ``name{labels} value [timestamp]`` or ``name value [timestamp]`` at the
    start of a line. Names that merely start with ``name`` (``..._by_reason``, ``_created``) are
    skipped by checking the character after it.
    """
    out: list[float] = []
    needle = "\n" + name
    skip = len(needle)
    # The text may start with the sample itself; pretend a newline precedes it.
    pos = -1 if text.startswith(name) else text.find(needle)
    found = pos != -1 or text.startswith(name)
    while found:
        start = pos + skip
        nxt = text[start : start + 1]
        if nxt == "{" or nxt == " " or nxt == "\t":
            end = text.find("\n", start)
            line = text[start:] if end == -1 else text[start:end]
            if nxt == "{":
                # Label values may hold spaces but no raw newline; the value follows the last '}'.
                line = line[line.rfind("}") + 1 :]
            parts = line.split(None, 1)
            if parts:
                try:
                    out.append(float(parts[0]))
                except ValueError:
                    pass  # a malformed sample is skipped, not fatal
        pos = text.find(needle, start)
        found = pos != -1
    return out


def _cache_config(text: str) -> dict[str, float]:
    """``num_gpu_blocks`` and ``block_size`` from the labels of ``vllm:cache_config_info``."""
    pos = text.find("\nvllm:cache_config_info{")
    if pos == -1:
        return {}
    end = text.find("}", pos)
    labels = text[pos : end if end != -1 else len(text)]
    out: dict[str, float] = {}
    for field in ("num_gpu_blocks", "block_size"):
        # Preceded by '{' or ',': "hash_block_size" must not pass for "block_size".
        at = labels.find(f'{{{field}="')
        if at == -1:
            at = labels.find(f',{field}="')
        if at == -1:
            continue
        start = at + len(field) + 3
        try:
            out[field] = float(labels[start : labels.find('"', start)])
        except ValueError:
            pass  # "None" before the engine has sized its cache
    return out


def parse_metrics(text: str) -> EngineSample:
    """Read the engine series from a ``/metrics`` body (Prometheus text 0.0.4 or 1.0.0).

    Raises ``ScrapeError`` when the running count or the token counters are missing: a page
    without them cannot tell busy from idle, and the caller must treat the stats as stale.
    """
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    values: dict[str, float] = {}
    for field, names in SERIES.items():
        for name in names:
            found = _samples(text, name)
            if found:
                found = [v for v in found if not math.isnan(v)]
                if field in MEAN_FIELDS:
                    values[field] = sum(found) / len(found) if found else 0.0
                else:
                    values[field] = sum(found)
                break
    values.update(_cache_config(text))
    missing = [f for f in REQUIRED_FIELDS if f not in values]
    if missing:
        raise ScrapeError(f"not a vLLM metrics page: no {', '.join(SERIES[f][0] for f in missing)}")
    return EngineSample(**values)


# ---------------------------------------------------------------------------- canary

CANARY_PATH = "/v1/completions"


def canary_request(model: str) -> dict[str, Any]:
    """A real one-token completion: the cheapest request that needs the engine to step.

    ``/v1/completions`` rather than chat: it needs no chat template, so it works for base
    models too. Greedy and unstreamed: the response can only arrive after the token exists.
    """
    return {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0, "stream": False}


def canary_succeeded(status: int, body: bytes) -> bool:
    """A 200 whose completion carries a choice (and, when usage is reported, ≥ 1 token)."""
    if status != 200:
        return False
    try:
        data = json.loads(body)
    except ValueError:
        return False
    if not isinstance(data, Mapping) or "error" in data:
        return False
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    usage = data.get("usage")
    if isinstance(usage, Mapping) and isinstance(usage.get("completion_tokens"), int):
        return usage["completion_tokens"] >= 1
    return True


def model_cards(body: Any) -> dict[str, dict[str, Any]]:
    """``GET /v1/models`` → ``{id: card}``; raises ``ValueError`` on a body of another shape."""
    if not isinstance(body, Mapping) or not isinstance(body.get("data"), list):
        raise ValueError("not a model list")
    return {
        m["id"]: m for m in body["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)
    }
