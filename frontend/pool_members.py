"""Which registered nodes serve a pool: those whose tokenizer and chat template are the frontend's own.

The frontend tokenizes and renders chat prompts itself and sends token ids; a node that loaded another
tokenizer or chat template would read them as other text, and context checks, limits, billing and prefix
routing would all count the wrong tokens. Each node publishes the digests of what it loaded in its record
(`engine.version.tokenizer_digest` / `chat_template_digest`); a node whose digests differ from the served
model's is excluded: not routed to (chat, completions, responses, embeddings) until it registers again
with matching ones. A record without digests (a node older than them) is routed to, with a log line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.frontend.metrics import POOL, FrontendMetrics
from pdserve.registry.records import NodeRecord
from pdserve.registry.view import Member, RegistryView, ViewChange

log = logging.getLogger(__name__)

REASONS = ("tokenizer", "chat_template")  # the `reason` label values, in the order they are checked
_SHOWN = 8  # digest characters a log line shows


@dataclass(frozen=True)
class Digests:
    """What a pool's nodes must have loaded: the served model's tokenizer and chat template digests."""

    tokenizer: str
    chat_template: str


def mismatches(record: NodeRecord, expected: Digests) -> list[tuple[str, str, str]]:
    """(reason, node's digest, frontend's digest) for each digest the record publishes that differs."""
    pairs = ((REASONS[0], record.tokenizer_digest, expected.tokenizer),
             (REASONS[1], record.chat_template_digest, expected.chat_template))
    return [(reason, theirs, ours) for reason, theirs, ours in pairs if theirs and theirs != ours]


class PoolMembers:
    """The registry view's members, less the excluded nodes; logs each node's verdict once per record and
    keeps `pdserve_frontend_nodes_excluded{model_pool,reason}` at the number of nodes excluded."""

    def __init__(self, view: RegistryView, expected: dict[str, Digests], metrics: FrontendMetrics) -> None:
        self.view = view
        self.expected = expected  # pool -> digests
        self._metrics = metrics
        # node id -> reason, as last logged; kept when the node leaves, so its return is logged
        self._excluded: dict[str, str] = {}
        self._counted: set[tuple[str, str]] = set()  # (pool, reason) series set so far
        for pool in expected:
            for reason in REASONS:
                self._set_count(pool, reason, 0)

    def excluded_reason(self, member: Member) -> str | None:
        """Why `member` may not serve its pool ("tokenizer" / "chat_template"), None when it may."""
        expected = self.expected.get(member.record.model)
        found = mismatches(member.record, expected) if expected is not None else []
        return found[0][0] if found else None

    def members(self, role: str | None, pool: str) -> list[Member]:
        """The pool's members of `role` (None: both) that may serve it, sorted by node id."""
        return [m for m in self.view.members(role=role, model=pool) if self.excluded_reason(m) is None]

    def excluded(self) -> dict[str, str]:
        """node id -> reason of every excluded node in the view now."""
        return {m.node_id: r for m in self.view.members() if (r := self.excluded_reason(m)) is not None}

    def on_change(self, change: ViewChange) -> None:
        """Registry view callback: judges a node when its record arrives or changes; recounts the gauge."""
        if change.kind == "load":
            return
        if change.member is not None:
            self._judge(change.member)
        self._recount()

    def _judge(self, member: Member) -> None:
        rec = member.record
        expected = self.expected.get(rec.model)
        if expected is None:
            return  # a pool this frontend does not serve
        found = mismatches(rec, expected)
        where = f"{rec.role} node {rec.node_id} of model pool {rec.model!r}"
        if found:
            self._excluded[rec.node_id] = found[0][0]
            why = "; ".join(f"its {reason.replace('_', ' ')} digest {theirs[:_SHOWN]} differs from the frontend's "
                            f"{ours[:_SHOWN]}" for reason, theirs, ours in found)
            log.error("%s excluded (not routed to): %s; restart it with the frontend's tokenizer and chat "
                      "template to bring it back", where, why)
            return
        if self._excluded.pop(rec.node_id, None) is not None:
            log.info("%s back in the pool: its tokenizer and chat template digests now match", where)
        if not rec.tokenizer_digest or not rec.chat_template_digest:
            log.warning("%s publishes no tokenizer or chat template digest (an older node): routed to unchecked",
                        where)

    def _recount(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        for member in self.view.members():
            reason = self.excluded_reason(member)
            if reason is not None:
                key = (member.record.model, reason)
                counts[key] = counts.get(key, 0) + 1
        for pool, reason in self._counted | set(counts):
            self._set_count(pool, reason, counts.get((pool, reason), 0))

    def _set_count(self, pool: str, reason: str, count: int) -> None:
        self._metrics.nodes_excluded.labels(POOL, self._metrics.node, pool, reason).set(count)
        self._counted.add((pool, reason))
