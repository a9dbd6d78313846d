"""``loadtest/bench_inplace.py`` times named functions inside a gateway under paced streams
(the figures are for people; no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import bench_inplace

ROOT = Path(__file__).resolve().parent.parent


def test_each_named_function_is_timed_where_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    names = [
        "proxy.relay.continuation:Splice.take_token",
        "proxy.relay.resume:_TokenRelay.__call__",
    ]
    options = ["--streams", "4", "--runs", "1", "--tree", str(ROOT)]
    bench_inplace.main([a for n in names for a in ("--function", n)] + options)
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split(" | ")[0].strip(): line.split(" | ")[1:] for line in lines if " | " in line}
    for name in names:
        calls, *per_call = rows[name]
        # 4 eligible streams of 64 tokens, twice (the warm-up and the run): every token chunk
        # after the first of each stream went through the handler, in the gateway's process.
        assert int(calls) >= 2 * 4 * 60, (name, calls)
        assert float(per_call[1]) > 0  # the median
    assert "the wrapper's own cost" in lines[-1]


def test_nothing_is_wrapped_without_the_variable() -> None:
    """On the PYTHONPATH of any other process the module does nothing."""
    out = subprocess.run(
        [sys.executable, "-c", "import sitecustomize, sys; print(hasattr(sitecustomize, '_wrap'))"],
        env={"PYTHONPATH": str(bench_inplace.SITE), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "False"
