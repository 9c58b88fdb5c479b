"""What crosses between the cluster's processes: the control-plane protocol (`pdserve.proto` and its
generated modules), who may call it (`rpc.security`: a shared cluster token, optional TLS), and the trace
context that rides along (`rpc.tracing`). Torch-free: the frontend, the nodes and the operator tools
share it."""

from pdserve.rpc.security import (
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
