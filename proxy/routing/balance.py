"""Picking one replica among candidates: round robin, power of two choices, prefix affinity.

Pure functions over a snapshot. The caller has already filtered the candidates (healthy, serving
the model, not yet tried for this request, not saturated) and owns the round-robin counter; this
module only chooses. Randomness comes from an injected ``random.Random`` so tests are repeatable.

Strategies (docs/architecture.md, "Routing"):

- ``round_robin``: ``candidates[rr_index % n]``.
- ``least_loaded``: power of two choices (Mitzenmacher). Two distinct candidates drawn at random,
  the one with the lower ``load`` wins, ties by the RNG. Cheaper than a scan and, unlike "always
  the minimum", it does not herd every request of a burst onto the one replica whose load figure
  is momentarily lowest (loads are scraped, so they lag).
- ``prefix_affinity``: rendezvous (highest random weight) hashing of the affinity key over the
  candidate names, with bounded load (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with
  Bounded Loads", 2018). Candidates are tried in descending hash-weight order and the first whose
  load *after* placing this request stays within the cap takes it::

      cap = ceil(bounded_load * (total_load + 1) / n)      # n = len(candidates)
      accept c  iff  c.load + 1 <= cap

  ``total_load + 1`` is the candidates' load with this request placed, so ``cap`` is
  ``bounded_load`` times the mean *after* placement, rounded up to a whole request. With integer
  loads some candidate always fits (the capacities sum to at least ``total_load + 1``), so when
  every placement goes through this function no replica ever holds more than
  ``ceil(bounded_load * mean)``; that is the guarantee the tests check. Loads may be fractional
  in principle (scraped queues); if then nobody fits, the least-loaded candidate (earliest in
  hash order among equals) takes it. Without a key the strategy falls back to ``least_loaded``.

  Removing a replica moves only the keys it held; adding one moves about 1/n of the keys, all to
  the newcomer. Hashing is stable across processes (blake2b, never Python's salted ``hash()``):
  two gateway instances send the same prefix to the same replica.

The fourth strategy, ``cache_aware``, keeps state (per-replica prefix indexes): it lives in
``cache_aware.py`` and the relay calls it directly; ``pick`` here covers the stateless three.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from hashlib import blake2b
from typing import Final, Protocol, TypeVar

__all__ = [
    "STRATEGIES",
    "Candidate",
    "key_hash",
    "least_loaded",
    "pick",
    "prefix_affinity",
    "rendezvous_order",
    "round_robin",
]

STRATEGIES: Final = ("least_loaded", "prefix_affinity", "round_robin")


class Candidate(Protocol):
    """Anything with a stable name and a current load (``fleet.Replica`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def load(self) -> float: ...


C = TypeVar("C", bound=Candidate)

_MASK64: Final = (1 << 64) - 1
# Replica names are few and long-lived; the cap only guards against churn (DNS expansion).
_NAME_HASH_CACHE_MAX: Final = 4096
_name_hashes: Final[dict[str, int]] = {}


def key_hash(key: str) -> int:
    """A 64-bit hash of ``key``, identical in every process (unlike ``hash(str)``)."""
    # surrogatepass: JSON bodies may carry lone surrogates ("\\ud800"), which strict UTF-8 refuses.
    digest = blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _name_hash(name: str) -> int:
    h = _name_hashes.get(name)
    if h is None:
        if len(_name_hashes) >= _NAME_HASH_CACHE_MAX:
            _name_hashes.clear()
        h = _name_hashes[name] = key_hash(name)
    return h


def _weight(kh: int, name: str) -> int:
    """Rendezvous weight of a (key, name) pair: the splitmix64 finaliser of their XOR.

    The finaliser is a bijection with full avalanche, so for one key the names' weights are
    distinct and their order is a uniform random permutation. (``_weights`` inlines this.)
    """
    z = kh ^ _name_hash(name)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _weights(kh: int, candidates: Sequence[Candidate]) -> list[int]:
    # The hot loop of prefix affinity: ~0.35 µs per candidate, mostly 64-bit big-int arithmetic.
    get = _name_hashes.get
    out = []
    for c in candidates:
        nh = get(c.name)
        z = kh ^ (_name_hash(c.name) if nh is None else nh)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(z ^ (z >> 31))
    return out


def rendezvous_order(key: str, names: Sequence[str]) -> list[str]:
    """``names`` in the order prefix affinity tries them for ``key`` (for ``explain`` and tests)."""
    kh = key_hash(key)
    return sorted(names, key=lambda name: _weight(kh, name), reverse=True)


def round_robin(candidates: Sequence[C], rr_index: int) -> C:
    return candidates[rr_index % len(candidates)]


def least_loaded(candidates: Sequence[C], rng: random.Random) -> C:
    """Power of two choices on ``load``; ties broken by ``rng``. ``candidates`` is not empty."""
    n = len(candidates)
    if n == 1:
        return candidates[0]
    if n == 2:
        a, b = candidates[0], candidates[1]
    else:
        i = rng.randrange(n)
        j = rng.randrange(n - 1)
        if j >= i:
            j += 1  # two distinct candidates, each pair equally likely
        a, b = candidates[i], candidates[j]
    la, lb = a.load, b.load
    if la < lb:
        return a
    if lb < la:
        return b
    return a if rng.random() < 0.5 else b


def prefix_affinity(
    candidates: Sequence[C], key: str | None, rng: random.Random, bounded_load: float
) -> C:
    """Rendezvous hashing with bounded load (see the module docstring for the exact bound)."""
    n = len(candidates)
    if key is None:
        return least_loaded(candidates, rng)
    if n == 1:
        return candidates[0]
    loads = [c.load for c in candidates]
    # The small epsilon keeps float noise in bounded_load * x from adding a whole request.
    cap = math.ceil(bounded_load * (sum(loads) + 1) / n - 1e-9)
    weights = _weights(key_hash(key), candidates)
    best = weights.index(max(weights))
    if loads[best] + 1 <= cap:
        return candidates[best]  # the common case: the key's own replica is within bounds
    order = sorted(range(n), key=weights.__getitem__, reverse=True)
    for i in order:
        if loads[i] + 1 <= cap:
            return candidates[i]
    # Only reachable with fractional loads: the lightest, earliest in hash order among equals.
    return candidates[min(order, key=loads.__getitem__)]


def pick(
    strategy: str,
    candidates: Sequence[C],
    *,
    key: str | None,
    rng: random.Random,
    rr_index: int,
    bounded_load: float,
) -> C | None:
    """One candidate by ``strategy``, or None when there are none.

    ``key`` is the affinity key (``prefix_affinity`` only), ``rr_index`` the caller's round-robin
    counter (``round_robin`` only; the caller advances it), ``bounded_load`` the pool's
    ``bounded_load`` (``prefix_affinity`` only).
    """
    if not candidates:
        return None
    if strategy == "least_loaded":
        return least_loaded(candidates, rng)
    if strategy == "prefix_affinity":
        return prefix_affinity(candidates, key, rng, bounded_load)
    if strategy == "round_robin":
        return round_robin(candidates, rr_index)
    raise ValueError(f"unknown balance strategy {strategy!r}; expected one of {STRATEGIES}")
