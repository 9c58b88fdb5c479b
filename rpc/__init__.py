"""How cluster processes call each other over gRPC: authentication by a shared cluster token, optional
TLS (`rpc.security`). Torch-free: the frontend, the nodes and the operator tools share it."""

from rpc.security import (
    TOKEN_ENV,
    TOKEN_METADATA_KEY,
    RpcSecurity,
    add_rpc_args,
    is_loopback,
    rpc_security_from_args,
)

__all__ = [
    "TOKEN_ENV",
    "TOKEN_METADATA_KEY",
    "RpcSecurity",
    "add_rpc_args",
    "is_loopback",
    "rpc_security_from_args",
]
