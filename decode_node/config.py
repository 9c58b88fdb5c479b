"""The decode node process's one validated configuration."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.node_common.config import NodeConfig, add_node_args, node_kwargs


@dataclass(frozen=True)
class DecodeNodeConfig(NodeConfig):
    # Requests whose prompt part not in this node's prefix cache is shorter than this many tokens are
    # prefilled here: shipping their KV would cost more than computing it.
    local_prefill_threshold: int = 64
    # Conditional disaggregation: when this node's requests queued at the chosen prefill node (routed
    # there, no first token yet) already hold this many context tokens, and this node has less than that
    # left to prefill itself, a new request is prefilled here instead, so the two queues drain side by side
    # (0: every request above the threshold goes to a prefill node). Trades the decode batch's steadiness
    # (prefill chunks join its steps) for time to first token and throughput when prefill nodes are the
    # bottleneck, e.g. nodes sharing one machine's cores.
    max_prefill_queue_tokens: int = 0
    reservation_queue_limit: int = 256  # requests waiting for a reservation; beyond: RESOURCE_EXHAUSTED
    reservation_timeout_s: float = 60.0  # a request that waits longer for blocks is refused
    max_local_waiting: int = 256  # locally prefilled requests queued in the engine; beyond: refused
    # A remote prefill with no first token after this many seconds is cancelled and done here instead
    # (0: no bound; a hung prefill node is then noticed when its registry lease lapses).
    prefill_timeout_s: float = 0.0
    # A drain lets running requests finish for this long, then hands the rest over: each stream ends with
    # finish reason HAND_OVER (the caller continues it on another node) and its blocks are freed.
    drain_grace_s: float = 5.0
    # A colocated node prefills every prompt itself and never uses a prefill node; its registry record
    # says so, and a pool of such nodes is ready without prefill nodes.
    colocated: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = [
            (self.local_prefill_threshold >= 0, "local_prefill_threshold must be >= 0"),
            (self.max_prefill_queue_tokens >= 0, "max_prefill_queue_tokens must be >= 0"),
            (self.reservation_queue_limit >= 0, "reservation_queue_limit must be >= 0"),
            (self.reservation_timeout_s > 0, "reservation_timeout_s must be > 0"),
            (self.max_local_waiting >= 1, "max_local_waiting must be >= 1"),
            (self.prefill_timeout_s >= 0, "prefill_timeout_s must be >= 0"),
            (self.drain_grace_s >= 0, "drain_grace_s must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"DecodeNodeConfig: {msg}")

    @property
    def prefills_every_prompt(self) -> bool:
        return self.colocated

    @classmethod
    def from_argv(cls, argv: list[str] | None) -> tuple[DecodeNodeConfig, str]:
        """Parses the command line; returns the config and the log level."""
        parser = argparse.ArgumentParser(prog="python -m pdserve.decode_node", description="Run a pdserve decode node.")
        add_node_args(parser)
        parser.add_argument("--local-prefill-threshold", type=int, default=64)
        parser.add_argument("--max-prefill-queue-tokens", type=int, default=0,
                            help="prefill here when this node's requests waiting at the prefill node hold this many "
                                 "context tokens and this node's own prefill backlog is smaller (0: never)")
        # The --admission-* spellings are the flags' earlier names, kept for existing deployments.
        parser.add_argument("--reservation-queue-limit", "--admission-queue-limit", type=int, default=256)
        parser.add_argument("--reservation-timeout", "--admission-timeout", type=float, default=60.0)
        parser.add_argument("--max-local-waiting", type=int, default=256)
        parser.add_argument("--prefill-timeout", type=float, default=0.0,
                            help="seconds to wait for a remote prefill's first token before prefilling here (0: no bound)")
        parser.add_argument("--drain-grace", type=float, default=5.0,
                            help="seconds a drain lets running requests finish before handing them over to other "
                                 "decode nodes (via the frontend)")
        parser.add_argument("--colocated", action="store_true",
                            help="prefill every prompt here (no prefill nodes): a colocated node")
        args = parser.parse_args(argv)
        config = cls(
            **node_kwargs(args),  # type: ignore[arg-type]
            local_prefill_threshold=args.local_prefill_threshold,
            max_prefill_queue_tokens=args.max_prefill_queue_tokens,
            reservation_queue_limit=args.reservation_queue_limit,
            reservation_timeout_s=args.reservation_timeout,
            max_local_waiting=args.max_local_waiting,
            prefill_timeout_s=args.prefill_timeout,
            drain_grace_s=args.drain_grace,
            colocated=args.colocated,
        )
        return config, args.log_level
