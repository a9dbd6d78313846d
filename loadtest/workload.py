"""What a load test sends and when: traces, scenarios and their arrival schedule. Pure.

A **trace** (JSONL, JSON or YAML list) says exactly what to send and when, one request per
row. A **scenario** (YAML) describes traffic instead: open-loop Poisson arrivals at ``rate``
for ``duration_s``, drawn from a ``mix`` of classes with length distributions; it becomes a
trace with a seed, so the same scenario file sends the same requests every time.

Validation reports every problem at once, each named by where it is (``[3].max_tokens:
required``, ``mix[1].weight: ...``). Nothing here touches the network; ``load_trace`` and
``load_scenario`` only read the file they are given.

Length: one job, the pure workload model (traces, scenarios, arrivals) with the validation that
names every problem.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "ClassSpec",
    "Dist",
    "LoadTestError",
    "Scenario",
    "TraceError",
    "TraceRequest",
    "load_scenario",
    "load_trace",
    "parse_dist",
    "parse_scenario",
    "parse_trace",
    "poisson_arrivals",
    "scenario_requests",
]


class LoadTestError(Exception):
    """The run cannot start (bad input, no model to use); the message says why."""


class TraceError(LoadTestError, ValueError):
    """A trace or scenario file is wrong. ``problems`` lists each one with its location."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = list(problems)
        shown = self.problems[:20]
        more = len(self.problems) - len(shown)
        text = "\n".join(f"  {p}" for p in shown) + (f"\n  ... and {more} more" if more else "")
        super().__init__(f"{source}:\n{text}")


# --------------------------------------------------------------------------------------------
# What to send


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. ``prefix_tokens`` of the prompt are shared by every request
    of the run (same text), so a server with prefix caching can reuse them."""

    at_ms: float
    cls: str
    prompt_tokens: int
    max_tokens: int
    prefix_tokens: int = 0
    stream: bool = True
    model: str | None = None
    priority: int | None = None
    ttft_slo_ms: float | None = None


# Optional fields that trace rows and scenario classes share.
SHARED_KEYS = ("prefix_tokens", "stream", "model", "priority", "ttft_slo_ms")
TRACE_REQUIRED = ("at_ms", "class", "prompt_tokens", "max_tokens")
TRACE_KEYS = {*TRACE_REQUIRED, *SHARED_KEYS}


class _Problems:
    """Collects problems with their locations instead of stopping at the first."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, where: str, what: str) -> None:
        self.items.append(f"{where}: {what}" if where else what)

    def unknown_keys(self, where: str, data: Mapping[str, Any], allowed: set[str]) -> None:
        for key in data:
            if key not in allowed:
                self.add(_join(where, str(key)), f"unknown key (expected one of {_list(allowed)})")

    def number(
        self, where: str, value: Any, *, minimum: float | None = None, positive: bool = False
    ) -> float | None:
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            self.add(where, f"must be a number, got {value!r}")
            return None
        if positive and value <= 0:
            self.add(where, f"must be greater than 0, got {value!r}")
            return None
        if minimum is not None and value < minimum:
            self.add(where, f"must be at least {minimum:g}, got {value!r}")
            return None
        return float(value)

    def integer(self, where: str, value: Any, *, minimum: int | None = None) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            self.add(where, f"must be an integer, got {value!r}")
            return None
        if minimum is not None and value < minimum:
            self.add(where, f"must be at least {minimum}, got {value!r}")
            return None
        return value

    def boolean(self, where: str, value: Any) -> bool | None:
        if not isinstance(value, bool):
            self.add(where, f"must be true or false, got {value!r}")
            return None
        return value

    def text(self, where: str, value: Any) -> str | None:
        if not isinstance(value, str) or not value.strip():
            self.add(where, f"must be a non-empty string, got {value!r}")
            return None
        return value


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _list(keys: set[str]) -> str:
    return ", ".join(sorted(keys))


def _required(
    data: Mapping[str, Any], where: str, keys: Sequence[str], problems: _Problems
) -> None:
    for key in keys:
        if key not in data:
            problems.add(_join(where, key), "required")


def _shared_fields(data: Mapping[str, Any], where: str, problems: _Problems) -> dict[str, Any]:
    """The optional fields trace rows and scenario classes share, validated (None if bad)."""
    out: dict[str, Any] = {
        "prefix_tokens": problems.integer(
            _join(where, "prefix_tokens"), data.get("prefix_tokens", 0), minimum=0
        ),
        "stream": problems.boolean(_join(where, "stream"), data.get("stream", True)),
        "model": None,
        "priority": None,
        "ttft_slo_ms": None,
    }
    if data.get("model") is not None:
        out["model"] = problems.text(_join(where, "model"), data["model"])
    if data.get("priority") is not None:
        out["priority"] = problems.integer(_join(where, "priority"), data["priority"])
    if data.get("ttft_slo_ms") is not None:
        out["ttft_slo_ms"] = problems.number(
            _join(where, "ttft_slo_ms"), data["ttft_slo_ms"], positive=True
        )
    return out


def _parse_row(row: Any, where: str, problems: _Problems) -> TraceRequest | None:
    if not isinstance(row, dict):
        problems.add(where, f"must be a mapping of fields, got {type(row).__name__}")
        return None
    before = len(problems.items)
    problems.unknown_keys(where, row, TRACE_KEYS)
    _required(row, where, TRACE_REQUIRED, problems)
    at_ms = problems.number(_join(where, "at_ms"), row["at_ms"], minimum=0) if "at_ms" in row else 0
    cls = problems.text(_join(where, "class"), row["class"]) if "class" in row else ""
    sizes: dict[str, Any] = {
        key: problems.integer(_join(where, key), row[key], minimum=1) if key in row else 1
        for key in ("prompt_tokens", "max_tokens")
    }
    shared = _shared_fields(row, where, problems)
    prefix, prompt = shared["prefix_tokens"], sizes["prompt_tokens"]
    if prefix is not None and prompt is not None and prefix > prompt:
        problems.add(
            _join(where, "prefix_tokens"), f"{prefix} is more than prompt_tokens ({prompt})"
        )
    if len(problems.items) > before:
        return None
    assert at_ms is not None and cls is not None  # a problem was added otherwise
    return TraceRequest(at_ms=at_ms, cls=cls, **sizes, **shared)


def parse_trace(
    rows: Any, source: str = "trace", *, where: Callable[[int], str] | None = None
) -> list[TraceRequest]:
    """Validate trace rows (plain data) into requests sorted by arrival time.

    Every problem is reported, each named by its row: ``[3].max_tokens: required``.
    """
    if not isinstance(rows, list):
        raise TraceError(source, [f"a trace is a list of requests, got {type(rows).__name__}"])
    if not rows:
        raise TraceError(source, ["the trace has no requests"])
    name = where or (lambda i: f"[{i}]")
    problems = _Problems()
    parsed = [_parse_row(row, name(i), problems) for i, row in enumerate(rows)]
    if problems.items:
        raise TraceError(source, problems.items)
    requests = [r for r in parsed if r is not None]
    return sorted(requests, key=lambda r: r.at_ms)  # stable: ties keep file order


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a trace: ``.jsonl`` / ``.ndjson`` (one JSON object per line; blank lines and
    lines starting with ``#`` skipped), ``.json`` (a list), anything else YAML (a list)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(str(path), [f"cannot read: {exc.strerror or exc}"]) from exc
    if path.suffix in (".jsonl", ".ndjson"):
        rows: list[Any] = []
        lines: list[int] = []
        problems = _Problems()
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                rows.append(json.loads(line))
                lines.append(number)
            except ValueError as exc:
                problems.add(f"line {number}", f"not JSON: {exc}")
        if problems.items:
            raise TraceError(str(path), problems.items)
        return parse_trace(rows, str(path), where=lambda i: f"line {lines[i]}")
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise TraceError(str(path), [f"cannot parse: {exc}"]) from exc
    return parse_trace(data, str(path))


# --------------------------------------------------------------------------------------------
# Scenarios


DIST_KEYS = {
    "uniform": ({"min", "max"}, set()),
    "normal": ({"mean", "std"}, {"min", "max"}),
    "lognormal": ({"median", "sigma"}, {"min", "max"}),
}


@dataclass(frozen=True, slots=True)
class Dist:
    """A token count: fixed, or drawn from ``uniform`` (min..max inclusive), ``normal``
    (mean, std) or ``lognormal`` (median, sigma of the log); the last two optionally clipped
    to min/max. Draws are rounded and never below 1."""

    kind: str  # "fixed" | "uniform" | "normal" | "lognormal"
    params: Mapping[str, float] = field(default_factory=dict)

    def sample(self, rng: random.Random) -> int:
        p = self.params
        if self.kind == "fixed":
            return int(p["value"])
        if self.kind == "uniform":
            return rng.randint(int(p["min"]), int(p["max"]))
        if self.kind == "normal":
            x = rng.gauss(p["mean"], p["std"])
        else:
            x = p["median"] * math.exp(rng.gauss(0.0, p["sigma"]))
        x = max(x, p.get("min", 1.0))
        x = min(x, p.get("max", math.inf))
        return max(1, round(x))

    def lowest(self) -> int:
        """The smallest value this can draw."""
        if self.kind == "fixed":
            return int(self.params["value"])
        return max(1, math.ceil(self.params.get("min", 1)))

    def to_json(self) -> Any:
        return (
            int(self.params["value"])
            if self.kind == "fixed"
            else {"dist": self.kind, **self.params}
        )


def parse_dist(value: Any, where: str, problems: _Problems) -> Dist | None:
    if not isinstance(value, dict):
        n = problems.integer(where, value, minimum=1)
        return None if n is None else Dist("fixed", {"value": n})
    kind = value.get("dist")
    if kind not in DIST_KEYS:
        problems.add(_join(where, "dist"), f"must be one of {_list(set(DIST_KEYS))}, got {kind!r}")
        return None
    required, optional = DIST_KEYS[kind]
    before = len(problems.items)
    problems.unknown_keys(where, value, required | optional | {"dist"})
    params: dict[str, float] = {}
    for key in sorted(required | optional):
        if key not in value:
            if key in required:
                problems.add(_join(where, key), "required")
            continue
        x = problems.number(_join(where, key), value[key], minimum=0)
        if x is not None:
            params[key] = x
    if len(problems.items) > before:
        return None
    if "min" in params and "max" in params and params["min"] > params["max"]:
        problems.add(where, f"min ({params['min']:g}) is more than max ({params['max']:g})")
        return None
    if kind == "uniform" and params["max"] < 1:
        problems.add(_join(where, "max"), "must be at least 1")
        return None
    if kind == "lognormal" and params["median"] <= 0:
        problems.add(_join(where, "median"), "must be greater than 0")
        return None
    return Dist(kind, params)


@dataclass(frozen=True, slots=True)
class ClassSpec:
    name: str
    weight: float
    prompt_tokens: Dist
    max_tokens: Dist
    prefix_tokens: int = 0
    stream: bool = True
    ttft_slo_ms: float | None = None
    priority: int | None = None
    model: str | None = None


@dataclass(frozen=True, slots=True)
class Scenario:
    rate: float  # requests per second, mean of the Poisson process
    duration_s: float
    mix: tuple[ClassSpec, ...]
    seed: int = 0
    model: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "duration_s": self.duration_s,
            "seed": self.seed,
            "model": self.model,
            "mix": [
                {
                    "class": c.name,
                    "weight": c.weight,
                    "prompt_tokens": c.prompt_tokens.to_json(),
                    "max_tokens": c.max_tokens.to_json(),
                    "prefix_tokens": c.prefix_tokens,
                    "stream": c.stream,
                    "ttft_slo_ms": c.ttft_slo_ms,
                    "priority": c.priority,
                    "model": c.model,
                }
                for c in self.mix
            ],
        }


SCENARIO_KEYS = {"rate", "duration_s", "mix", "seed", "model"}
CLASS_KEYS = {"class", "weight", "prompt_tokens", "max_tokens", *SHARED_KEYS}


def _parse_class(data: Any, where: str, problems: _Problems) -> ClassSpec | None:
    if not isinstance(data, dict):
        problems.add(where, f"must be a mapping, got {type(data).__name__}")
        return None
    before = len(problems.items)
    problems.unknown_keys(where, data, CLASS_KEYS)
    _required(data, where, ("class", "prompt_tokens", "max_tokens"), problems)
    name = problems.text(_join(where, "class"), data["class"]) if "class" in data else None
    weight = problems.number(_join(where, "weight"), data.get("weight", 1), positive=True)
    sizes: dict[str, Any] = {
        key: parse_dist(data[key], _join(where, key), problems) if key in data else None
        for key in ("prompt_tokens", "max_tokens")
    }
    shared = _shared_fields(data, where, problems)
    if len(problems.items) > before:
        return None
    assert name is not None and weight is not None  # a problem was added otherwise
    return ClassSpec(name=name, weight=weight, **sizes, **shared)


def parse_scenario(data: Any, source: str = "scenario") -> Scenario:
    """Validate a scenario (plain data); every problem is named by its path (``mix[1].weight``)."""
    if not isinstance(data, dict):
        raise TraceError(source, [f"a scenario is a mapping, got {type(data).__name__}"])
    problems = _Problems()
    problems.unknown_keys("", data, SCENARIO_KEYS)
    for key in ("rate", "duration_s", "mix"):
        if key not in data:
            problems.add(key, "required")
    rate = problems.number("rate", data["rate"], positive=True) if "rate" in data else None
    duration = (
        problems.number("duration_s", data["duration_s"], positive=True)
        if "duration_s" in data
        else None
    )
    seed = problems.integer("seed", data.get("seed", 0))
    model = data.get("model")
    if model is not None:
        model = problems.text("model", model)
    mix: list[ClassSpec] = []
    raw_mix = data.get("mix")
    if "mix" in data and (not isinstance(raw_mix, list) or not raw_mix):
        problems.add("mix", "must be a non-empty list of classes")
    elif isinstance(raw_mix, list):
        for i, item in enumerate(raw_mix):
            spec = _parse_class(item, f"mix[{i}]", problems)
            if spec is not None:
                mix.append(spec)
        seen: set[str] = set()
        for i, spec in enumerate(mix):
            if spec.name in seen:
                problems.add(f"mix[{i}].class", f"duplicate class {spec.name!r}")
            seen.add(spec.name)
    if problems.items:
        raise TraceError(source, problems.items)
    assert rate is not None and duration is not None and seed is not None
    return Scenario(rate, duration, tuple(mix), seed, model)


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TraceError(str(path), [f"cannot read: {exc.strerror or exc}"]) from exc
    except yaml.YAMLError as exc:
        raise TraceError(str(path), [f"cannot parse: {exc}"]) from exc
    return parse_scenario(data, str(path))


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times (seconds from 0, below ``duration_s``) of a Poisson process of ``rate``
    per second: exponential gaps with mean 1/rate."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration_s must be greater than 0")
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def scenario_requests(scenario: Scenario) -> list[TraceRequest]:
    """The trace a scenario stands for, the same for the same seed.

    Arrival times and request shapes come from separate random streams, so editing the mix
    does not move the arrivals. A prefix longer than a drawn prompt is cut to the prompt.
    """
    arrivals = poisson_arrivals(
        scenario.rate, scenario.duration_s, random.Random(f"{scenario.seed}:arrivals")
    )
    rng = random.Random(f"{scenario.seed}:shapes")
    weights = [c.weight for c in scenario.mix]
    out: list[TraceRequest] = []
    for t in arrivals:
        spec = rng.choices(scenario.mix, weights)[0]
        prompt = spec.prompt_tokens.sample(rng)
        out.append(
            TraceRequest(
                at_ms=t * 1000,
                cls=spec.name,
                prompt_tokens=prompt,
                max_tokens=spec.max_tokens.sample(rng),
                prefix_tokens=min(spec.prefix_tokens, prompt),
                stream=spec.stream,
                model=spec.model or scenario.model,
                priority=spec.priority,
                ttft_slo_ms=spec.ttft_slo_ms,
            )
        )
    return out
