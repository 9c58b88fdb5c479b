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
    # Test fault injection, all off by default; only the fault tests turn them on (never in service).
    fault_send_delay_s: float = 0.0  # wait this long after the first token went out before queuing the send
    fault_send_stall_s: float = 0.0  # announce the send and ship half its layers; the rest this much later
    fault_send_failed: bool = False  # report every send that completed as failed (TransferDone ok=False)
    fault_corrupt_kv: bool = False  # flip one staged byte of every send after its checksum was computed

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_pending < 1:
            raise ValueError("PrefillNodeConfig: max_pending must be >= 1")
        if self.fault_send_delay_s < 0 or self.fault_send_stall_s < 0:
            raise ValueError("PrefillNodeConfig: fault delays must be >= 0")

    @classmethod
    def from_argv(cls, argv: list[str] | None) -> tuple[PrefillNodeConfig, str]:
        """Parses the command line; returns the config and the log level."""
        parser = argparse.ArgumentParser(prog="python -m prefill_node", description="Run a pdserve prefill node.")
        add_node_args(parser)
        parser.add_argument("--max-pending", type=int, default=1024)
        parser.add_argument("--no-layerwise-send", dest="layerwise_send", action="store_false",
                            help="queue each KV send after the first token instead of layer by layer during "
                                 "the prefill's last step (for comparison)")
        faults = parser.add_argument_group("test fault injection (off by default; for tests only)")
        faults.add_argument("--fault-send-delay", type=float, default=0.0, metavar="S",
                            help="wait S seconds after the first token before queuing the KV send")
        faults.add_argument("--fault-send-stall", type=float, default=0.0, metavar="S",
                            help="announce the send and ship half its layers, the rest S seconds later (after "
                                 "the first token, or after the prefill's last step for a layer-wise send)")
        faults.add_argument("--fault-send-failed", action="store_true",
                            help="report every completed send as failed (TransferDone ok=false)")
        faults.add_argument("--fault-corrupt-kv", action="store_true",
                            help="flip one staged byte of every send after its checksum was computed")
        args = parser.parse_args(argv)
        config = cls(
            **node_kwargs(args), max_pending=args.max_pending,  # type: ignore[arg-type]
            layerwise_send=args.layerwise_send,
            fault_send_delay_s=args.fault_send_delay, fault_send_stall_s=args.fault_send_stall,
            fault_send_failed=args.fault_send_failed, fault_corrupt_kv=args.fault_corrupt_kv,
        )
        return config, args.log_level
