"""The prefill node process's one validated configuration."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.node_common.config import NodeConfig, add_node_args, node_kwargs


@dataclass(frozen=True)
class PrefillNodeConfig(NodeConfig):
    max_pending: int = 1024  # Prefill calls in flight at most; more are refused with RESOURCE_EXHAUSTED
    # Queue each send layer by layer in the step of the last prompt chunk, so the transfer overlaps the
    # prefill's compute; False: queue it after the first token (for comparison).
    layerwise_send: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_pending < 1:
            raise ValueError("PrefillNodeConfig: max_pending must be >= 1")

    @classmethod
    def from_argv(cls, argv: list[str] | None) -> tuple[PrefillNodeConfig, str]:
        """Parses the command line; returns the config and the log level."""
        parser = argparse.ArgumentParser(prog="python -m pdserve.prefill_node", description="Run a pdserve prefill node.")
        add_node_args(parser)
        parser.add_argument("--max-pending", type=int, default=1024)
        parser.add_argument("--no-layerwise-send", dest="layerwise_send", action="store_false",
                            help="queue each KV send after the first token instead of layer by layer during "
                                 "the prefill's last step (for comparison)")
        args = parser.parse_args(argv)
        config = cls(
            **node_kwargs(args), max_pending=args.max_pending,  # type: ignore[arg-type]
            layerwise_send=args.layerwise_send,
        )
        return config, args.log_level
