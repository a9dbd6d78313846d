"""Times named functions inside a gateway, for ``loadtest.bench_inplace``.

This directory is put on the PYTHONPATH of the one gateway that benchmark starts; Python imports
this module at start-up. It does nothing unless ``TOKENLANE_INPLACE`` names the functions (a
JSON list of ``module:Qualified.name``): each is replaced by a wrapper that reads the clock
before and after the call; at exit the durations are summarised into
``$TOKENLANE_INPLACE_OUT.<pid>`` (JSON). Why: a function called once per stream in turn across
hundreds of streams, between system calls, runs with its data and the interpreter's paths cold,
and costs several times what a loop over it says (``docs/benchmarks.md``).
"""

from __future__ import annotations

import os

_SPEC = os.environ.get("TOKENLANE_INPLACE")

if _SPEC:
    import atexit
    import importlib
    import json
    import statistics
    import sys
    import time
    from collections.abc import Callable
    from typing import Any

    # The source tree the gateway runs from (its working directory, as ``-m`` puts it first),
    # not the one the virtualenv installed: imported now, before ``-m`` would add it.
    sys.path.insert(0, os.getcwd())
    _durations: dict[str, list[float]] = {}
    _clock = time.perf_counter

    def _timed(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        seen = _durations.setdefault(name, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = _clock()
            try:
                return original(*args, **kwargs)
            finally:
                seen.append(_clock() - t)

        return timed

    def _wrap(name: str) -> None:
        module, _, qualname = name.partition(":")
        owner: Any = importlib.import_module(module)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, attr, _timed(name, getattr(owner, attr)))

    def _overhead_us() -> float:
        """The wrapper's own cost around a call that does nothing, hot (a lower bound)."""
        nothing = _timed("", lambda: None)
        for _ in range(20_000):
            nothing()
        spent = sorted(_durations.pop(""))
        return spent[len(spent) // 2] * 1e6

    def _summary() -> None:
        out: dict[str, Any] = {"overhead_us": _overhead_us(), "functions": {}}
        for name, spent in _durations.items():
            spent.sort()
            n = len(spent)
            figures = {"calls": n, "mean_us": statistics.fmean(spent) * 1e6 if n else 0.0}
            for q in (10, 50, 90, 99):
                figures[f"p{q}_us"] = spent[min(n - 1, n * q // 100)] * 1e6 if n else 0.0
            out["functions"][name] = figures
        with open(f"{os.environ['TOKENLANE_INPLACE_OUT']}.{os.getpid()}", "w") as f:
            json.dump(out, f)

    for _name in json.loads(_SPEC):
        _wrap(_name)
    atexit.register(_summary)
