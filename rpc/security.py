"""Node-to-node gRPC security: every internal call (frontend -> decode node, decode node -> prefill node,
operator tools -> NodeControl) carries the cluster's shared token, and servers refuse a call without it
(UNAUTHENTICATED) before any handler runs. TLS, when configured, encrypts the same channels.

Where the token comes from: `$PDSERVE_CLUSTER_TOKEN`, or `--cluster-token-file` (a mounted Kubernetes
Secret); never a command-line value, which `ps` would show. `pdserve up` makes a fresh one per cluster.
A server bound beyond loopback refuses to start without a token unless `--allow-unauthenticated` says
that is intended (a network the operator trusts).

The grpc.health.v1 service stays open: probes (kubelet, `grpc_health_probe`) carry no token, and health
says nothing a peer could misuse. The KV channels use the same token (`kv_transfer.auth`: an HMAC
challenge-response on the KV port before any rendezvous), and the same rule: a node whose `--kv-host` is
beyond loopback refuses to start without a token unless `--allow-unauthenticated`.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
TOKEN_METADATA_KEY = "x-pdserve-cluster-token"
# Open to any caller: health carries no token (probes) and reveals nothing.
_OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
_MIN_TOKEN_LEN = 16


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name a server binds) is reachable from this machine only."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class RpcSecurity:
    """One process's gRPC security settings (what its servers demand and its channels present)."""

    token: str = ""  # the shared cluster token; "" = calls are not authenticated
    tls_cert: str = ""  # PEM certificate chain this process's server presents ("" = no TLS)
    tls_key: str = ""  # its private key
    tls_ca: str = ""  # PEM CA bundle channels verify servers with ("" = no TLS on channels)
    allow_unauthenticated: bool = False  # serve beyond loopback without a token (a trusted network)

    def __post_init__(self) -> None:
        if self.token and (len(self.token) < _MIN_TOKEN_LEN or any(c.isspace() for c in self.token)):
            raise ValueError(f"the cluster token must be at least {_MIN_TOKEN_LEN} characters without spaces")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
        for path in (self.tls_cert, self.tls_key, self.tls_ca):
            if path and not Path(path).is_file():
                raise ValueError(f"TLS file {path!r} does not exist")

    def check_bind(self, host: str, what: str = "gRPC") -> None:
        """Raises ValueError when a server (`what`: gRPC, KV) bound to `host` would take unauthenticated
        calls from other machines without the operator having said so."""
        if not self.token and not self.allow_unauthenticated and not is_loopback(host):
            raise ValueError(
                f"{what} binds {host}, beyond loopback, without a cluster token: set ${TOKEN_ENV} or "
                "--cluster-token-file (or pass --allow-unauthenticated on a network you trust)")

    # -- servers ------------------------------------------------------------------------------------

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [_TokenCheck(self.token)] if self.token else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Binds `address` (TLS when a certificate is configured); returns the port (0: failed)."""
        if self.tls_cert:
            creds = grpc.ssl_server_credentials([(Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())])
            return server.add_secure_port(address, creds)
        return server.add_insecure_port(address)

    # -- channels -----------------------------------------------------------------------------------

    def aio_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to `address` whose calls carry the token (over TLS when a CA is set)."""
        # One interceptor object per call kind: grpc.aio files each interceptor under one kind only.
        interceptors = [_UnaryTokenAttach(self.token), _StreamTokenAttach(self.token)] if self.token else None
        if self.tls_ca:
            creds = grpc.ssl_channel_credentials(Path(self.tls_ca).read_bytes())
            return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel to `address` (operator tools, tests), same rules as `aio_channel`."""
        if self.tls_ca:
            channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(self.tls_ca).read_bytes()),
                                          options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        return grpc.intercept_channel(channel, _SyncTokenAttach(self.token)) if self.token else channel

    @classmethod
    def from_env(cls, token_file: str = "", **kwargs: Any) -> RpcSecurity:
        """Settings with the token read from `token_file` when given, else from $PDSERVE_CLUSTER_TOKEN."""
        token = Path(token_file).read_text().strip() if token_file else os.environ.get(TOKEN_ENV, "").strip()
        return cls(token=token, **kwargs)


def add_rpc_args(parser: argparse.ArgumentParser, *, server: bool = True) -> None:
    """The command-line options of `RpcSecurity` (the token itself comes from a file or the env); a
    process without a gRPC server (the frontend) takes only the channel side."""
    parser.add_argument("--cluster-token-file", default="",
                        help=f"file holding the shared cluster token (default: ${TOKEN_ENV})")
    parser.add_argument("--grpc-tls-ca", default="", help="PEM CA bundle to verify other processes' gRPC servers")
    if server:
        parser.add_argument("--allow-unauthenticated", action="store_true",
                            help="serve gRPC and KV channels beyond loopback without a cluster token "
                                 "(a network you trust)")
        parser.add_argument("--grpc-tls-cert", default="", help="PEM certificate this process's gRPC server presents")
        parser.add_argument("--grpc-tls-key", default="", help="its PEM private key")


def rpc_security_from_args(args: argparse.Namespace) -> RpcSecurity:
    """`RpcSecurity` from parsed `add_rpc_args` options (raises ValueError)."""
    return RpcSecurity.from_env(
        args.cluster_token_file, tls_ca=args.grpc_tls_ca, tls_cert=getattr(args, "grpc_tls_cert", ""),
        tls_key=getattr(args, "grpc_tls_key", ""), allow_unauthenticated=getattr(args, "allow_unauthenticated", False),
    )


def _metadata_with_token(metadata: Any, token: str) -> list[tuple[str, str]]:
    return [*(metadata or ()), (TOKEN_METADATA_KEY, token)]


def _aio_details(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(details.method, details.timeout, _metadata_with_token(details.metadata, token),
                                      details.credentials, details.wait_for_ready)


class _UnaryTokenAttach(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the token to every unary call of an asyncio channel."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_aio_details(client_call_details, self._token), request)


class _StreamTokenAttach(grpc.aio.UnaryStreamClientInterceptor):
    """Adds the token to every server-streaming call of an asyncio channel."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_aio_details(client_call_details, self._token), request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class _SyncTokenAttach(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the token to every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(_CallDetails(client_call_details, _metadata_with_token(client_call_details.metadata,
                                                                                   self._token)), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(_CallDetails(client_call_details, _metadata_with_token(client_call_details.metadata,
                                                                                   self._token)), request)


class _TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call but health's that lacks the cluster token; the handler of
    a refused call never runs."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation: Any, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler_call_details.method in _OPEN_METHODS:
            return handler
        presented = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                presented = value if isinstance(value, str) else value.decode(errors="replace")
        if hmac.compare_digest(presented.encode(), self._token):
            return handler
        return _refusal(handler, "missing cluster token" if not presented else "wrong cluster token")


def _refusal(handler: grpc.RpcMethodHandler | None, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only refuses (an unknown method is refused too, so
    an unauthenticated caller learns nothing of which methods exist)."""
    message = f"{why}: internal pdserve calls need the cluster's token"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as stream handlers are

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(unary)
    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    if handler.stream_unary is not None or handler.stream_stream is not None:
        raise NotImplementedError("no client-streaming RPCs in pdserve.proto")
    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
