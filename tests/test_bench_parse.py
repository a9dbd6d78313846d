"""``loadtest/bench_parse.py`` runs and prints a figure for every row (the figures themselves
are for people; a test asserts no timing)."""

from __future__ import annotations

import pytest

from loadtest import bench_parse


def test_bench_parse_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    bench_parse.main(["--target-s", "0.01"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("what")
    rows = {line.rsplit(None, 1)[0].strip(): float(line.rsplit(None, 1)[1]) for line in lines[1:]}
    assert len(rows) == 16 and all(us > 0 for us in rows.values()), rows
    # A continuable request's own steps over the mocks' burst, beside the plain relay's parse.
    per_request = [name for name in rows if name.startswith("per request,")]
    assert len(per_request) == 5 and "per request, plain relay: parse to the content" in rows
