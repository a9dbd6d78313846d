"""Build the request path's compiled modules (``proxy/compiled.py`` says which and why) into
``build/compiled/<python>/``, or do nothing when that build is current.

``make run`` and ``make test`` run it. Without a C compiler or mypyc it says so and leaves
the gateway interpreted (exit 0): the build is an optimisation, never a requirement.

    python scripts/compile.py [--force]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["TOKENLANE_INTERPRETED"] = "1"  # this process only reads the sources

from proxy import compiled  # noqa: E402


def main(argv: list[str]) -> int:
    if "--force" not in argv and compiled.stale(ROOT) is None:
        return 0
    build = compiled.build_dir(ROOT)
    sources = compiled.digests()
    try:
        from mypyc.build import mypycify
        from setuptools import Extension, setup
    except ImportError as exc:
        print(f"compile: {exc}; the gateway runs interpreted", file=sys.stderr)
        return 0
    started = time.monotonic()
    print(
        f"compile: building {len(compiled.MODULES)} modules with mypyc and"
        f" {len(compiled.NATIVE)} in C into {build} ..."
    )
    shutil.rmtree(build, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="tokenlane-mypyc-") as tmp:
        os.chdir(ROOT)
        try:
            extensions = mypycify(
                [str(compiled.source_of(m).relative_to(ROOT)) for m in compiled.MODULES],
                group_name=compiled.GROUP,
                target_dir=str(Path(tmp) / "c"),
            )
            extensions += [
                Extension(
                    name,
                    [str(compiled.source_of(name).relative_to(ROOT))],
                    extra_compile_args=["-Wall"],
                )
                for name in compiled.NATIVE
            ]
            setup(
                name="tokenlane-compiled",
                ext_modules=extensions,
                script_args=[
                    "-q",
                    "build_ext",
                    "--build-lib",
                    str(build),
                    "--build-temp",
                    str(Path(tmp) / "o"),
                ],
            )
        except (SystemExit, Exception) as exc:  # setuptools exits on a compiler error
            shutil.rmtree(build, ignore_errors=True)
            print(f"compile: the build failed ({exc}); it runs interpreted", file=sys.stderr)
            return 0
    # The digests read before the build: a source edited meanwhile leaves the build unused.
    (build / compiled.MANIFEST).write_text(json.dumps({"modules": sources}, indent=1) + "\n")
    print(f"compile: done in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
