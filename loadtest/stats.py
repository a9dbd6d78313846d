"""What one load-test request measured, and the summaries made from many: pure, no I/O.

``RequestResult`` is the record the client fills and every report reads. The summaries are
per traffic class: percentiles of TTFT, inter-token latency and end-to-end time, counts by
status, and goodput, the share of requests that completed and met their TTFT objective.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

QUANTILES = (50, 90, 99)

# outcome values
OK = "ok"
HTTP_ERROR = "http_error"  # a status other than 200
STREAM_ERROR = "stream_error"  # HTTP 200, then an error event in the stream
INCOMPLETE = "incomplete"  # the response ended (or broke) before it was complete
CONNECT_ERROR = "connect_error"  # no response at all
TIMEOUT = "timeout"  # the client's own deadline ran out
PENDING = "pending"  # not sent (yet)


@dataclass(slots=True)
class RequestResult:
    """One request: what was asked (filled by the runner) and what came back (by the client).

    Times are seconds. ``scheduled_s`` and ``start_s`` count from the start of the run (their
    difference is the load generator's own lateness); the others from this request's send.
    ``ttft_s`` is the first chunk carrying content (text, tool call or audio; never the
    role-only first chunk); for a non-streamed response it is the whole response time.
    """

    index: int
    cls: str
    stream: bool
    prompt_tokens: int
    max_tokens: int
    scheduled_s: float
    ttft_slo_s: float | None = None
    model: str = ""
    start_s: float = 0.0
    outcome: str = PENDING
    status: int = 0  # HTTP status; 0 when none arrived
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    content_chunks: int = 0
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    error: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # The streamed text, kept only when the sender sets it to a list (a benchmark comparing
    # answers); None costs the load generator nothing.
    text: list[str] | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == OK

    @property
    def output_tokens(self) -> int:
        """Reported usage when the server sent it, else the content chunks counted."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return self.content_chunks

    @property
    def met_slo(self) -> bool:
        """Completed, and within the TTFT objective when there is one: what goodput counts."""
        if not self.ok:
            return False
        if self.ttft_slo_s is None:
            return True
        return self.ttft_s is not None and self.ttft_s <= self.ttft_slo_s

    @property
    def status_label(self) -> str:
        """``200`` when ok, the HTTP status for HTTP errors, else the outcome's name."""
        if self.outcome == OK:
            return str(self.status)
        if self.outcome == HTTP_ERROR:
            return str(self.status)
        return self.outcome

    def to_json(self) -> dict[str, Any]:
        """A JSON row. Inter-token gaps are summarised, not listed: long runs hold millions."""
        itl = sorted(self.itl_s)
        return {
            "index": self.index,
            "class": self.cls,
            "model": self.model,
            "stream": self.stream,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "scheduled_s": _r(self.scheduled_s),
            "start_s": _r(self.start_s),
            "outcome": self.outcome,
            "status": self.status,
            "ttft_s": _r(self.ttft_s),
            "ttft_slo_s": self.ttft_slo_s,
            "met_slo": self.met_slo,
            "e2e_s": _r(self.e2e_s),
            "itl": {
                "n": len(itl),
                "mean_s": _r(sum(itl) / len(itl)) if itl else None,
                "p50_s": _r(percentile_sorted(itl, 50)),
                "p99_s": _r(percentile_sorted(itl, 99)),
                "max_s": _r(itl[-1]) if itl else None,
            },
            "content_chunks": self.content_chunks,
            "usage_prompt_tokens": self.usage_prompt_tokens,
            "usage_completion_tokens": self.usage_completion_tokens,
            "output_tokens": self.output_tokens,
            "error": self.error,
            "headers": self.headers,
        }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def percentile_sorted(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) of already sorted values, interpolated linearly between
    closest ranks (numpy's default), or None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0-100, got {q}")
    pos = (len(values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def percentile(values: Iterable[float], q: float) -> float | None:
    return percentile_sorted(sorted(values), q)


def distribution(values: Iterable[float]) -> dict[str, float | None]:
    """p50/p90/p99, mean and max of a set of values (all None when empty)."""
    ordered = sorted(values)
    out: dict[str, float | None] = {f"p{q}": percentile_sorted(ordered, q) for q in QUANTILES}
    out["mean"] = sum(ordered) / len(ordered) if ordered else None
    out["max"] = ordered[-1] if ordered else None
    out["n"] = len(ordered)
    return out


def goodput(results: Sequence[RequestResult]) -> float | None:
    """Share of requests that completed and met their TTFT objective; None for no requests."""
    if not results:
        return None
    return sum(1 for r in results if r.met_slo) / len(results)


def summarize_class(results: Sequence[RequestResult], duration_s: float | None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    slos = sorted({r.ttft_slo_s for r in results if r.ttft_slo_s is not None})
    met = sum(1 for r in results if r.met_slo)
    out_tokens = sum(r.output_tokens for r in ok)
    rate = duration_s if duration_s and duration_s > 0 else None
    return {
        "n": len(results),
        "ok": len(ok),
        "statuses": dict(sorted(Counter(r.status_label for r in results).items())),
        # Latencies of completed requests only: a failure's "TTFT" is not one.
        "ttft_s": distribution(r.ttft_s for r in ok if r.ttft_s is not None),
        "itl_s": distribution(x for r in ok for x in r.itl_s),
        "e2e_s": distribution(r.e2e_s for r in ok if r.e2e_s is not None),
        "ttft_slo_s": slos[0] if len(slos) == 1 else (slos or None),
        "met_slo": met,
        "goodput": goodput(results),
        "goodput_rps": met / rate if rate else None,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / rate if rate else None,
    }


def summarize(results: Sequence[RequestResult], duration_s: float | None = None) -> dict[str, Any]:
    """Per-class summaries (classes in order of first appearance) and one for all requests."""
    by_class: dict[str, list[RequestResult]] = {}
    for r in results:
        by_class.setdefault(r.cls, []).append(r)
    return {
        "classes": {c: summarize_class(rs, duration_s) for c, rs in by_class.items()},
        "all": summarize_class(results, duration_s),
    }


def lateness(results: Sequence[RequestResult]) -> dict[str, float | None]:
    """How late the generator sent requests versus their schedule. Large values mean the
    load generator, not the server, was the bottleneck, and the run was not open-loop."""
    sent = [r for r in results if r.outcome != PENDING]
    late = distribution(max(0.0, r.start_s - r.scheduled_s) for r in sent)
    return {"p50_s": _r(late["p50"]), "p99_s": _r(late["p99"]), "max_s": _r(late["max"])}


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}" if value >= 0.1 else f"{value * 1000:.1f}"


def _triple(dist: dict[str, Any], fmt: Any) -> str:
    return "/".join(fmt(dist[f"p{q}"]) for q in QUANTILES)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_summary(summary: dict[str, Any]) -> str:
    """A plain-text table: one row per class and one for all, then status counts."""
    header = (
        f"{'class':<12} {'n':>6} {'ok':>6}  {'TTFT p50/p90/p99 ms':>22}  "
        f"{'ITL p50/p90/p99 ms':>20}  {'e2e p50/p90/p99 s':>20}  {'goodput':>7}"
    )
    lines = [header]
    rows = list(summary["classes"].items())
    if len(rows) != 1:
        rows.append(("all", summary["all"]))
    for name, c in rows:
        good = "-" if c["goodput"] is None else f"{c['goodput'] * 100:.1f}%"
        lines.append(
            f"{name:<12} {c['n']:>6} {c['ok']:>6}  {_triple(c['ttft_s'], _ms):>22}  "
            f"{_triple(c['itl_s'], _ms):>20}  {_triple(c['e2e_s'], _s):>20}  {good:>7}"
        )
    statuses = summary["all"]["statuses"]
    lines.append("status: " + (", ".join(f"{k} x{v}" for k, v in statuses.items()) or "none"))
    return "\n".join(lines)
