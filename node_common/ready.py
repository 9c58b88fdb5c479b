"""What a node process tells whoever started it, without importing the node runtime (or torch).

A node prints exactly one line to stdout once it serves and is registered:
``PDSERVE_READY {"node_id": ..., "role": ..., "grpc_address": ..., "kv_address": ...,
"metrics_address": ..., "pid": ..., "fingerprint": ...}``; launchers and the test harness read it to learn
the ports the node picked. A node refused by its pool exits with `EXIT_REFUSED`, one that cannot reach
etcd to join with `EXIT_UNAVAILABLE`, one whose engine stopped making progress with `EXIT_UNHEALTHY`.
"""

from __future__ import annotations

import json
from typing import Any

READY_PREFIX = "PDSERVE_READY "
EXIT_REFUSED = 3  # the registry refused this node (conflicting pool invariant or node id)
EXIT_UNAVAILABLE = 4  # etcd could not be reached to join
EXIT_UNHEALTHY = 5  # the engine stopped making progress (`node_common.health`): restart the process


def ready_line(info: dict[str, Any]) -> str:
    """The ready line for `info` (the keys listed above)."""
    return READY_PREFIX + json.dumps(info)


def parse_ready_line(line: str) -> dict[str, Any] | None:
    """The info of a ready line, or None for any other line."""
    line = line.strip()
    return json.loads(line[len(READY_PREFIX) :]) if line.startswith(READY_PREFIX) else None
