"""Choosing the decode and prefill node of each request from the registry's members and load records.

Decode node: the least loaded usable node, scoring running and queued sequences (the node's last load
report plus this frontend's own outstanding requests, which the ~1 Hz reports lag behind) against its
sequence capacity, and KV blocks in use; a node without enough free blocks for the request ranks last.
With a session key the node is instead the session's owner on a consistent-hash ring of decode nodes,
under bounded load, so a conversation keeps finding its KV prefix there.

Prefill node: `registry.placement.choose_prefill`, the cluster's one prefill rule (prefix affinity on a
consistent-hash ring with bounded loads); the decode node follows the choice while that node is usable.

Exact overlap (a `KVIndex` fed by the nodes' KV event streams, `frontend.kv_index`): when some candidate
holds a leading part of the prompt's blocks, the decode node and the prefill node are each the one holding
the longest part (a pool block counts one, a tier block half: it is read from disk) among the nodes
whose load is within `load_factor` of their role's mean (plus one request), so a hot prefix spills to the
other nodes instead of queueing on one; ties go to the less loaded. Without any overlap the rules above
apply unchanged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.prefix_hash import compute_block_hashes
from pdserve.registry.placement import PrefillChoice, choose_prefill, prefill_load, usable_prefill
from pdserve.registry.ring import HashRing, RingCache, bounded_pick, ring_hash
from pdserve.registry.view import Member

if TYPE_CHECKING:
    from pdserve.frontend.kv_index import KVIndex

__all__ = ["Backlog", "HashRing", "NoRoute", "PoolStatus", "RouteDecision", "RouteLease", "Router", "bounded_pick",
           "ring_hash"]

COOLDOWN_S = 2.0

MembersFn = Callable[[str, str], list[Member]]  # (role, pool model name) -> members


@dataclass(frozen=True)
class RouteDecision:
    """Where one upstream generation goes and why."""

    pool: str
    decode_id: str
    decode_address: str
    decode_reason: str
    decode_rule: str  # "least_loaded" | "session_owner" | "session_spill" (a bounded metric label)
    prefill_hint: str  # the prefill node the decode node is asked to use; "" lets it prefill itself
    prefill_reason: str
    prefill_rule: str  # "prefix_owner" | "prefix_spill" | "least_loaded" | "local"
    prefix_key: str  # hex of the ring key used for prefill affinity ("" when none)
    fingerprint: str  # the pool's model fingerprint
    prompt_tokens: int = 0  # the prompt's length: the prefill work this route adds to its node

    @property
    def prefill_target(self) -> str:
        """The node whose prefill work this route adds to (backlog, TTFT estimate): the hinted prefill
        node, else the decode node itself. Who did prefill is what the decode node reports
        (`Progress.prefilled_by`): it may prefill itself after all."""
        return self.prefill_hint or self.decode_id


@dataclass(frozen=True)
class Backlog:
    """Prefill work queued ahead of a new prompt on one node, as this frontend sees it."""

    ours_tokens: int  # prompt tokens this frontend routed there whose first token has not come
    reported_queue: int  # requests the node's last load record says are waiting there (all frontends)


@dataclass(eq=False)
class RouteLease:
    """This frontend's outstanding-request count on the chosen nodes, held while the request runs."""

    router: Router
    decision: RouteDecision
    prefill_pending: bool = True
    released: bool = field(default=False)
    work_ahead: int = 0  # prefill tokens queued on its node when it was leased, its own included
    tokens_pending: bool = True
    leased_at: float = field(default_factory=time.monotonic)

    def prefill_done(self) -> None:
        """The first token arrived: the prefill node is done with this request (reported to the router's
        `on_first_token`, which learns the prefill rate)."""
        if self.tokens_pending and self.router.on_first_token is not None:
            self.router.on_first_token(self, time.monotonic() - self.leased_at)
        self._settle_prefill()

    def _settle_prefill(self) -> None:
        if self.prefill_pending:
            self.prefill_pending = False
            self.router.adjust(self.router.prefill_outstanding, self.decision.prefill_hint, -1)
        if self.tokens_pending:
            self.tokens_pending = False
            self.router.adjust(self.router.prefill_tokens, self.decision.prefill_target, -self.decision.prompt_tokens)

    def release(self) -> None:
        """The request ended (any way): its counts go away. Idempotent."""
        if self.released:
            return
        self.released = True
        self._settle_prefill()
        self.router.adjust(self.router.decode_outstanding, self.decision.decode_id, -1)


class NoRoute(Exception):
    """No decode node can take the request; `overloaded` tells overload apart from an empty pool."""

    def __init__(self, message: str, overloaded: bool) -> None:
        super().__init__(message)
        self.overloaded = overloaded


@dataclass(frozen=True)
class PoolStatus:
    decode: list[Member]
    prefill: list[Member]
    usable_decode: list[Member]  # decode nodes that are not overloaded

    @property
    def ready(self) -> bool:
        """Can serve: decode nodes with prefill nodes beside them, or colocated decode nodes."""
        return bool(self.decode) and (bool(self.prefill) or any(m.record.colocated for m in self.decode))


class Router:
    """Picks nodes per request; keeps this frontend's outstanding counts per node (changed by leases)."""

    def __init__(self, members: MembersFn, *, load_factor: float, affinity_blocks: int, decode_max_queue: int,
                 kv_index: KVIndex | None = None) -> None:
        self._members = members
        self.kv_index = kv_index
        self.load_factor = load_factor
        self.affinity_blocks = affinity_blocks
        self.decode_max_queue = decode_max_queue
        self.decode_outstanding: dict[str, int] = {}
        self.prefill_outstanding: dict[str, int] = {}
        self.prefill_tokens: dict[str, int] = {}  # node id -> prompt tokens routed there awaiting a first token
        self._rings = RingCache()
        self._rotation = 0
        self._cooldown: dict[str, float] = {}  # node id -> monotonic time until which it is avoided
        # Called with (lease, seconds from lease to first token) when a route's first token arrives.
        self.on_first_token: Callable[[RouteLease, float], None] | None = None

    @staticmethod
    def adjust(counts: dict[str, int], node_id: str, delta: int) -> None:
        if not node_id:
            return
        value = counts.get(node_id, 0) + delta
        if value > 0:
            counts[node_id] = value
        else:
            counts.pop(node_id, None)

    def overloaded(self, member: Member) -> bool:
        load = member.load
        return load is not None and load.queue_len >= self.decode_max_queue

    def status(self, pool: str) -> PoolStatus:
        """The pool's members that take new work (draining ones finish what they have)."""
        decode = [m for m in self._members("decode", pool) if not m.draining]
        prefill = usable_prefill(self._members("prefill", pool))
        return PoolStatus(decode, prefill, [m for m in decode if not self.overloaded(m)])

    def _decode_load(self, m: Member) -> float:
        load = m.load
        ours = self.decode_outstanding.get(m.node_id, 0)
        return float(ours + (0 if load is None else load.running + load.queue_len))

    def _decode_score(self, m: Member, need_blocks: int) -> tuple[float, str]:
        load = m.load
        cap = max(1, m.record.capacity.max_num_seqs)
        total = max(1, m.record.capacity.num_kv_blocks)
        queue = 0 if load is None else load.queue_len
        free = total if load is None else load.kv_blocks_free
        est = self._decode_load(m)
        score = est / cap + queue / cap + (1.0 - min(1.0, free / total))
        if need_blocks > free:
            score += 2.0  # the request would wait for blocks here
        detail = (f"run+queue+ours={est:g} queue={queue} kv_free={free}/{total} "
                  f"need={need_blocks} score={score:.3f}")
        return score, detail

    def route(
        self,
        pool: str,
        prompt_ids: Sequence[int],
        max_tokens: int,
        session_key: str | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> RouteDecision:
        """Chooses the nodes for one generation. Raises NoRoute when no decode node is usable."""
        status = self.status(pool)
        candidates = [m for m in status.usable_decode if m.node_id not in exclude]
        now = time.monotonic()
        healthy = [m for m in candidates if self._cooldown.get(m.node_id, 0.0) <= now]
        candidates = healthy or candidates  # a node that just refused is the last resort for a while
        if not candidates:
            if status.decode and not [m for m in status.decode if m.node_id not in exclude]:
                raise NoRoute(f"no reachable decode node for model pool {pool!r}", overloaded=False)
            if status.decode:
                raise NoRoute(f"every decode node of model pool {pool!r} is overloaded", overloaded=True)
            raise NoRoute(f"no decode node serves model pool {pool!r}", overloaded=False)
        hashes = self._prompt_hashes(candidates[0], prompt_ids)
        exact = self._by_overlap(candidates, hashes, self._decode_load)
        if exact is not None:
            decode, decode_reason = exact
            decode_rule = "kv_overlap"
        else:
            decode, decode_reason, decode_rule = self._pick_decode(candidates, len(prompt_ids) + max_tokens,
                                                                   session_key)
        prefill_nodes = [m for m in status.prefill if m.node_id not in exclude]
        exact_prefill = self._by_overlap(prefill_nodes, hashes, lambda m: prefill_load(m, self.prefill_outstanding))
        if exact_prefill is not None:
            prefill = PrefillChoice(exact_prefill[0].node_id, "kv_overlap", exact_prefill[1])
        else:
            prefill = choose_prefill(prefill_nodes, prompt_ids, self.prefill_outstanding, load_factor=self.load_factor,
                                     affinity_blocks=self.affinity_blocks, rings=self._rings)
        return RouteDecision(
            pool=pool,
            decode_id=decode.node_id,
            decode_address=decode.record.grpc_address,
            decode_reason=decode_reason,
            decode_rule=decode_rule,
            prefill_hint=prefill.node_id,
            prefill_reason=prefill.reason,
            prefill_rule=prefill.rule,
            prefix_key=prefill.prefix_key,
            fingerprint=decode.record.model_fingerprint,
            prompt_tokens=len(prompt_ids),
        )

    def _prompt_hashes(self, member: Member, prompt_ids: Sequence[int]) -> list[bytes]:
        """The chained hashes of the prompt's full blocks as the pool's nodes compute them (their block size
        and seed); none without an index or a block the prefix cache could reuse."""
        rec = member.record
        if self.kv_index is None or len(prompt_ids) <= rec.block_size:
            return []
        return compute_block_hashes(prompt_ids[: len(prompt_ids) - 1], rec.block_size, rec.prefix_hash_seed)

    def _by_overlap(self, members: list[Member], hashes: list[bytes],
                    load: Callable[[Member], float]) -> tuple[Member, str] | None:
        """The member holding the longest leading run of `hashes` (pool blocks 1, tier blocks 0.5) among
        those within the bounded load, the less loaded among equals; None when no member holds any."""
        if not hashes or not members or self.kv_index is None:
            return None
        overlaps = {m.node_id: self.kv_index.overlap(m.node_id, hashes) for m in members}
        if not any(o.blocks for o in overlaps.values()):
            return None
        loads = {m.node_id: load(m) for m in members}
        bound = self.load_factor * sum(loads.values()) / len(members) + 1.0
        eligible = [m for m in members if loads[m.node_id] <= bound and overlaps[m.node_id].blocks]
        if not eligible:
            return None  # every holder is over the bound: the ordinary rule spreads the load
        best = max(eligible, key=lambda m: (overlaps[m.node_id].pool + 0.5 * overlaps[m.node_id].disk,
                                            -loads[m.node_id]))
        o = overlaps[best.node_id]
        return best, (f"cached prefix: {o.pool} pool + {o.disk} tier blocks of {len(hashes)} "
                      f"(load {loads[best.node_id]:g}, bound {bound:.3g})")

    def _pick_decode(self, candidates: list[Member], num_tokens: int, session_key: str | None) -> tuple[Member, str, str]:
        """(node, reason, rule) among usable decode nodes: the session's ring owner under bounded load, or
        the least loaded (ties rotate)."""
        need = math.ceil(num_tokens / candidates[0].record.block_size)
        if session_key and len(candidates) > 1:
            loads = {m.node_id: self._decode_load(m) for m in candidates}
            ring = self._rings.ring(list(loads))
            pick = bounded_pick(ring, ring_hash(session_key.encode()), loads, self.load_factor)
            decode = next(m for m in candidates if m.node_id == pick.node_id)
            decode_reason = f"session affinity: {pick.reason}"
            decode_rule = "session_spill" if pick.spilled else "session_owner"
        else:
            scored = [(self._decode_score(m, need), m) for m in candidates]
            best = min(score for (score, _), _ in scored)
            # Equal scores (an idle pool, say) rotate, so idle nodes share the work instead of the
            # first one by name taking every request until its next load report.
            ties = [(detail, m) for (score, detail), m in scored if score <= best + 1e-9]
            detail, decode = ties[self._rotation % len(ties)]
            self._rotation += 1
            decode_reason = f"least loaded of {len(candidates)}: {detail}"
            decode_rule = "least_loaded"
        return decode, decode_reason, decode_rule

    def mark_unavailable(self, node_id: str, seconds: float = COOLDOWN_S) -> None:
        """A node refused or could not be reached: route around it for `seconds` while others can serve."""
        self._cooldown[node_id] = time.monotonic() + seconds
        if len(self._cooldown) > 256:
            now = time.monotonic()
            self._cooldown = {k: v for k, v in self._cooldown.items() if v > now}

    def backlog(self, decision: RouteDecision) -> Backlog:
        """The prefill work queued ahead on the node that would prefill `decision`'s prompt."""
        node = decision.prefill_target
        role = "prefill" if decision.prefill_hint else "decode"
        member = next((m for m in self._members(role, decision.pool) if m.node_id == node), None)
        queue = 0 if member is None or member.load is None else member.load.queue_len
        return Backlog(self.prefill_tokens.get(node, 0), queue)

    def lease(self, decision: RouteDecision) -> RouteLease:
        """Counts the request (and its prompt's prefill tokens) as outstanding on its nodes until the
        lease is released."""
        ahead = self.prefill_tokens.get(decision.prefill_target, 0)
        self.adjust(self.decode_outstanding, decision.decode_id, +1)
        self.adjust(self.prefill_outstanding, decision.prefill_hint, +1)
        self.adjust(self.prefill_tokens, decision.prefill_target, decision.prompt_tokens)
        return RouteLease(self, decision, prefill_pending=bool(decision.prefill_hint),
                          work_ahead=ahead + decision.prompt_tokens)
