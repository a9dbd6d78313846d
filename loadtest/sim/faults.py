"""The simulator's fault contract (docs/architecture.md, "The simulator"), as plain data:
which faults exist, their parameters, and how a request body or command-line flags become a
:class:`Fault`. Applying one is the server's job (``server.py``); this module only decides what
is valid.

``engine_dead`` is an extension beyond the first fault table: vLLM's EngineCore process dies.
Running streams get the in-stream error event, plain requests in flight and new requests get
HTTP 500, and ``/health`` answers 503 with an empty body, until the fault is lifted (a fresh
engine).

The ``cut_*`` faults end each stream once it has sent ``after_tokens`` tokens (of any choice),
the ways a replica can fail mid-stream: ``cut_close`` ends the HTTP response without
``[DONE]``, ``cut_reset`` resets the connection (TCP RST), ``cut_error`` sends vLLM's in-band
error event and ``[DONE]``, ``cut_abort`` finishes with ``finish_reason: "abort"`` as vLLM does
for a request aborted in the engine. ``stall`` with ``after_tokens`` freezes the engine when
some request is about to get a token past that many.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# name -> {parameter: (kind, default or REQUIRED, minimum, maximum)}
REQUIRED = object()
FAULTS: dict[str, dict[str, tuple[type, Any, float, float]]] = {
    "stall": {"after_tokens": (int, None, 0, math.inf)},
    "slow": {"factor": (float, REQUIRED, 0.0, math.inf)},
    "error_rate": {"rate": (float, REQUIRED, 0.0, 1.0), "status": (int, 500, 400, 599)},
    "health_fail": {"status": (int, 503, 100, 599)},
    "refuse": {},
    "hang_accept": {},
    "crash": {},
    "engine_dead": {},
    "cut_close": {"after_tokens": (int, REQUIRED, 0, math.inf)},
    "cut_reset": {"after_tokens": (int, REQUIRED, 0, math.inf)},
    "cut_error": {"after_tokens": (int, REQUIRED, 0, math.inf), "status": (int, 500, 400, 599)},
    "cut_abort": {"after_tokens": (int, REQUIRED, 0, math.inf)},
}
# Faults that act on each stream at a token position (see Generation in generation.py).
CUTS = frozenset({"cut_close", "cut_reset", "cut_error", "cut_abort"})
# These make the port unreachable: over HTTP they need duration_s, the only way back.
UNREACHABLE = frozenset({"refuse", "hang_accept", "crash"})


class FaultError(ValueError):
    """An invalid fault request; the message says which key is wrong."""


@dataclass(frozen=True)
class Fault:
    name: str
    params: dict[str, float | int] = field(default_factory=dict)
    duration_s: float | None = None

    def describe(self, remaining_s: float | None = None) -> dict[str, Any]:
        """The JSON of ``GET /sim/fault``: the fault and its parameters as sibling keys."""
        out: dict[str, Any] = {"fault": self.name, **self.params, "duration_s": self.duration_s}
        if remaining_s is not None:
            out["remaining_s"] = round(max(0.0, remaining_s), 3)
        return out


def parse(body: Any, *, require_duration: bool = True) -> Fault | None:
    """``{"fault": "slow", "factor": 3, "duration_s": 10}`` -> a Fault; ``{"fault": null}`` -> None.

    With ``require_duration`` (requests over HTTP), faults that make the port unreachable must
    carry ``duration_s``: nothing could lift them otherwise.
    """
    if not isinstance(body, Mapping) or "fault" not in body:
        raise FaultError('the body must be an object with a "fault" key (null lifts the fault)')
    name = body["fault"]
    if name is None:
        extra = set(body) - {"fault"}
        if extra:
            raise FaultError(f"unexpected keys with fault null: {sorted(extra)}")
        return None
    if not isinstance(name, str) or name not in FAULTS:
        raise FaultError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    spec = FAULTS[name]
    unknown = set(body) - {"fault", "duration_s", *spec}
    if unknown:
        raise FaultError(f"{name}: unknown parameter(s) {sorted(unknown)}; known: {sorted(spec)}")
    params: dict[str, float | int] = {}
    for key, (kind, default, low, high) in spec.items():
        if key not in body or body[key] is None:
            if default is REQUIRED:
                raise FaultError(f"{name}: parameter {key!r} is required")
            if default is not None:  # an optional parameter without a default stays absent
                params[key] = default
            continue
        params[key] = _number(f"{name}.{key}", body[key], kind, low, high)
    duration = body.get("duration_s")
    if duration is not None:
        duration = float(_number("duration_s", duration, float, 0.0, math.inf))
        if duration <= 0:
            raise FaultError("duration_s must be > 0")
    if require_duration and name in UNREACHABLE and duration is None:
        raise FaultError(f"{name} makes the port unreachable: duration_s is required")
    return Fault(name, params, duration)


def _number(where: str, value: Any, kind: type, low: float, high: float) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FaultError(f"{where} must be a number, got {value!r}")
    if kind is int and float(value) != int(value):
        raise FaultError(f"{where} must be an integer, got {value!r}")
    if not low <= value <= high or (kind is float and not math.isfinite(value)):
        raise FaultError(f"{where} must be between {low:g} and {high:g}, got {value!r}")
    return int(value) if kind is int else float(value)


def from_cli(name: str | None, params: Sequence[str], json_text: str | None) -> Fault | None:
    """``--fault NAME --fault-param key=value ...`` or ``--fault-json '{...}'``."""
    if json_text is not None:
        if name is not None or params:
            raise FaultError("--fault-json excludes --fault and --fault-param")
        try:
            parsed = json.loads(json_text)
        except json.JSONDecodeError as exc:
            raise FaultError(f"--fault-json is not JSON: {exc}") from None
        return parse(parsed, require_duration=False)
    if name is None:
        if params:
            raise FaultError("--fault-param needs --fault")
        return None
    body: dict[str, Any] = {"fault": name}
    for item in params:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise FaultError(f"--fault-param expects key=value, got {item!r}")
        try:
            body[key] = json.loads(raw)
        except json.JSONDecodeError:
            body[key] = raw  # reported as "must be a number" by parse()
    return parse(body, require_duration=False)
