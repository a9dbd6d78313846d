"""The request path compiled with mypyc, used only when it is the build of the sources here.

Why: a request's and a relayed chunk's cost is spread over some forty functions of the
gateway's own Python, none a hotspot (``docs/benchmarks.md``, "The hot path compiled"). The
modules below, compiled together, call each other natively: measured side by side with the
interpreted build, an eligible request costs 12 % less CPU and its relayed chunks 15 % less.

``scripts/compile.py`` builds them (``make run`` and ``make test`` run it; it does nothing
when the build is current) into ``build/compiled/<python>/`` with a manifest of each source's
sha256. At import of ``proxy`` (``install``), the build is used only when every listed
source is the one it was built from: one edited module and the whole build is left, since
its modules call each other natively. Anything else (no build, no C compiler, another
Python, ``TOKENLANE_INTERPRETED=1``) runs the same sources interpreted.

What compiled code does not allow, and the sources keep to: a class of these modules is not
subclassed by interpreted code; a call passes the annotated types (checked at run time); a
dataclass's field types are importable at run time; a dataclass made per request is given an
``__init__`` of its own (the generated one stays interpreted: ``Profile``); an instance takes
no weak reference (the fleet holds its ``cache_aware`` routers itself); a module-level
name their functions read, theirs or imported from another of them, is ``Final`` (else every
read is a lookup in the module's dict; ``tests/test_compiled.py`` holds it), so patching one
from outside changes nothing compiled code reads. The access log's
handler (``proxy/observe/accesslog.py``) is left out: compiled, it crashed the process at
logging's shutdown; the lines are made in ``proxy/observe/accessline.py``, compiled.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

MODULES = (
    "proxy.edge.asgi_ext",
    "proxy.edge.bounds",
    "proxy.edge.connection",
    "proxy.edge.cycle",
    "proxy.edge.endpoint",
    "proxy.edge.head",
    "proxy.edge.validate",
    "proxy.fleet.detect",
    "proxy.fleet.fleet",
    "proxy.fleet.replica",
    "proxy.headers",
    "proxy.observe.accessline",
    "proxy.observe.gaps",
    "proxy.observe.metrics",
    "proxy.observe.outcomes",
    "proxy.observe.record",
    "proxy.relay.call",
    "proxy.relay.continuation",
    "proxy.relay.h1",
    "proxy.relay.homes",
    "proxy.relay.relay",
    "proxy.relay.reply",
    "proxy.relay.reprefill",
    "proxy.relay.respond",
    "proxy.relay.resume",
    "proxy.relay.retry",
    "proxy.relay.sse",
    "proxy.relay.watchdog",
    "proxy.routing.admission",
    "proxy.routing.balance",
    "proxy.routing.estimate",
    "proxy.routing.lanes",
    "proxy.routing.pick",
    "proxy.routing.profile",
)
# Written in C, built beside them and used only with them: the scan every token of an
# eligible stream goes through (``continuation.scan_events`` is its contract, in Python), and
# ``bytes.find``/``rfind`` as plain functions (``sse.FIND``: a compiled method call by name
# costs several times the search).
NATIVE = ("proxy.relay._bytesearch", "proxy.relay._tokenscan")
BUILT = (*MODULES, *NATIVE)  # what a build holds, each with its source's digest
# mypyc's shared library of the group: the modules' code, imported by each of them by name.
GROUP = "tokenlane_hotpath"
OFF = "TOKENLANE_INTERPRETED"
MANIFEST = "manifest.json"

ROOT = Path(__file__).resolve().parent.parent
# What the gateway runs, said in its startup log line (set by ``install``).
status = "interpreted"


def build_dir(root: Path = ROOT) -> Path:
    """Where the build for this Python lives."""
    return root / "build" / "compiled" / sys.implementation.cache_tag


def source_of(module: str, root: Path = ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".c" if module in NATIVE else ".py")


def digests(modules: Sequence[str] = BUILT, root: Path = ROOT) -> dict[str, str]:
    """Each module's source sha256; a module whose source is missing has none."""
    out: dict[str, str] = {}
    for module in modules:
        path = source_of(module, root)
        if path.is_file():
            out[module] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def extension_of(name: str, build: Path) -> Path:
    """Where the built extension of module ``name`` lies in ``build``."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    parts = name.split(".")
    return build.joinpath(*parts[:-1], parts[-1] + suffix)


def current(manifest: dict[str, object], sources: dict[str, str]) -> str | None:
    """Why a build with ``manifest`` may not run the ``sources`` (their digests); None: it may.
    A pure function, so that the rule has table tests."""
    built = manifest.get("modules")
    if not isinstance(built, dict) or set(built) != set(BUILT):
        return "built from another list of modules"
    if set(sources) != set(BUILT):
        return "a compiled module's source is missing"
    changed = sorted(m for m in BUILT if built[m] != sources[m])
    if changed:
        more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
        return f"{changed[0]}{more} changed since the build (make run or make test rebuilds it)"
    return None


class CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds the listed modules (and the group's library) in the build, before the sources."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        return importlib.util.spec_from_file_location(fullname, file)


def stale(root: Path = ROOT) -> str | None:
    """Why the build under ``root`` may not run its sources (``current``, or no build);
    None: it may. Read by ``install`` and by ``scripts/compile.py``."""
    try:
        manifest = json.loads((build_dir(root) / MANIFEST).read_text())
    except (OSError, ValueError):
        return "no compiled build: make run or make test builds it"
    return current(manifest, digests(BUILT, root))


def install(root: Path = ROOT) -> str:
    """Run the compiled build from now on when it is current; returns what runs (``status``)."""
    global status
    status = _install(root)
    return status


def _install(root: Path) -> str:
    if os.environ.get(OFF):
        return f"interpreted ({OFF} is set)"
    if any(isinstance(f, CompiledFinder) for f in sys.meta_path):
        return status
    if any(m in sys.modules for m in MODULES):
        return "interpreted (the modules were imported before the build could be used)"
    why = stale(root)
    if why is not None:
        return f"interpreted ({why})"
    build = build_dir(root)
    files = {name: extension_of(name, build) for name in (*BUILT, f"{GROUP}__mypyc")}
    if not all(f.is_file() for f in files.values()):
        return "interpreted (the build is incomplete)"
    sys.meta_path.insert(0, CompiledFinder(files))
    return f"compiled ({len(MODULES)} modules, mypyc; {len(NATIVE)} in C)"


__all__ = [
    "BUILT",
    "GROUP",
    "MANIFEST",
    "MODULES",
    "NATIVE",
    "OFF",
    "CompiledFinder",
    "build_dir",
    "current",
    "digests",
    "extension_of",
    "install",
    "source_of",
    "stale",
]
