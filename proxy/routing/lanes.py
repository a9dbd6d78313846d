"""Which lane a profiled request takes: the first whose ``when`` holds.

Two spellings of one rule: ``_lane_holds`` for the request path (stops at the first failed
condition, builds no strings) and ``_lane_conditions`` for ``explain`` (every condition, with
its reason); a test checks that they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import translate
from re import compile as re_compile
from typing import Any, Final

from proxy.config import LaneConfig
from proxy.errors import NoLaneMatched
from proxy.routing.profile import Profile, output_tokens_for


@dataclass(frozen=True, slots=True)
class LaneMatch:
    lane: LaneConfig
    index: int
    reasons: list[str]  # why this lane, and why each earlier one was skipped; explain only

    # Written out: the generated (frozen) ``__init__`` stays interpreted when compiled
    # (``Profile.__init__``).
    def __init__(self, lane: LaneConfig, index: int, reasons: list[str]) -> None:
        object.__setattr__(self, "lane", lane)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "reasons", reasons)


_glob_cache: Final[dict[str, Any]] = {}


def _glob_match(pattern: str, model: str) -> bool:
    """Case-sensitive glob (model ids are), compiled once per pattern."""
    matcher = _glob_cache.get(pattern)
    if matcher is None:
        if len(_glob_cache) > 1024:  # patterns come from the policy; this only bounds reloads
            _glob_cache.clear()
        matcher = _glob_cache[pattern] = re_compile(translate(pattern)).match
    return matcher(model) is not None


def _lane_holds(lane: LaneConfig, profile: Profile) -> bool:
    """Whether ``lane.when`` holds: the hot path, stopping at the first failed condition."""
    when = lane.when
    if when is None:
        return True
    if when.stream is not None and profile.stream is not when.stream:
        return False
    est = profile.prompt_tokens_est
    if when.prompt_tokens_min is not None and est < when.prompt_tokens_min:
        return False
    if when.prompt_tokens_max is not None and est > when.prompt_tokens_max:
        return False
    if when.output_tokens_max is not None:
        out = output_tokens_for(profile, lane)
        if out is None or out > when.output_tokens_max:
            return False
    if when.model is not None:
        return profile.model is not None and _glob_match(when.model, profile.model)
    return True


def _lane_conditions(lane: LaneConfig, profile: Profile) -> list[tuple[bool, str]]:
    """Every condition of ``lane.when`` as (held, reason): ``_lane_holds`` spelled out for
    ``explain``. The two must agree; a test checks that they do."""
    when = lane.when
    if when is None:
        return [(True, "no `when`: takes every request left")]
    out: list[tuple[bool, str]] = []
    if when.stream is not None:
        got, want = _b(profile.stream), _b(when.stream)
        if profile.stream is when.stream:
            out.append((True, f"stream={got} matches"))
        else:
            out.append((False, f"stream={got}, lane wants stream={want}"))
    est = profile.prompt_tokens_est
    if when.prompt_tokens_min is not None:
        lo = when.prompt_tokens_min
        if est >= lo:
            out.append((True, f"prompt_tokens_est {est} >= prompt_tokens_min {lo}"))
        else:
            out.append((False, f"prompt_tokens_est {est} < prompt_tokens_min {lo}"))
    if when.prompt_tokens_max is not None:
        hi = when.prompt_tokens_max
        if est <= hi:
            out.append((True, f"prompt_tokens_est {est} <= prompt_tokens_max {hi}"))
        else:
            out.append((False, f"prompt_tokens_est {est} > prompt_tokens_max {hi}"))
    if when.output_tokens_max is not None:
        hi = when.output_tokens_max
        tokens = output_tokens_for(profile, lane)
        if tokens is None:
            out.append(
                (
                    False,
                    "no max tokens in the request and no default_output_tokens: "
                    "never matches output_tokens_max",
                )
            )
        elif tokens <= hi:
            out.append((True, f"output_tokens {tokens} <= output_tokens_max {hi}"))
        else:
            out.append((False, f"output_tokens {tokens} > output_tokens_max {hi}"))
    if when.model is not None:
        model = profile.model
        if model is None:
            out.append((False, f"request names no model; lane wants {when.model!r}"))
        elif _glob_match(when.model, model):
            out.append((True, f"model {model!r} matches {when.model!r}"))
        else:
            out.append((False, f"model {model!r} does not match {when.model!r}"))
    return out


def _b(value: bool) -> str:
    return "true" if value else "false"


def match_lane(
    profile: Profile, lanes: Sequence[LaneConfig], *, explain: bool = False
) -> LaneMatch:
    """The first lane whose ``when`` holds; the last lane (no ``when``) takes the rest.

    With ``explain`` the match carries readable reasons: for each skipped lane every condition
    that failed, for the chosen lane every condition that held.
    """
    if not explain:
        for index, lane in enumerate(lanes):
            if _lane_holds(lane, profile):
                return LaneMatch(lane, index, [])
        raise NoLaneMatched("no lane matches the request and no lane is a catch-all")
    reasons: list[str] = []
    for index, lane in enumerate(lanes):
        conditions = _lane_conditions(lane, profile)
        if all(held for held, _ in conditions):
            reasons.extend(f"lanes[{index}] {lane.name!r} chosen: {why}" for _, why in conditions)
            return LaneMatch(lane, index, reasons)
        reasons.extend(
            f"lanes[{index}] {lane.name!r} skipped: {why}" for held, why in conditions if not held
        )
    raise NoLaneMatched("no lane matches the request and no lane is a catch-all")
