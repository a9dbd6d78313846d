"""What shared state stores in Redis, as plain data: the replica record and the load hashes.

A replica's record is JSON in the ``{prefix}:replicas`` hash (and on its channel); each
instance's load is a hash of url → in-flight count with an ``_at`` stamp. Decoding either never
trusts the content: another writer's junk is refused (``ValueError``) or skipped.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    """One replica's shared state, as stored in Redis and published.

    ``until``: Unix time an ejection ends; None when the state has no end (``healthy``,
    ``probing``, ``draining``, or an operator ejection that lasts until readmitted).
    ``ejections``: the total, counted by the merge script. ``level``: the backoff level behind
    the current ejection's length. ``updated_at``: Redis server time of the write, which orders
    what readers apply; 0 until written. ``instance``: who wrote it. ``changed_at``: Unix time
    (ms precision) the writer made the transition, which decides between competing writes; 0
    when unknown (records written before the field existed), which is the oldest.
    """

    pool: str
    url: str
    state: str
    reason: str | None = None
    until: float | None = None
    ejections: int = 0
    level: int = 0
    updated_at: float = 0.0
    instance: str = ""
    changed_at: float = 0.0

    @property
    def field(self) -> str:
        return f"{self.pool} {self.url}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ReplicaRecord:
        """Raises ``ValueError`` for anything that is not a record (another writer's junk)."""
        try:
            data = json.loads(raw)
            until = data.get("until")
            return cls(
                pool=str(data["pool"]),
                url=str(data["url"]),
                state=str(data["state"]),
                reason=None if data.get("reason") is None else str(data["reason"]),
                until=None if until is None else float(until),
                ejections=int(data.get("ejections") or 0),
                level=int(data.get("level") or 0),
                updated_at=float(data.get("updated_at") or 0.0),
                instance=str(data.get("instance") or ""),
                changed_at=float(data.get("changed_at") or 0.0),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a replica record: {raw!r:.200}") from exc


def sum_load(
    hashes: Mapping[str, Mapping[str, str]], now: float, ttl_s: float
) -> tuple[dict[str, int], int, list[str]]:
    """Other instances' load hashes → (url → in-flight sum, live instances, dead ids).

    A hash that is gone is a dead instance (its key expired). One whose ``_at`` is older than
    the TTL is treated as missing but not pruned: its writer's clock may be off.
    """
    totals: dict[str, int] = {}
    live = 0
    dead: list[str] = []
    for instance, fields in hashes.items():
        if not fields:
            dead.append(instance)
            continue
        try:
            at = float(fields.get("_at", "0"))
        except ValueError:
            at = 0.0
        if now - at > ttl_s:
            continue
        live += 1
        for url, value in fields.items():
            if url == "_at":
                continue
            with contextlib.suppress(ValueError):
                totals[url] = totals.get(url, 0) + int(value)
    return totals, live, dead
