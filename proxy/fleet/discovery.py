"""DNS discovery: a replica with ``dns: true`` stands for every address its host resolves to.

With ``docker compose up --scale vllm-bulk=4`` the service name resolves to four containers;
the policy names it once. The declared policy is kept as written, and an *effective* policy
with those replicas expanded (one per address) is what the fleet serves. Expansion is pure;
resolving is the only I/O, on its own loop, re-run every ``health.interval_s`` × 10. A lookup
that fails keeps the last addresses it had, so a DNS hiccup does not empty a pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from urllib.parse import urlsplit

from proxy.config import Policy, ReplicaConfig

log = logging.getLogger("tokenlane.discovery")

Addresses = Mapping[str, Sequence[str]]  # host -> resolved addresses, sorted


def dns_hosts(policy: Policy) -> set[str]:
    """The hosts of every ``dns: true`` replica."""
    return {
        urlsplit(r.url).hostname or ""
        for pool in policy.pools.values()
        for r in pool.replicas
        if r.dns
    }


def expand_replica(replica: ReplicaConfig, addresses: Sequence[str]) -> list[ReplicaConfig]:
    """One replica per address: the same settings, the address in the URL, and a name that
    says both what was declared and which address it is (``bulk@10.0.0.7``)."""
    parts = urlsplit(replica.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    base = replica.name or parts.hostname
    out = []
    for address in addresses:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        out.append(
            replica.model_copy(
                update={
                    "url": f"{parts.scheme}://{host}:{port}",
                    "name": f"{base}@{address}",
                    "dns": False,
                }
            )
        )
    return out


def expand(policy: Policy, addresses: Addresses) -> Policy:
    """The effective policy: ``dns: true`` replicas replaced by one per known address (none
    while a host has never resolved)."""
    if not any(r.dns for p in policy.pools.values() for r in p.replicas):
        return policy
    pools = {}
    for name, pool in policy.pools.items():
        replicas: list[ReplicaConfig] = []
        for r in pool.replicas:
            if r.dns:
                host = urlsplit(r.url).hostname or ""
                replicas.extend(expand_replica(r, addresses.get(host, ())))
            else:
                replicas.append(r)
        pools[name] = pool.model_copy(update={"replicas": replicas})
    return policy.model_copy(update={"pools": pools})


Resolver = Callable[[str], Awaitable[list[str]]]


async def resolve(host: str) -> list[str]:
    """The host's addresses, sorted (IPv4 and IPv6; TCP)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class Discovery:
    """Keeps the last known addresses of each ``dns: true`` host and re-resolves them."""

    def __init__(self, resolver: Resolver = resolve) -> None:
        self.resolver = resolver
        self.addresses: dict[str, list[str]] = {}

    async def refresh(self, hosts: set[str]) -> bool:
        """Resolve every host; True when some host's addresses changed."""
        changed = False
        for host in sorted(hosts):
            try:
                found = await self.resolver(host)
            except OSError as exc:
                log.warning(
                    "cannot resolve %s (keeping %s): %s", host, self.addresses.get(host, []), exc
                )
                continue
            if found != self.addresses.get(host):
                log.info("%s resolves to %s (was %s)", host, found, self.addresses.get(host, []))
                self.addresses[host] = found
                changed = True
        for host in set(self.addresses) - hosts:
            del self.addresses[host]
            changed = True
        return changed
