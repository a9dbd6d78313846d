"""Peers: other gateways, and clients, to benchmark with, each from PyPI in a virtualenv of its own.

A peer's dependencies must not leak into the project's environment (vllm-router pins its own
FastAPI, uvicorn and friends), so each gets ``<peers dir>/<name>/`` with its own ``pip``. The
directory is ``$TOKENLANE_PEERS_DIR``, else ``~/.cache/tokenlane/peers``: it outlives a work
tree, so a second benchmark run does not install again.

    python -m loadtest.peers vllm-router     # install if missing, print the executable's path
    python -m loadtest.peers inference-perf

A peer may need a newer Python than the project's (inference-perf requires 3.12): its
virtualenv is then made by the oldest interpreter found that is new enough (``find_python``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

Version = tuple[int, int]


@dataclass(frozen=True)
class Peer:
    name: str  # the PyPI distribution
    version: str  # pinned: the figures in docs/ name the version they were measured with
    executable: str  # the console script the distribution installs
    min_python: Version | None = None  # None: any Python the project runs on


PEERS = {
    "vllm-router": Peer("vllm-router", "0.1.17", "vllm-router"),
    # A client, not a gateway: the load generator vLLM users run (loadtest/bench_clients.py).
    "inference-perf": Peer("inference-perf", "0.7.0", "inference-perf", min_python=(3, 12)),
}
# Where to look for a newer Python, in this order: the PATH, then pyenv's installs (pyenv's
# PATH shims for versions not selected exit 127, so every candidate is run, not trusted).
PATH_PYTHONS = ("python3.13", "python3.12")
PYENV_GLOB = "3.1[2-9]*/bin/python"


class PeerUnavailable(RuntimeError):
    """The peer could not be installed or does not run here; the message says why."""


def peers_dir() -> Path:
    env = os.environ.get("TOKENLANE_PEERS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tokenlane" / "peers"


def python_candidates(
    which: Callable[[str], str | None] = shutil.which, home: Path | None = None
) -> list[Path]:
    """Interpreters that may be new enough: the PATH's, then pyenv's (by version)."""
    found = [Path(p) for name in PATH_PYTHONS if (p := which(name))]
    versions = (home or Path.home()) / ".pyenv" / "versions"
    found += sorted(versions.glob(PYENV_GLOB), key=lambda p: _release(p.parent.parent.name))
    return found


def pick_python(candidates: Sequence[tuple[Path, Version | None]], minimum: Version) -> Path | None:
    """The interpreter to build a peer's virtualenv with: the oldest at least ``minimum``
    (``None`` as a version: it did not run). The oldest, because a peer's pinned dependencies
    ship wheels for an established Python before they do for the newest; on a tie, the
    earlier candidate."""
    fitting = [(v, i, p) for i, (p, v) in enumerate(candidates) if v is not None and v >= minimum]
    return min(fitting)[2] if fitting else None


def python_version(python: Path) -> Version | None:
    """``(major, minor)`` of an interpreter, by running it; ``None`` if it does not run."""
    try:
        done = subprocess.run(
            [str(python), "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = done.stdout.split()
    if done.returncode != 0 or len(parts) != 2 or not all(x.isdigit() for x in parts):
        return None
    return int(parts[0]), int(parts[1])


def find_python(minimum: Version) -> Path:
    """An interpreter at least ``minimum``; ``PeerUnavailable`` naming where it looked."""
    candidates = python_candidates()
    chosen = pick_python([(p, python_version(p)) for p in candidates], minimum)
    if chosen is None:
        want = ".".join(map(str, minimum))
        looked = ", ".join(str(p) for p in candidates) or "none found"
        raise PeerUnavailable(
            f"needs Python >= {want}; looked for {', '.join(PATH_PYTHONS)} on the PATH and "
            f"~/.pyenv/versions/{PYENV_GLOB} (candidates: {looked}); install one, e.g. "
            f"`pyenv install {want}` or your distribution's python{want} package"
        )
    return chosen


def _release(name: str) -> Version:
    """``(3, 12)`` from a pyenv directory name such as ``3.12.1`` or ``3.13.0t``."""
    m = re.match(r"(\d+)\.(\d+)", name)
    return (int(m[1]), int(m[2])) if m else (0, 0)


def _make_venv(peer: Peer, env_dir: Path) -> None:
    """The peer's virtualenv: by this interpreter when it is new enough (as before for
    vllm-router), else by ``find_python``'s."""
    if peer.min_python is None or sys.version_info[:2] >= peer.min_python:
        try:
            venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise PeerUnavailable(f"cannot create a virtualenv in {env_dir}: {exc}") from exc
        return
    python = find_python(peer.min_python)
    cmd = [str(python), "-m", "venv", "--clear", str(env_dir)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise PeerUnavailable(f"{python} -m venv {env_dir}: {exc}") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise PeerUnavailable(f"{python} -m venv {env_dir} failed: {tail}")


def ensure(name: str, *, quiet: bool = True) -> Path:
    """The path of the peer's executable, installing the peer first when it is missing.

    Raises ``PeerUnavailable`` (with pip's last lines) when the install fails, e.g. offline or
    when no wheel fits this platform, or when the peer needs a newer Python than any found.
    """
    peer = PEERS[name]
    env_dir = peers_dir() / peer.name
    exe = env_dir / "bin" / peer.executable
    if exe.exists():
        return exe
    _make_venv(peer, env_dir)
    cmd = [str(env_dir / "bin" / "python"), "-m", "pip", "install", f"{peer.name}=={peer.version}"]
    if quiet:
        cmd.insert(4, "-q")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not exe.exists():
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise PeerUnavailable(f"pip install {peer.name}=={peer.version} failed: {tail}")
    return exe


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(PEERS)
    status = 0
    for name in names:
        if name not in PEERS:
            print(f"{name}: unknown peer; known: {', '.join(PEERS)}", file=sys.stderr)
            status = 2
            continue
        try:
            print(ensure(name, quiet=False))
        except PeerUnavailable as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
