"""PNG plots of a load-test run: TTFT CDF per class, and TTFT over the run's time.

matplotlib is imported inside the functions, and only its object API with the Agg canvas is
used (no pyplot): nothing global changes, no display is needed, and ``tokenlane loadtest
--no-plots`` never pays for the import.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .stats import RequestResult


def _figure(width: float = 8.0, height: float = 5.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _log_scale(ax: Any, which: str) -> None:
    """Log scale labelled in plain numbers (150, not 1.5e2); minor ticks are labelled only
    when the range is narrow enough for them to be needed."""
    from matplotlib import ticker

    if which == "x":
        ax.set_xscale("log")
        axis = ax.xaxis
    else:
        ax.set_yscale("log")
        axis = ax.yaxis
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(1.5, 0.5)))


def _by_class(results: Sequence[RequestResult]) -> dict[str, list[RequestResult]]:
    groups: dict[str, list[RequestResult]] = {}
    for r in results:
        groups.setdefault(r.cls, []).append(r)
    return groups


def plot_ttft_cdf(results: Sequence[RequestResult], path: Path) -> Path:
    """One step line per class: the share of completed requests with TTFT ≤ x (ms, log x)."""
    fig = _figure()
    ax = fig.add_subplot()
    plotted = False
    for cls, rs in _by_class(results).items():
        ttfts = sorted(r.ttft_s * 1000 for r in rs if r.ok and r.ttft_s is not None)
        if not ttfts:
            continue
        shares = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        line = ax.step(ttfts, shares, where="post", label=f"{cls} (n={len(ttfts)})")[0]
        slos = {r.ttft_slo_s for r in rs if r.ttft_slo_s is not None}
        for slo in slos:
            ax.axvline(slo * 1000, color=line.get_color(), linestyle=":", linewidth=1)
        plotted = True
    if plotted:
        _log_scale(ax, "x")
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("TTFT (ms, first content chunk; dotted: SLO)")
    ax.set_ylabel("share of completed requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("TTFT CDF per class")
    fig.savefig(path)
    return path


def plot_ttft_over_time(results: Sequence[RequestResult], path: Path) -> Path:
    """TTFT of each completed request against its send time; failures as crosses on the
    x axis, so a burst of errors is seen where it happened."""
    fig = _figure(10.0, 5.0)
    ax = fig.add_subplot()
    for cls, rs in _by_class(results).items():
        ok = [r for r in rs if r.ok and r.ttft_s is not None]
        if ok:
            ax.scatter(
                [r.start_s for r in ok],
                [r.ttft_s * 1000 for r in ok if r.ttft_s is not None],
                s=8,
                alpha=0.7,
                label=cls,
            )
    failed = [r for r in results if not r.ok]
    if failed:
        ax.scatter(
            [r.start_s for r in failed],
            [0] * len(failed),
            marker="x",
            color="red",
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            label=f"failed (n={len(failed)})",
        )
    if any(r.ok and r.ttft_s for r in results):
        _log_scale(ax, "y")
    ax.set_xlabel("request sent at (s from start)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("TTFT over time")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left")
    fig.savefig(path)
    return path
