"""Who may open a KV channel: both ends of a connection to a node's KV port prove they hold the cluster
token (HMAC-SHA256 challenge-response; the token itself never crosses the wire) before one rendezvous
byte moves, so a process that merely reaches the port can neither join a pair group nor read the store.

With a token, a node's KV port is a `KVGate`. The node's TCPStore listens on loopback only; the gate
accepts a connection, runs the handshake on that connection's own thread under `handshake_timeout_s`
(a silent or slow peer holds only its own thread, never the accept loop), and only then relays the
connection's bytes to the store. The dialing side (`dial`) runs the same handshake and hands its
TCPStore client a one-shot loopback relay (`LoopbackRelay`) onto the authenticated socket. A peer that
fails is refused, its connection closed, counted by reason (`FailureReason`) and logged once per
address; the gate keeps serving everyone else.

Wire (sizes in bytes; ids are UTF-8, each sent as a 1-byte length and its bytes)::

    dialer -> gate   HELLO      b"PDKV" | version (1) | has_token (1) | nonce_d (32) | dialer_id | dialer_role | gate_id
    gate -> dialer   CHALLENGE  status (1) | nonce_g (32)                    (status != 0: refused, nothing follows)
    dialer -> gate   PROOF      mac("dialer", nonce_g, nonce_d, dialer_id, gate_id)
    gate -> dialer   ACCEPT     status (1) | mac("gate", nonce_d, nonce_g, gate_id, dialer_id)

where mac(side, a, b, x, y) = HMAC-SHA256(token, LABEL | side | a | b | x | y) with each part length-prefixed.
The side names keep one side's answer from being replayed as the other's; each side's fresh nonce keeps an
old answer from being replayed at all. The dialer proves itself first, so an unauthenticated peer never
gets a MAC of a nonce it chose. Only the rendezvous is gated: the gloo connections the rendezvous sets
up carry their own (unauthenticated) framing on ports only the store names.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable

from pdserve.kv_transfer.types import ChannelError, NodeAddress

log = logging.getLogger(__name__)

MAGIC = b"PDKV"
VERSION = 1
LABEL = b"pdserve-kv-auth/1"
NONCE_BYTES = 32
MAC_BYTES = 32
_MAX_LOGGED_PEERS = 1024  # distinct addresses a gate remembers having logged


class FailureReason(enum.StrEnum):
    """Why a gate refused a peer (the `reason` label of pdserve_kv_channel_auth_failures_total)."""

    NO_TOKEN = "no_token"  # the peer said it holds no cluster token
    BAD_RESPONSE = "bad_response"  # its proof is not the token's MAC of our nonce
    TIMEOUT = "timeout"  # it did not finish the handshake within handshake_timeout_s
    PROTOCOL = "protocol"  # not this protocol (garbage, a bare TCPStore client), or a wrong node id


class AuthRefused(ChannelError):
    """This node's handshake with a peer's KV port failed (refused by it, or it failed our check)."""


_STATUS_OK = 0
# status byte -> what the refused dialer is told
_STATUS_OF = {FailureReason.NO_TOKEN: 1, FailureReason.BAD_RESPONSE: 2, FailureReason.PROTOCOL: 3}
_REFUSAL_TEXT = {1: "this node has no cluster token", 2: "this node's cluster token is not the peer's",
                 3: "the peer is not the node this node meant to reach"}


def mac(token: str, side: bytes, first: bytes, second: bytes, own_id: str, peer_id: str) -> bytes:
    """The HMAC-SHA256 one side sends: it binds the token to both nonces, its side and both node ids."""
    h = hmac.new(token.encode(), digestmod=hashlib.sha256)
    for part in (LABEL, side, first, second, own_id.encode(), peer_id.encode()):
        h.update(len(part).to_bytes(2, "big"))
        h.update(part)
    return h.digest()


class _Protocol(Exception):
    """The peer sent something this protocol does not allow (or hung up halfway)."""


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Reads exactly n bytes before `deadline` (time.monotonic()); socket.timeout when it passes."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("handshake deadline passed")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise _Protocol(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _recv_str(sock: socket.socket, deadline: float) -> str:
    n = _recv_exact(sock, 1, deadline)[0]
    try:
        return _recv_exact(sock, n, deadline).decode() if n else ""
    except UnicodeDecodeError as e:
        raise _Protocol("an id that is not UTF-8") from e


def _pack_str(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > 255:
        raise ValueError(f"node id {text!r} is longer than 255 bytes")
    return bytes([len(raw)]) + raw


# ----------------------------------------------------------------------------------------- dialer side
def dial(address: NodeAddress, token: str, node_id: str, role: str, peer_id: str, timeout_s: float) -> socket.socket:
    """Connects to `peer_id`'s KV port at `address` and authenticates both ways; returns the socket, ready
    to carry the rendezvous. Raises AuthRefused (refused, or the peer failed our check) or ChannelError
    (unreachable, or the handshake did not finish within `timeout_s`). `token` "" presents no token (the
    gate then refuses with no_token)."""
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
    except OSError as e:
        raise ChannelError(f"cannot reach the KV port of {peer_id} at {address}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce_d = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(MAGIC + bytes([VERSION, 1 if token else 0]) + nonce_d
                     + _pack_str(node_id) + _pack_str(role) + _pack_str(peer_id))
        status = _recv_exact(sock, 1, deadline)[0]
        if status != _STATUS_OK:
            raise AuthRefused(f"the KV port of {peer_id} at {address} refused this node: "
                              f"{_REFUSAL_TEXT.get(status, f'status {status}')}")
        nonce_g = _recv_exact(sock, NONCE_BYTES, deadline)
        sock.sendall(mac(token, b"dialer", nonce_g, nonce_d, node_id, peer_id))
        status = _recv_exact(sock, 1, deadline)[0]
        if status != _STATUS_OK:
            raise AuthRefused(f"the KV port of {peer_id} at {address} refused this node: "
                              f"{_REFUSAL_TEXT.get(status, f'status {status}')}")
        answer = _recv_exact(sock, MAC_BYTES, deadline)
        if not hmac.compare_digest(answer, mac(token, b"gate", nonce_d, nonce_g, peer_id, node_id)):
            raise AuthRefused(f"the KV port at {address} does not hold the cluster token (not {peer_id}'s?)")
        sock.settimeout(None)
        return sock
    except AuthRefused:
        sock.close()
        raise
    except (OSError, _Protocol) as e:  # TimeoutError is an OSError
        sock.close()
        raise ChannelError(f"KV handshake with {peer_id} at {address} failed: {e}") from e


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copies src to dst until either end closes, then shuts both down (which ends the other pump)."""
    try:
        while chunk := src.recv(1 << 16):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _splice(a: socket.socket, b: socket.socket, name: str, on_done: Callable[[], None] | None = None) -> None:
    """Relays a <-> b: one thread each way; both sockets closed (then `on_done`) once both directions ended."""
    def run(src: socket.socket, dst: socket.socket, closer: threading.Thread | None) -> None:
        _pump(src, dst)
        if closer is not None:
            closer.join()
            a.close()
            b.close()
            if on_done is not None:
                on_done()

    back = threading.Thread(target=run, args=(b, a, None), name=f"{name}-back", daemon=True)
    back.start()
    threading.Thread(target=run, args=(a, b, back), name=f"{name}-fwd", daemon=True).start()


class LoopbackRelay:
    """A one-shot loopback listener whose first connection is relayed onto an authenticated socket: how a
    TCPStore client (which dials by itself) rides a connection this process authenticated."""

    def __init__(self, upstream: socket.socket, name: str, accept_timeout_s: float) -> None:
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(accept_timeout_s)
        self.address = NodeAddress("127.0.0.1", self._listener.getsockname()[1])
        self._name = name
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:  # timed out or closed: nobody came
            self._upstream.close()
            return
        finally:
            self._listener.close()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _splice(conn, self._upstream, self._name)

    def close(self) -> None:
        """Ends the relay (the TCPStore client's connection with it). Idempotent."""
        self._listener.close()
        try:
            self._upstream.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


# ------------------------------------------------------------------------------------------- gate side
class KVGate:
    """A node's KV port when it has a cluster token: authenticates each connection, then relays it to the
    node's loopback-only TCPStore at `upstream`. `on_failure(reason, peer address)` is called once per
    refused connection (from that connection's thread)."""

    def __init__(self, listener: socket.socket, upstream: NodeAddress, token: str, node_id: str,
                 handshake_timeout_s: float, on_failure: Callable[[FailureReason, str], None] | None = None) -> None:
        assert token, "a gate without a token would authenticate nobody"
        assert handshake_timeout_s > 0
        self._listener = listener
        self._listener.settimeout(0.2)  # how soon the accept loop sees close()
        self._upstream = upstream
        self._token = token
        self._node_id = node_id
        self._timeout_s = handshake_timeout_s
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._logged: set[str] = set()  # peer hosts already logged
        self._open: set[socket.socket] = set()  # accepted connections still open
        self._stop = threading.Event()
        self.failures: dict[FailureReason, int] = dict.fromkeys(FailureReason, 0)
        self.accepted = 0  # connections that passed the handshake
        self._thread = threading.Thread(target=self._accept_loop, name=f"kv-gate-{node_id}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with self._lock:
                self._open.add(conn)
            threading.Thread(target=self._serve, args=(conn, addr), name=f"kv-gate-{self._node_id}-peer",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, addr: tuple[str, int] | tuple[str, int, int, int]) -> None:
        peer = str(NodeAddress(addr[0], addr[1]))
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reason = self._handshake(conn, time.monotonic() + self._timeout_s)
            if reason is None:
                upstream = socket.create_connection((self._upstream.host, self._upstream.port), timeout=5.0)
                upstream.settimeout(None)
                upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(None)
                with self._lock:
                    self.accepted += 1
                _splice(conn, upstream, f"kv-gate-{self._node_id}-relay", lambda: self._forget(conn))
                return
        except OSError as e:
            log.warning("KV port of %s: relaying %s to its store failed: %s", self._node_id, peer, e)
            reason = None
        self._forget(conn)
        conn.close()
        if reason is not None:
            self._refused(reason, peer)

    def _handshake(self, conn: socket.socket, deadline: float) -> FailureReason | None:
        """Runs the gate's half of the handshake; None when the peer proved it holds the token."""
        try:
            head = _recv_exact(conn, len(MAGIC) + 2, deadline)
            if head[:len(MAGIC)] != MAGIC or head[len(MAGIC)] != VERSION:
                return FailureReason.PROTOCOL
            has_token = head[len(MAGIC) + 1]
            nonce_d = _recv_exact(conn, NONCE_BYTES, deadline)
            dialer_id = _recv_str(conn, deadline)
            _recv_str(conn, deadline)  # the dialer's role: for the log line only
            gate_id = _recv_str(conn, deadline)
            reason = None
            if not has_token:
                reason = FailureReason.NO_TOKEN
            elif gate_id != self._node_id:
                reason = FailureReason.PROTOCOL
            if reason is not None:
                conn.sendall(bytes([_STATUS_OF[reason]]))
                return reason
            nonce_g = secrets.token_bytes(NONCE_BYTES)
            conn.sendall(bytes([_STATUS_OK]) + nonce_g)
            proof = _recv_exact(conn, MAC_BYTES, deadline)
            if not hmac.compare_digest(proof, mac(self._token, b"dialer", nonce_g, nonce_d, dialer_id, gate_id)):
                conn.sendall(bytes([_STATUS_OF[FailureReason.BAD_RESPONSE]]))
                return FailureReason.BAD_RESPONSE
            conn.sendall(bytes([_STATUS_OK]) + mac(self._token, b"gate", nonce_d, nonce_g, gate_id, dialer_id))
            return None
        except TimeoutError:
            return FailureReason.TIMEOUT
        except (_Protocol, OSError):
            return FailureReason.PROTOCOL

    def _refused(self, reason: FailureReason, peer: str) -> None:
        host = peer.rpartition(":")[0]
        with self._lock:
            self.failures[reason] += 1
            first = host not in self._logged and len(self._logged) < _MAX_LOGGED_PEERS
            if first:
                self._logged.add(host)
        if first:  # once per address: a peer retrying in a loop must not flood the log
            log.warning("KV port of %s refused a connection from %s (%s): KV channels need the cluster token; "
                        "later refusals of that address are only counted", self._node_id, peer, reason.value)
        if self._on_failure is not None:
            self._on_failure(reason, peer)

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._open.discard(conn)

    def close(self) -> None:
        """Stops accepting and cuts every connection it accepted. Idempotent."""
        self._stop.set()
        self._listener.close()
        self._thread.join(timeout=2.0)
        with self._lock:
            conns, self._open = list(self._open), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
