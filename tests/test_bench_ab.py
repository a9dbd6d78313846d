"""``loadtest/bench_ab.py`` runs two gateways from source trees side by side and prints a row
for each with its paired differences (the figures are for people; no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import bench_ab

ROOT = Path(__file__).resolve().parent.parent


def test_bench_ab_prints_a_row_per_tree(capsys: pytest.CaptureFixture[str]) -> None:
    # The same tree twice is an A/A control: a row for each, told apart by position.
    trees = [str(ROOT), f"{ROOT}:1", f"{ROOT}:1"]
    assert bench_ab.main([a for t in trees for a in ("--tree", t)] + ["--rounds", "2",
                         "--slice-s", "0.3"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith(str(ROOT))]
    assert [row.split(" | ")[0].strip() for row in rows] == [
        str(ROOT),
        f"{ROOT}:1 (2)",
        f"{ROOT}:1 (3)",
    ]
    # The first tree's paired differences are from itself.
    assert rows[0].count("(+0.000)") == 1 and rows[0].count("(+0)") == 1
    cells = [float(cell.split()[0]) for cell in rows[1].split(" | ")[1:]]
    assert len(cells) == 3 and all(figure > 0 for figure in cells), rows[1]
