"""The import graph of ``proxy/`` and of the simulator: no circle, and no import that runs back
up a layer. Every import counts, ``TYPE_CHECKING`` and function-local ones included, since a
circle hidden under ``TYPE_CHECKING`` is still two modules that must be read together.

Layers of ``proxy/``, top to bottom (a module imports its own layer or lower ones):
  commands     proxy.cli, proxy.demo, proxy.__main__
  server       proxy.edge.serve (the process: uvicorn, signals)
  composition  proxy.gateway (builds the parts, reload, start/stop)
  edge         the rest of proxy.edge (endpoint, routes, auth, admin)
  core         proxy.routing, proxy.relay, proxy.fleet, proxy.state, proxy.observe, proxy.workers
  base         proxy.config, proxy.policyfile, proxy.schema, proxy.errors, proxy.routing.tokens,
               proxy.edge.asgi_ext, proxy.headers (header bytes case-folded),
               proxy.compiled (which build of the modules runs), proxy.tasks (a loop's
               cancel asked, not lost)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("commands", ("proxy.cli", "proxy.demo", "proxy.__main__")),
    ("server", ("proxy.edge.serve",)),
    ("composition", ("proxy.gateway",)),
    ("edge", ("proxy.edge",)),
    # proxy.edge.asgi_ext is the vocabulary our server offers the app (extension names): the
    # server and the relay both speak it, and it imports nothing.
    (
        "base",
        (
            "proxy.config",
            "proxy.policyfile",
            "proxy.schema",
            "proxy.errors",
            "proxy.routing.tokens",
            "proxy.edge.asgi_ext",
            "proxy.headers",
            "proxy.compiled",
            "proxy.tasks",
        ),
    ),
    (
        "core",
        (
            "proxy.routing",
            "proxy.relay",
            "proxy.fleet",
            "proxy.state",
            "proxy.observe",
            "proxy.workers",
        ),
    ),
]
ORDER = ["commands", "server", "composition", "edge", "core", "base"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: str) -> dict[str, Path]:
    base = ROOT.joinpath(*package.split("."))
    return {module_name(p): p for p in base.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of ``known`` that ``path`` imports, wherever the import statement is."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
        for t in targets:
            # the longest known module the name refers to (``from pkg import module`` or
            # ``from module import name``)
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not known_is_package_init(t, known):
                found.add(t)
    return found


def known_is_package_init(mod: str, known: set[str]) -> bool:
    # A package's __init__ holds only its docstring: importing ``proxy.fleet.x`` runs it, but
    # it is no edge of the graph.
    return any(k.startswith(mod + ".") for k in known)


def graph(package: str) -> dict[str, set[str]]:
    mods = modules(package)
    known = set(mods)
    return {n: imports_of(n, p, known) for n, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layer_of(mod: str) -> str:
    best = ("", "")
    for layer, prefixes in LAYERS:
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > len(best[1]):
                best = (layer, p)
    return best[0]


@pytest.mark.parametrize("package", ["proxy", "loadtest.sim"])
def test_no_import_circle(package: str) -> None:
    found = cycles(graph(package))
    assert not found, f"import circles in {package}: {found}"


def test_every_proxy_module_has_a_layer() -> None:
    unplaced = sorted(m for m in modules("proxy") if m != "proxy" and not layer_of(m))
    assert not unplaced, f"modules with no layer (add them to LAYERS): {unplaced}"


def test_no_import_runs_back_up() -> None:
    g = graph("proxy")
    upward = []
    for mod, deps in g.items():
        if mod == "proxy":
            continue
        mine = ORDER.index(layer_of(mod))
        for dep in deps:
            if dep != "proxy" and ORDER.index(layer_of(dep)) < mine:
                upward.append(f"{mod} ({layer_of(mod)}) imports {dep} ({layer_of(dep)})")
    assert not upward, "imports that run back up:\n" + "\n".join(sorted(upward))


def test_the_gateway_needs_nothing_of_the_load_tools() -> None:
    """Serving never imports the benchmarks or the simulator (only the commands may)."""
    offenders = []
    for mod, path in modules("proxy").items():
        if layer_of(mod) == "commands":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            offenders += [f"{mod} imports {n}" for n in names if n.split(".")[0] == "loadtest"]
    assert not offenders, offenders


def test_the_checker_sees_a_circle() -> None:
    """The checker itself: a planted circle, including one under TYPE_CHECKING, is found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from proxy.x import Y\n"
    tree_imports = [n.module for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)]
    assert "proxy.x" in tree_imports


LONG_MODULE = 450


def test_a_long_module_says_why_it_is_one_job() -> None:
    """A module past ~450 lines must be one job and say so: its docstring has a ``Length:``
    paragraph. A module that grows past the bound without one is split, or says why not."""
    unexplained = []
    for package in ("proxy", "loadtest"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if text.count("\n") <= LONG_MODULE:
                continue
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Length:" not in doc:
                unexplained.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not unexplained, "over ~450 lines without a 'Length:' paragraph: " + ", ".join(
        unexplained
    )
