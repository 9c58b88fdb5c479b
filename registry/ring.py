"""Consistent hashing with bounded loads over node ids (the frontend's session affinity and the prefill
rule's prefix affinity)."""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

VNODES_PER_NODE = 64


def ring_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring over node ids with virtual nodes. Immutable."""

    def __init__(self, node_ids: Sequence[str], vnodes: int = VNODES_PER_NODE) -> None:
        points = sorted((ring_hash(f"{nid}#{v}".encode()), nid) for nid in node_ids for v in range(vnodes))
        self._keys = [k for k, _ in points]
        self._ids = [nid for _, nid in points]
        self.size = len(set(node_ids))

    def walk(self, key: int) -> Iterator[str]:
        """Distinct node ids in ring order, starting at the owner of `key`."""
        if not self._ids:
            return
        start = bisect.bisect_left(self._keys, key)
        seen: set[str] = set()
        n = len(self._ids)
        for i in range(n):
            nid = self._ids[(start + i) % n]
            if nid not in seen:
                seen.add(nid)
                yield nid
                if len(seen) == self.size:
                    return


class RingCache:
    """Rings by membership, so a stable membership hashes its virtual nodes once."""

    def __init__(self, limit: int = 64) -> None:
        self._rings: dict[tuple[str, ...], HashRing] = {}
        self._limit = limit

    def ring(self, node_ids: Sequence[str]) -> HashRing:
        key = tuple(sorted(node_ids))
        ring = self._rings.get(key)
        if ring is None:
            if len(self._rings) > self._limit:  # membership churn: drop rings of old memberships
                self._rings.clear()
            ring = self._rings[key] = HashRing(key)
        return ring


@dataclass(frozen=True)
class Pick:
    node_id: str
    spilled: bool  # not the ring owner: the owner was at its load bound
    reason: str


def bounded_pick(ring: HashRing, key: int, loads: dict[str, float], factor: float) -> Pick:
    """Consistent hashing with bounded loads: the first node from `key`'s owner on whose load, plus this
    request, stays within factor x the average load (plus this request)."""
    cap = math.ceil(factor * (sum(loads.values()) + 1) / max(1, len(loads)))
    owner = ""
    for nid in ring.walk(key):
        owner = owner or nid
        if loads.get(nid, 0.0) + 1 <= cap:
            if nid == owner:
                return Pick(nid, False, f"ring owner (load {loads.get(nid, 0.0):g}, cap {cap})")
            return Pick(nid, True, f"spilled from owner {owner} (load {loads.get(owner, 0.0):g} >= cap {cap})")
    return Pick(owner, False, f"ring owner, every node at cap {cap}")
