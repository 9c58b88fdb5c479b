"""A stranger at a node's KV port, as its own process: `python -m testing.kv_probe HOST:PORT NODE_ID MODE`
prints one JSON line saying what the port did.

Modes: `no_token` (the handshake, presenting no token), `wrong_token` (a token that is not the cluster's,
from $KV_PROBE_TOKEN), `garbage` (random bytes), `tcpstore` (a bare TCPStore client, as a node without a
token would connect), `silent` (connects and says nothing; meanwhile a handshake with the right token,
from $PDSERVE_CLUSTER_TOKEN, must still go through), `open N` (N handshakes with the right token: their
cost in milliseconds).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import time

from pdserve.kv_transfer.auth import AuthRefused, dial
from pdserve.kv_transfer.types import ChannelError, NodeAddress

TIMEOUT_S = 10.0


def _closed(sock: socket.socket, timeout_s: float = TIMEOUT_S) -> tuple[bool, int]:
    """Whether the peer closed the connection (EOF or reset) within `timeout_s`, and the bytes it sent first."""
    sock.settimeout(timeout_s)
    got = 0
    try:
        while chunk := sock.recv(4096):
            got += len(chunk)
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False, got
    return True, got


def _handshake(address: NodeAddress, token: str, node_id: str) -> dict[str, object]:
    try:
        sock = dial(address, token, "kv-probe", "decode", node_id, TIMEOUT_S)
    except AuthRefused as e:
        return {"refused": True, "error": str(e)}
    except ChannelError as e:
        return {"refused": False, "error": str(e)}
    sock.close()
    return {"refused": False, "error": ""}


def main(argv: list[str]) -> dict[str, object]:
    address, node_id, mode = NodeAddress.parse(argv[0]), argv[1], argv[2]
    if mode == "no_token":
        return _handshake(address, "", node_id)
    if mode == "wrong_token":
        return _handshake(address, os.environ["KV_PROBE_TOKEN"], node_id)
    if mode == "garbage":
        sock = socket.create_connection((address.host, address.port), timeout=TIMEOUT_S)
        sock.sendall(os.urandom(512))
        closed, got = _closed(sock)
        return {"closed": closed, "received_bytes": got}
    if mode == "tcpstore":
        from torch._C._distributed_c10d import TCPStore

        try:
            store = TCPStore(address.host, address.port, is_master=False, timeout=datetime.timedelta(seconds=5))
            store.get("pair/anything")
        except RuntimeError as e:
            return {"refused": True, "error": str(e)[:300]}
        return {"refused": False, "error": ""}
    if mode == "silent":
        sock = socket.create_connection((address.host, address.port), timeout=TIMEOUT_S)
        start = time.monotonic()
        good = _handshake(address, os.environ["PDSERVE_CLUSTER_TOKEN"], node_id)
        good_s = time.monotonic() - start
        closed, got = _closed(sock)
        return {"closed": closed, "received_bytes": got, "closed_after_s": time.monotonic() - start,
                "good_while_silent": good, "good_while_silent_s": good_s}
    if mode == "open":
        token, ms = os.environ["PDSERVE_CLUSTER_TOKEN"], []
        for _ in range(int(argv[3])):
            start = time.perf_counter()
            dial(address, token, "kv-probe", "decode", node_id, TIMEOUT_S).close()
            ms.append((time.perf_counter() - start) * 1000)
        return {"median_ms": statistics.median(ms), "max_ms": max(ms), "n": len(ms)}
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
