"""How `pdserve up` stops: the order (frontend, decode nodes, prefill nodes, each draining; then the
registry check; then etcd), the stop of one group of processes, and the registry check itself."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterable, Sequence

from rich.console import Console

from pdserve.deploy.launcher.process import Slot, send_signal
from pdserve.registry import cluster_prefix, parse_endpoint

STOP_ORDER = ("frontend", "decode", "prefill")  # etcd last, after the registry check


def stop_grace_s(pool: str, drain_timeout_s: float) -> float:
    """How long a pool's processes get to exit before they are killed."""
    return 15.0 if pool == "frontend" else drain_timeout_s + 10


def stop_group(group: Iterable[Slot], grace_s: float, force: threading.Event, console: Console) -> bool:
    """Signals the group's live processes (SIGTERM, or SIGKILL once `force` is set) and waits for each;
    past `grace_s` (or on `force`) the rest are killed. Returns whether there was anything to stop."""
    group = [s for s in group if s.alive]
    for slot in group:
        slot.restart_at = None
        slot.status = "stopping"
        send_signal(slot, signal.SIGKILL if force.is_set() else signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    killed = force.is_set()
    for slot in group:
        assert slot.proc is not None
        while slot.proc.poll() is None:
            if not killed and (force.is_set() or time.monotonic() > deadline):
                for other in group:
                    send_signal(other, signal.SIGKILL)
                killed = True
            time.sleep(0.05)
        console.print(f"  stopped {slot.name:<11} (exit {slot.proc.returncode})")
        slot.status = "stopped"
    return bool(group)


def registry_keys(endpoints: Sequence[str], cluster: str, delete: bool = False) -> list[str]:
    """The keys under the cluster's registry prefix (deleted first when `delete`: returns what was there)."""
    return asyncio.run(_registry_keys(endpoints, cluster, delete))


async def _registry_keys(endpoints: Sequence[str], cluster: str, delete: bool) -> list[str]:
    import aetcd

    host, port = parse_endpoint(endpoints[0])
    prefix = cluster_prefix(cluster).encode()
    client = aetcd.Client(host=host, port=port, timeout=5)
    try:
        found = [kv.key.decode() for kv in await client.get_prefix(prefix, keys_only=True)]
        if delete and found:
            await client.delete_prefix(prefix)
        return found
    finally:
        await client.close()


def empty_registry(endpoints: Sequence[str], cluster: str) -> list[str]:
    try:
        return registry_keys(endpoints, cluster, delete=True)
    except Exception as err:  # etcd is about to go anyway; say why the check could not run
        return [f"(registry check failed: {type(err).__name__}: {err})"]
