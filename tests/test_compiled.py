"""The compiled request path (``proxy/compiled.py``): used only when it is the build of the
sources beside it, and never when told not to."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from proxy import compiled

ROOT = Path(__file__).resolve().parent.parent
PROBE = (
    "import proxy, proxy.compiled as c, proxy.relay.relay as r; print(c.status); print(r.__file__)"
)

SAME = {m: "d" for m in compiled.BUILT}


@pytest.mark.parametrize(
    ("built", "sources", "why"),
    [
        (SAME, SAME, None),
        ({**SAME, "proxy.extra": "d"}, SAME, "built from another list of modules"),
        ({m: "d" for m in compiled.BUILT[1:]}, SAME, "built from another list of modules"),
        (SAME, {m: "d" for m in compiled.BUILT[1:]}, "a compiled module's source is missing"),
        # The C module is part of the build: built without it, or its source missing.
        ({m: "d" for m in compiled.MODULES}, SAME, "built from another list of modules"),
        (SAME, {m: "d" for m in compiled.MODULES}, "a compiled module's source is missing"),
        (SAME, {**SAME, compiled.NATIVE[0]: "e"}, f"{compiled.NATIVE[0]} changed since"),
        (SAME, {**SAME, compiled.MODULES[3]: "e"}, f"{compiled.MODULES[3]} changed since"),
        (
            SAME,
            {**SAME, compiled.MODULES[3]: "e", compiled.MODULES[5]: "e"},
            f"{compiled.MODULES[3]} and 1 more changed since",
        ),
    ],
)
def test_a_build_runs_only_the_sources_it_was_built_from(
    built: dict[str, str], sources: dict[str, str], why: str | None
) -> None:
    found = compiled.current({"modules": built}, sources)
    if why is None:
        assert found is None
    else:
        assert found is not None and found.startswith(why)


def test_a_manifest_without_modules_is_no_build() -> None:
    assert compiled.current({}, SAME) == "built from another list of modules"


def test_no_build_is_stale_and_says_how_to_make_one(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "proxy", tmp_path / "proxy")
    assert compiled.stale(tmp_path) == "no compiled build: make run or make test builds it"


def _probe(root: Path, **env: str) -> tuple[str, str]:
    environ = {k: v for k, v in os.environ.items() if k != compiled.OFF}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=root,
        env={**environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split("\n")
    return out[0], out[1]


def _build_present() -> None:
    """Skipped only where no build can be made: with a C compiler, ``make test`` has built
    one first, and a build that failed or went stale fails here rather than pass unseen."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the gateway runs interpreted here")
    assert compiled.stale(ROOT) is None, compiled.stale(ROOT)


def _current_copy(tmp_path: Path) -> Path:
    """A copy of the sources and their build under ``tmp_path``; returns the copy's build."""
    shutil.copytree(ROOT / "proxy", tmp_path / "proxy")
    build = compiled.build_dir(tmp_path)
    shutil.copytree(compiled.build_dir(ROOT), build)
    return build


def test_the_current_build_runs_unless_told_not_to() -> None:
    _build_present()
    status, file = _probe(ROOT)
    assert status.startswith("compiled"), status
    assert Path(file).is_relative_to(compiled.build_dir(ROOT))
    status, file = _probe(ROOT, **{compiled.OFF: "1"})
    assert status == f"interpreted ({compiled.OFF} is set)"
    assert file == str(ROOT / "proxy" / "relay" / "relay.py")


def test_one_edited_module_leaves_the_whole_build(tmp_path: Path) -> None:
    _build_present()
    _current_copy(tmp_path)
    status, file = _probe(tmp_path)
    assert status.startswith("compiled"), status  # the copy is current: it runs
    edited = compiled.source_of(compiled.MODULES[0], tmp_path)
    edited.write_text(edited.read_text() + "\n# edited\n")
    status, file = _probe(tmp_path)
    assert status.startswith(f"interpreted ({compiled.MODULES[0]} changed since the build")
    assert file == str(tmp_path / "proxy" / "relay" / "relay.py")  # not only the edited one


def test_an_edited_c_source_leaves_the_whole_build(tmp_path: Path) -> None:
    _build_present()
    _current_copy(tmp_path)
    edited = compiled.source_of(compiled.NATIVE[0], tmp_path)
    assert edited.suffix == ".c"
    edited.write_text(edited.read_text() + "\n/* edited */\n")
    status, file = _probe(tmp_path)
    assert status.startswith(f"interpreted ({compiled.NATIVE[0]} changed since the build")
    assert file == str(tmp_path / "proxy" / "relay" / "relay.py")


def test_a_build_for_other_modules_is_not_used(tmp_path: Path) -> None:
    _build_present()
    build = _current_copy(tmp_path)
    manifest = json.loads((build / compiled.MANIFEST).read_text())
    del manifest["modules"][compiled.MODULES[-1]]
    (build / compiled.MANIFEST).write_text(json.dumps(manifest))
    status, _ = _probe(tmp_path)
    assert status == "interpreted (built from another list of modules)"


# Module-level names that are types (aliases, a type variable): read in annotations, not by code.
_TYPE_NAMES = {
    "IPNetwork",
    "C",
    "Kind",
    "TryPick",
    "AnyServing",
    "Scanned",
    "Record",
    "Handler",
    "W",
    "Search",
    "LabelSets",
    "FinishTails",
}


def _top_level_values(tree: ast.Module) -> set[str]:
    """Names a module assigns at its top level without ``Final``."""
    assigned: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            assigned |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.value is not None and "Final" not in ast.unparse(node.annotation):
                assigned.add(node.target.id)
    return assigned - _TYPE_NAMES - {"__all__"}


def _read_by_functions(tree: ast.Module) -> set[str]:
    """Names the module's functions read and do not rebind (``global``)."""
    read: set[str] = set()
    rebound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Global):
                    rebound.update(sub.names)
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                    read.add(sub.id)
    return read - rebound


def unfinal_names(sources: dict[str, str]) -> dict[str, list[str]]:
    """Per module of ``sources`` (name: text), its top-level names without ``Final`` that
    functions read: its own, or those of another of the modules that import them by name."""
    trees = {m: ast.parse(text) for m, text in sources.items()}
    found = {m: _top_level_values(t) & _read_by_functions(t) for m, t in trees.items()}
    for tree in trees.values():
        read = _read_by_functions(tree)
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module in trees:
                names = {a.name for a in node.names if a.asname is None} & read
                found[node.module] |= names & _top_level_values(trees[node.module])
    return {m: sorted(names) for m, names in found.items() if names}


def test_the_compiled_modules_constants_are_final() -> None:
    """Compiled, a module-level name is looked up in the module's dict at every read unless it
    is ``Final`` (then it is a C static, or a literal in place): on the relay's path such reads
    were about 1,000 of a relayed chunk's 22,000 instructions (``docs/benchmarks.md``). A name
    imported from another compiled module is read through that module's static."""
    sources = {m: compiled.source_of(m).read_text() for m in compiled.MODULES}
    assert unfinal_names(sources) == {}


def test_a_name_not_final_is_found_where_it_is_read() -> None:
    a = "from typing import Final\nA = 1\nB: Final = 2\nT = int\nU = 3\ndef f() -> int:\n    return A + B\n"
    b = "from a import U\nfrom a import T\ndef g() -> int:\n    return U\n"
    assert unfinal_names({"a": a, "b": b}) == {"a": ["A", "U"]}
