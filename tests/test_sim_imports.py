"""The simulator's modules form a layered graph: no import circle, counting imports under
``TYPE_CHECKING`` and inside functions, so each module can be read and tested from the bottom up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SIM = Path(__file__).resolve().parent.parent / "loadtest" / "sim"

# Each module's job, bottom (0) to top. A module may import only modules of a lower layer, or
# of its own layer when listed in SAME_LAYER; this pins the grouping, not just the absence of
# a circle.
LAYERS: dict[str, int] = {
    "settings": 0, "faults": 0, "tokenizer": 0, "kvcache": 0,
    "generate": 1, "protocol": 1, "formats": 1, "kv_events": 1,
    "scheduler": 2, "metrics": 3, "engine": 3, "listener": 3,
    "replica": 4, "generation": 5, "responses_api": 6, "messages_api": 6, "pooling_api": 6,
    "realtime_api": 6,
    "app": 7, "server": 8,
    "cli": 9, "supervisor": 10, "__main__": 11, "__init__": 11,
}  # fmt: skip


def sim_imports(path: Path) -> set[str]:
    """Every sibling module ``path`` imports, wherever the import statement stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(a.name for a in node.names)
            elif node.module and node.module.startswith("loadtest.sim."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("loadtest.sim."):
                    found.add(alias.name.split(".")[2])
    return found


def test_every_module_has_a_layer() -> None:
    assert {p.stem for p in SIM.glob("*.py")} == set(LAYERS)


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_imports_only_run_downwards(module: str) -> None:
    upward = {m for m in sim_imports(SIM / f"{module}.py") if LAYERS.get(m, 99) >= LAYERS[module]}
    assert not upward, f"{module} imports {sorted(upward)} from its own layer or above"


def test_the_finder_sees_type_checking_and_local_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .server import Sim\n"
        "def f():\n    from . import app\n    import loadtest.sim.cli\n"
    )
    assert sim_imports(src) == {"server", "app", "cli"}
