"""Reading a policy file: YAML with the position of every key, environment overrides, and every
problem of a file in one pass (shape and cross-references), each at its line and column with a
"did you mean" for unknown keys. The models it validates against are in ``proxy.config``."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from proxy.config import (
    ENV_PREFIX,
    Policy,
)
from proxy.errors import PolicyError

Loc = tuple[int | str, ...]


@dataclass(frozen=True)
class Problem:
    """One fault of a policy, with where it came from: a line and column of the file, or the
    environment variable that set it."""

    loc: Loc
    message: str
    hint: str = ""
    line: int | None = None  # 1-based
    column: int | None = None  # 1-based
    env: str | None = None  # "TOKENLANE_X__Y=raw" when an override set the value
    has_path: bool = True  # False for faults of the text itself (YAML syntax)

    def plain(self) -> str:
        """``path: message``, as the reload log and the admin API report it."""
        if not self.has_path:
            return self.message
        return f"{format_path(self.loc)}: {self.message}"

    def located(self, name: str) -> str:
        """The line ``tokenlane check`` prints: where, path, message and hint."""
        text = f"{self.plain()}{self.hint}"
        if self.env is not None:
            return f"{self.env} (environment): {text}"
        if self.line is None:
            return f"{name}: {text}"
        return f"{name}:{self.line}:{self.column}: {text}"


Marks = dict[Loc, tuple[int, int]]


def _positions(node: yaml.Node, loc: Loc, keys: Marks, values: Marks, out: list[Problem]) -> None:
    """Record where every key and value of the composed YAML starts; name duplicate keys
    (PyYAML would keep the last one silently)."""
    values[loc] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            here = (*loc, key)
            mark = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            if key in seen:
                out.append(Problem(here, f"duplicate key {key!r}", line=mark[0], column=mark[1]))
                continue
            seen.add(key)
            keys[here] = mark
            _positions(value_node, here, keys, values, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _positions(item, (*loc, i), keys, values, out)


def _yaml_error(exc: yaml.YAMLError, name: str) -> Problem:
    mark = getattr(exc, "problem_mark", None)
    what = " ".join(
        str(part) for part in (getattr(exc, "context", None), getattr(exc, "problem", None)) if part
    )
    message = f"not valid YAML in {name}: {what or exc}"
    if mark is None:
        return Problem((), message, has_path=False)
    return Problem((), message, line=mark.line + 1, column=mark.column + 1, has_path=False)


def parse_yaml(text: str, name: str = "<policy>") -> Any:
    """Plain data from YAML text; ``PolicyError`` naming ``name``, the line and the column for
    a syntax error or a duplicate key."""
    data, _, _, problems = _compose(text, name)
    if problems:
        raise PolicyError.of(problems)
    return data


def _compose(text: str, name: str) -> tuple[Any, Marks, Marks, list[Problem]]:
    keys: Marks = {}
    values: Marks = {}
    problems: list[Problem] = []
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            return None, keys, values, problems
        _positions(node, (), keys, values, problems)
        data = yaml.SafeLoader("").construct_document(node)
    except yaml.YAMLError as exc:
        return None, keys, values, [_yaml_error(exc, name)]
    return data, keys, values, problems


def format_path(loc: tuple[int | str, ...]) -> str:
    """``("lanes", 1, "pool")`` → ``lanes[1].pool``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The model whose keys live at ``loc`` (``("lanes", 0)`` → LaneConfig)."""
    model: type[BaseModel] = Policy
    i = 0
    while i < len(loc):
        part = loc[i]
        if not isinstance(part, str) or part not in model.model_fields:
            return None
        found = models_in(model.model_fields[part].annotation)
        if found is None:
            return None
        suffix, model = found
        i += 1 + suffix.count(".<name>") + suffix.count("[]")
    return model


def did_you_mean(loc: Loc) -> str:
    """`` (did you mean `spill_to`?)`` for an unknown key close to a real one, else ``""``."""
    model = _model_at(loc[:-1])
    if model is None or not isinstance(loc[-1], str):
        return ""
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _shape_problems(exc: ValidationError) -> list[Problem]:
    problems = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
        msg = err["msg"]
        hint = ""
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            hint = did_you_mean(loc)
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        problems.append(Problem(loc, msg, hint))
    return problems


def _reference_problems(data: Mapping[str, Any]) -> list[Problem]:
    """The cross-references that can be judged on data whose shape failed: lanes naming pools
    that do not exist, lane names used twice. So one run names them with the shape faults."""
    pools = data.get("pools")
    lanes = data.get("lanes")
    if not isinstance(pools, Mapping) or not isinstance(lanes, list):
        return []
    problems = []
    seen: set[Any] = set()
    for i, lane in enumerate(lanes):
        if not isinstance(lane, Mapping):
            continue
        name = lane.get("name")
        if isinstance(name, str):
            if name in seen:
                problems.append(Problem(("lanes", i, "name"), f"duplicate lane name {name!r}"))
            seen.add(name)
        for key in ("pool", "spill_to"):
            ref = lane.get(key)
            if isinstance(ref, str) and ref not in pools:
                problems.append(Problem(("lanes", i, key), f"unknown pool {ref!r}"))
    return problems


def relation_problems(policy: Policy) -> list[str]:
    """Faults between sections that the shape cannot express."""
    return [p.plain() for p in _relations(policy)]


def _relations(policy: Policy) -> list[Problem]:
    problems: list[Problem] = []
    seen_lanes: set[str] = set()
    last = len(policy.lanes) - 1
    for i, lane in enumerate(policy.lanes):
        if lane.name in seen_lanes:
            problems.append(Problem(("lanes", i, "name"), f"duplicate lane name {lane.name!r}"))
        seen_lanes.add(lane.name)
        if lane.pool not in policy.pools:
            problems.append(Problem(("lanes", i, "pool"), f"unknown pool {lane.pool!r}"))
        if lane.spill_to is not None:
            where: Loc = ("lanes", i, "spill_to")
            if lane.spill_to not in policy.pools:
                problems.append(Problem(where, f"unknown pool {lane.spill_to!r}"))
            elif lane.spill_to == lane.pool:
                problems.append(Problem(where, f"spills to its own pool {lane.pool!r}"))
        if i == last and lane.when is not None:
            problems.append(
                Problem(
                    ("lanes", i, "when"),
                    "the last lane takes every request left and must have no `when`",
                )
            )
        if i != last and lane.when is None:
            problems.append(
                Problem(
                    ("lanes", i, "when"),
                    "only the last lane may omit `when` (this one would hide the lanes after it)",
                )
            )
        when = lane.when
        if (
            when is not None
            and when.prompt_tokens_min is not None
            and when.prompt_tokens_max is not None
            and when.prompt_tokens_min > when.prompt_tokens_max
        ):
            problems.append(
                Problem(("lanes", i, "when"), "prompt_tokens_min is above prompt_tokens_max")
            )
    for pool_name, pool in policy.pools.items():
        names: set[str] = set()
        urls: set[str] = set()
        for j, replica in enumerate(pool.replicas):
            where = ("pools", pool_name, "replicas", j)
            if replica.label in names:
                problems.append(
                    Problem((*where, "name"), f"duplicate replica name {replica.label!r}")
                )
            if replica.url in urls:
                problems.append(Problem((*where, "url"), f"duplicate replica URL {replica.url!r}"))
            names.add(replica.label)
            urls.add(replica.url)
    if policy.health.eject_max_s < policy.health.eject_base_s:
        problems.append(Problem(("health", "eject_max_s"), "below health.eject_base_s"))
    if policy.redis.ttl_s <= policy.redis.heartbeat_s:
        # The load key would expire before its next rewrite: a live instance would flicker.
        problems.append(Problem(("redis", "ttl_s"), "must be above redis.heartbeat_s"))
    return problems


def _validate(data: Any) -> tuple[Policy | None, list[Problem]]:
    if not isinstance(data, Mapping):
        return None, [Problem((), "expected a mapping with `pools` and `lanes`")]
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        return None, _shape_problems(exc) + _reference_problems(data)
    return policy, _relations(policy)


def build_policy(data: Any) -> Policy:
    """Validate plain data (parsed YAML with overrides applied) into a ``Policy``."""
    policy, problems = _validate(data)
    if problems or policy is None:
        raise PolicyError.of(problems)
    return policy


def _env_items(environ: Mapping[str, str]) -> list[tuple[str, str, list[str], Any]]:
    out = []
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX) :].split("__")]
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        out.append((key, raw, path, value))
    return sorted(out, key=lambda item: (item[2], item[0]))


def env_overrides(environ: Mapping[str, str]) -> list[tuple[list[str], Any]]:
    """``TOKENLANE_SERVER__PORT=9000`` → ``(["server", "port"], 9000)``.

    Only variables with ``__`` count: the single-level ones (``TOKENLANE_ADMIN_TOKEN``,
    ``TOKENLANE_API_KEYS``) are secrets the policy points at, not policy keys. Values are read as
    YAML scalars so that ``true``, ``1.5`` and ``null`` mean what they say.
    """
    return [(path, value) for _, _, path, value in _env_items(environ)]


def apply_override(data: dict[str, Any], path: list[str], value: Any) -> Loc:
    """Set ``path`` in ``data``; return the path as the data spells it (pool names keep their
    case, list items are indexes)."""
    node: Any = data
    loc: list[int | str] = []
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise PolicyError([f"{ENV_PREFIX}{'__'.join(path).upper()}: no such list item"])
            loc.append(int(part))
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
            continue
        # Pool names are free text; match them without regard to case.
        match = next((k for k in node if isinstance(k, str) and k.lower() == part), part)
        loc.append(match)
        if last:
            node[match] = value
        else:
            node = node.setdefault(match, {})
            if not isinstance(node, (dict, list)):
                raise PolicyError([f"{ENV_PREFIX}{'__'.join(path).upper()}: not a section"])
    return tuple(loc)


def analyse(
    text: str,
    name: str,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[Policy | None, list[Problem]]:
    """Every problem of a policy text in one pass (syntax, shape and cross-references), each
    placed at its line and column or at the environment variable that caused it."""
    data, keys, values, problems = _compose(text, name)
    if problems and data is None:
        return None, problems
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return None, [*problems, Problem((), "expected a mapping with `pools` and `lanes`")]
    from_env: dict[Loc, str] = {}
    for var, raw, env_path, value in _env_items(os.environ if environ is None else environ):
        try:
            from_env[apply_override(data, env_path, value)] = f"{var}={raw}"
        except PolicyError as exc:
            problems.extend(
                Problem((), m, env=f"{var}={raw}", has_path=False) for m in exc.problems
            )
    for dotted, value in (overrides or {}).items():
        if value is not None:
            apply_override(data, dotted.split("."), value)
    policy, found = _validate(data)
    for problem in found:
        problems.append(_place(problem, keys, values, from_env))
    return (policy if not problems else None), problems


def _place(problem: Problem, keys: Marks, values: Marks, from_env: dict[Loc, str]) -> Problem:
    loc = problem.loc
    for n in range(len(loc), 0, -1):
        if loc[:n] in from_env:
            return replace(problem, env=from_env[loc[:n]])
    # An unknown key points at the key; a bad value at the value; a missing key at the
    # nearest section that exists.
    exact = keys.get(loc) if problem.message == "unknown key" else values.get(loc)
    if exact is None:
        exact = next((values[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in values), None)
    if exact is None:
        return problem
    return replace(problem, line=exact[0], column=exact[1])


def load_policy(
    path: str | Path,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Policy:
    """Read, override and validate a policy file; raise ``PolicyError`` naming every problem.

    ``overrides`` are dotted keys from the command line (``{"server.port": 9000}``).
    """
    text = read_policy_text(path)
    return policy_from_text(text, environ=environ, overrides=overrides, name=str(path))


def read_policy_text(path: str | Path) -> str:
    """A policy file's text; ``PolicyError`` naming the file when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError([f"{path}: {exc.strerror or exc}"]) from None


def policy_from_text(
    text: str,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    name: str = "<policy>",
) -> Policy:
    policy, problems = analyse(text, name, environ=environ, overrides=overrides)
    if problems or policy is None:
        raise PolicyError.of(problems)
    return policy


def models_in(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """For a field's annotation, the suffix its keys take and the model they belong to:
    ``dict[str, PoolConfig]`` → (``.<name>``, PoolConfig), ``list[LaneConfig]`` → (``[]``, ...)."""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "", annotation
    if origin is dict and len(args) == 2:
        inner = models_in(args[1])
        return (".<name>" + inner[0], inner[1]) if inner else None
    if origin is list and args:
        inner = models_in(args[0])
        return ("[]" + inner[0], inner[1]) if inner else None
    for arg in args:  # X | None
        if arg is not type(None):
            found = models_in(arg)
            if found:
                return found
    return None
