"""What ``tokenlane explain`` shows for one request: its profile, its lane and why, the candidates.

Plain data in, plain data out: the CLI reads the policy, the request and the tokenizer file.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from proxy.config import Policy
from proxy.routing.balance import rendezvous_order
from proxy.routing.estimate import Estimator
from proxy.routing.lanes import match_lane
from proxy.routing.profile import affinity_key, max_prefix_chars, output_tokens_for, profile_request
from proxy.routing.tokens import TokenCounter


def explain_request(
    policy: Policy,
    body: dict[str, Any],
    kind: str,
    chars_per_token: float | None = None,
    *,
    counter: TokenCounter | None = None,
) -> dict[str, Any]:
    """What ``tokenlane explain`` prints: the profile, the lane and why, the candidates.

    No network: candidates are the replicas the policy lists for the lane's pool and its
    ``spill_to`` pool, whatever their health. For a ``prefix_affinity`` pool they are listed
    in the order the key tries them (their loads unknown here, so the bound is not applied).
    ``counter`` counts text exactly, as the gateway does with ``estimate.tokenizer_file``; the
    caller loads it (``load_counter``), so this stays free of I/O.
    """
    cfg = policy.estimate
    estimator = Estimator(
        cfg.chars_per_token if chars_per_token is None else chars_per_token,
        cfg.image_tokens,
        counter=counter,
    )
    profile = profile_request(body, kind, estimator, max_prefix_chars(policy))
    match = match_lane(profile, policy.lanes, explain=True)
    lane = match.lane
    candidates: list[dict[str, Any]] = []
    for role, pool_name in (("pool", lane.pool), ("spill_to", lane.spill_to)):
        if pool_name is None:
            continue
        pool = policy.pools[pool_name]
        replicas = list(pool.replicas)
        key = affinity_key(profile, pool.prefix_chars)
        if pool.balance == "prefix_affinity" and key is not None:
            rank = {
                name: i for i, name in enumerate(rendezvous_order(key, [r.label for r in replicas]))
            }
            replicas.sort(key=lambda r: rank[r.label])
        for replica in replicas:
            candidates.append(
                {
                    "pool": pool_name,
                    "role": role,
                    "balance": pool.balance,
                    "name": replica.label,
                    "url": replica.url,
                    "max_in_flight": replica.max_in_flight,
                }
            )
    return {
        "profile": asdict(profile),
        "chars_per_token": estimator.ratio(profile.model),
        "tokenizer_file": cfg.tokenizer_file,
        "lane": {
            "index": match.index,
            "name": lane.name,
            "pool": lane.pool,
            "spill_to": lane.spill_to,
            "output_tokens": output_tokens_for(profile, lane),
        },
        "reasons": match.reasons,
        "candidates": candidates,
    }
