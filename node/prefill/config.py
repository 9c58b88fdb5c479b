"""The prefill node process's one validated configuration."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from node.config import NodeConfig, add_node_args, node_kwargs


@dataclass(frozen=True)
class PrefillNodeConfig(NodeConfig):
    max_pending: int = 1024  # Prefill calls in flight at most; more are refused with RESOURCE_EXHAUSTED

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_pending < 1:
            raise ValueError("PrefillNodeConfig: max_pending must be >= 1")

    @classmethod
    def from_argv(cls, argv: list[str] | None) -> tuple[PrefillNodeConfig, str]:
        """Parses the command line; returns the config and the log level."""
        parser = argparse.ArgumentParser(prog="python -m node.prefill", description="Run a pdserve prefill node.")
        add_node_args(parser)
        parser.add_argument("--max-pending", type=int, default=1024)
        args = parser.parse_args(argv)
        return cls(**node_kwargs(args), max_pending=args.max_pending), args.log_level  # type: ignore[arg-type]
