"""loadtest/peers.py: which interpreter builds a peer's virtualenv when the peer needs a newer
Python than the project's (inference-perf needs 3.12, the project runs on 3.11)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loadtest import peers

P = Path


@pytest.mark.parametrize(
    ("candidates", "minimum", "expected"),
    [
        ([], (3, 12), None),  # nothing found
        ([(P("/usr/bin/python3.11"), (3, 11))], (3, 12), None),  # too old
        ([(P("/shim/python3.13"), None)], (3, 12), None),  # a pyenv shim that exits 127
        ([(P("/usr/bin/python3.12"), (3, 12))], (3, 12), P("/usr/bin/python3.12")),  # exactly
        # the oldest that fits, wherever it stands in the list
        (
            [(P("/usr/bin/python3.13"), (3, 13)), (P("/pyenv/3.12.1/bin/python"), (3, 12))],
            (3, 12),
            P("/pyenv/3.12.1/bin/python"),
        ),
        # a shim that does not run is skipped for the real interpreter behind it
        (
            [(P("/shim/python3.12"), None), (P("/pyenv/3.12.1/bin/python"), (3, 12))],
            (3, 12),
            P("/pyenv/3.12.1/bin/python"),
        ),
        # a tie: the earlier candidate (the PATH's before pyenv's)
        (
            [(P("/usr/bin/python3.12"), (3, 12)), (P("/pyenv/3.12.1/bin/python"), (3, 12))],
            (3, 12),
            P("/usr/bin/python3.12"),
        ),
        ([(P("/opt/python4"), (4, 0))], (3, 12), P("/opt/python4")),  # tuple order, not text
    ],
)
def test_pick_python(
    candidates: list[tuple[Path, tuple[int, int] | None]],
    minimum: tuple[int, int],
    expected: Path | None,
) -> None:
    assert peers.pick_python(candidates, minimum) == expected


def test_candidates_are_the_paths_then_pyenvs_new_enough_installs(tmp_path: Path) -> None:
    for version in ("3.11.7", "3.12.1", "3.13.0", "2.7.18"):
        (tmp_path / ".pyenv/versions" / version / "bin").mkdir(parents=True)
        (tmp_path / ".pyenv/versions" / version / "bin/python").touch()
    on_path = {"python3.12": "/usr/bin/python3.12"}
    found = peers.python_candidates(on_path.get, tmp_path)
    assert found == [
        P("/usr/bin/python3.12"),
        tmp_path / ".pyenv/versions/3.12.1/bin/python",
        tmp_path / ".pyenv/versions/3.13.0/bin/python",
    ]


def test_no_interpreter_found_names_where_it_looked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "python_candidates", lambda: [P("/shim/python3.12")])
    monkeypatch.setattr(peers, "python_version", lambda _: None)
    with pytest.raises(peers.PeerUnavailable, match=r"needs Python >= 3\.12.*/shim/python3\.12"):
        peers.find_python((3, 12))


def test_python_version_runs_the_interpreter(tmp_path: Path) -> None:
    assert peers.python_version(P(sys.executable)) == sys.version_info[:2]
    assert peers.python_version(tmp_path / "missing") is None


def test_the_peers_that_need_a_newer_python() -> None:
    assert peers.PEERS["inference-perf"].min_python == (3, 12)
    assert peers.PEERS["vllm-router"].min_python is None  # made by this interpreter, as before
