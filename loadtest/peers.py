"""Other gateways to benchmark against, each installed from PyPI into a virtualenv of its own.

A peer's dependencies must not leak into the project's environment (vllm-router pins its own
FastAPI, uvicorn and friends), so each gets ``<peers dir>/<name>/`` with its own ``pip``. The
directory is ``$TOKENLANE_PEERS_DIR``, else ``~/.cache/tokenlane/peers``: it outlives a work
tree, so a second benchmark run does not install again.

    python -m loadtest.peers vllm-router     # install if missing, print the executable's path
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Peer:
    name: str  # the PyPI distribution
    version: str  # pinned: the figures in docs/ name the version they were measured with
    executable: str  # the console script the distribution installs


PEERS = {"vllm-router": Peer("vllm-router", "0.1.17", "vllm-router")}


class PeerUnavailable(RuntimeError):
    """The peer could not be installed or does not run here; the message says why."""


def peers_dir() -> Path:
    env = os.environ.get("TOKENLANE_PEERS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tokenlane" / "peers"


def ensure(name: str, *, quiet: bool = True) -> Path:
    """The path of the peer's executable, installing the peer first when it is missing.

    Raises ``PeerUnavailable`` (with pip's last lines) when the install fails, e.g. offline or
    when no wheel fits this platform.
    """
    peer = PEERS[name]
    env_dir = peers_dir() / peer.name
    exe = env_dir / "bin" / peer.executable
    if exe.exists():
        return exe
    try:
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise PeerUnavailable(f"cannot create a virtualenv in {env_dir}: {exc}") from exc
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
