"""The prefill-node rule. One rule, two callers: the frontend's router applies it to every request (it
sees the prompt before any node does and counts its own outstanding requests per node), and a decode
node applies it only when its caller named no usable prefill node (direct gRPC callers, or a hinted node
that left or drains meanwhile). Whether a request is prefilled remotely at all is the decode node's
call (its own prefix cache and local-prefill threshold), not this rule's.

The rule: the owner of the prompt's leading-block prefix hash (the chained hash every node of the pool
computes, so the key is what the node's prefix cache is keyed on) on a consistent-hash ring of the pool's
usable prefill nodes, walking on past nodes whose load exceeds `load_factor` times the average
(consistent hashing with bounded loads): requests sharing a prefix land on one node and hit its cache
while its load allows, unrelated prefixes spread over the ring. A prompt shorter than a block goes to the
least loaded node. A node's load is its published queue + running, plus what the caller has outstanding
there (the ~1 Hz load reports lag behind).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.engine.prefix_hash import compute_block_hashes
from pdserve.registry.ring import RingCache, bounded_pick
from pdserve.registry.view import Member

DEFAULT_LOAD_FACTOR = 1.25  # bounded-load factor of the ring (> 1)
DEFAULT_AFFINITY_BLOCKS = 1  # leading prompt blocks hashed for prefix affinity


@dataclass(frozen=True)
class PrefillChoice:
    """Where a request is prefilled, and why."""

    node_id: str  # "" when no prefill node is usable: the decode node prefills locally
    rule: str  # "prefix_owner" | "prefix_spill" | "least_loaded" | "local" (a bounded metric label)
    reason: str
    prefix_key: str = ""  # hex of the ring key used for prefix affinity ("" when none)


def usable_prefill(members: Sequence[Member], fingerprint: str = "", block_size: int = 0) -> list[Member]:
    """The prefill members that take new work (not draining), of the given pool invariants when given."""
    return [
        m for m in members
        if m.role == "prefill" and not m.draining
        and (not fingerprint or m.record.model_fingerprint == fingerprint)
        and (not block_size or m.record.block_size == block_size)
    ]


def prefill_load(member: Member, outstanding: Mapping[str, int]) -> float:
    load = member.load
    return float(outstanding.get(member.node_id, 0) + (0 if load is None else load.queue_len + load.running))


def choose_prefill(
    members: Sequence[Member], prompt_ids: Sequence[int], outstanding: Mapping[str, int], *,
    load_factor: float = DEFAULT_LOAD_FACTOR, affinity_blocks: int = DEFAULT_AFFINITY_BLOCKS,
    rings: RingCache | None = None,
) -> PrefillChoice:
    """The prefill node of one request among `members` (usable prefill nodes of one pool; see
    `usable_prefill`). `outstanding`: the caller's own requests per node. Changes nothing."""
    if not members:
        return PrefillChoice("", "local", "no prefill node in the pool: the decode node prefills")
    rec = members[0].record
    loads = {m.node_id: prefill_load(m, outstanding) for m in members}
    blocks = min(affinity_blocks, len(prompt_ids) // rec.block_size)
    if blocks == 0:
        node_id = min(loads, key=lambda nid: (loads[nid], nid))
        return PrefillChoice(node_id, "least_loaded",
                             f"least loaded (prompt shorter than one block; load {loads[node_id]:g})")
    hashes = compute_block_hashes(prompt_ids[: blocks * rec.block_size], rec.block_size, rec.prefix_hash_seed)
    key = int.from_bytes(hashes[-1][:8], "big")
    pick = bounded_pick((rings or RingCache()).ring(list(loads)), key, loads, load_factor)
    return PrefillChoice(pick.node_id, "prefix_spill" if pick.spilled else "prefix_owner",
                         f"prefix affinity on {blocks} block(s): {pick.reason}", hashes[-1][:8].hex())
