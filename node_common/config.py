"""The configuration every node process shares (`NodeConfig`) and its command line; each node kind's
config (`prefill_node.config`, `decode_node.config`) extends it. One validated, frozen config per process.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.engine.config import KV_CACHE_DTYPES, EngineConfig
from pdserve.engine.speculative import SPECULATIVE_METHODS
from pdserve.node_common.pinning import parse_cpus
from pdserve.rpc import RpcSecurity, add_rpc_args, rpc_security_from_args
from pdserve.rpc.tracing import TracingConfig, add_tracing_args, tracing_config_from_args


@dataclass(frozen=True)
class NodeConfig:
    """Fields every node process has; `PrefillNodeConfig` / `DecodeNodeConfig` add their own."""

    node_id: str
    cluster: str
    etcd_endpoints: tuple[str, ...]
    engine: EngineConfig
    model_name: str = ""  # the KV cache's model name; "" = the model directory's name
    grpc_host: str = "127.0.0.1"  # address the gRPC server binds
    grpc_port: int = 0  # 0 picks a free port (reported in the ready line and the registry)
    advertise_host: str = ""  # host others use to reach this node's gRPC server; "" = grpc_host
    kv_host: str = "127.0.0.1"  # KV channel rendezvous (TCPStore) host, also where gloo binds
    kv_port: int = 0
    kv_interface: str | None = None  # bind gloo to this NIC instead of kv_host's
    lease_ttl_s: int = 5  # registry lease: a dead node leaves every view within this
    load_interval_s: float = 1.0
    join_timeout_s: float = 30.0  # how long to wait for etcd at start-up
    transfer_timeout_s: float = 30.0  # how long a KV pair channel may stand still (queued or on the wire)
    # A peer of the KV port must prove it holds the cluster token within this (`kv_transfer.auth`).
    kv_handshake_timeout_s: float = 5.0
    metrics_host: str = "127.0.0.1"  # where /metrics is served
    metrics_port: int = 0  # 0 picks a free port (reported in the ready line)
    drain_timeout_s: float = 30.0  # how long a drain waits for the work in flight before giving up
    # Health from progress (`node_common.health`): this many engine steps failing in a row, or one step running
    # this long, and the node leaves the registry, hands its requests over and exits (EXIT_UNHEALTHY).
    max_step_failures: int = 3
    step_stall_timeout_s: float = 120.0
    # The cluster token and TLS of the gRPC server and of channels to peers ($PDSERVE_CLUSTER_TOKEN by default).
    rpc: RpcSecurity = field(default_factory=RpcSecurity.from_env)
    tracing: TracingConfig = field(default_factory=TracingConfig)  # OTLP endpoint ("" = tracing off)
    # Pin the process to these CPUs at start (`node_common.pinning`); () = the CPUs it was started with.
    cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (bool(self.node_id) and "/" not in self.node_id, f"bad node_id {self.node_id!r}"),
            (bool(self.cluster) and "/" not in self.cluster, f"bad cluster {self.cluster!r}"),
            (bool(self.etcd_endpoints), "at least one etcd endpoint is required"),
            (all(0 <= p < 65536 for p in (self.grpc_port, self.kv_port, self.metrics_port)),
             "ports must be in [0, 65535]"),
            (self.lease_ttl_s >= 1, "lease_ttl_s must be >= 1"),
            (self.load_interval_s > 0, "load_interval_s must be > 0"),
            (self.join_timeout_s > 0, "join_timeout_s must be > 0"),
            (self.transfer_timeout_s > 0, "transfer_timeout_s must be > 0"),
            (self.kv_handshake_timeout_s > 0, "kv_handshake_timeout_s must be > 0"),
            (self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0"),
            (self.max_step_failures >= 1, "max_step_failures must be >= 1"),
            (self.step_stall_timeout_s > 0, "step_stall_timeout_s must be > 0"),
            (all(c >= 0 for c in self.cpus), "cpus must be CPU numbers >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"{type(self).__name__}: {msg}")
        self.rpc.check_bind(self.grpc_host)
        self.rpc.check_bind(self.kv_host, "the KV port")
        if not self.model_name:
            object.__setattr__(self, "model_name", Path(self.engine.model).name)

    @property
    def prefills_every_prompt(self) -> bool:
        """Whether this node prefills every prompt itself (a colocated decode node): its registry record
        says so, so that its KV cache counts as ready without prefill nodes."""
        return False

    @property
    def grpc_public_host(self) -> str:
        return self.advertise_host or self.grpc_host


def add_node_args(parser: argparse.ArgumentParser) -> None:
    """The command-line options of `NodeConfig` (and of its EngineConfig)."""
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--cluster", default="default")
    parser.add_argument("--etcd", required=True, help="comma-separated etcd endpoints host:port")
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--model-name", default="", help="pool model name (default: the directory name)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory-mib", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--prefix-hash-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads (default: the number of --cpus, else torch's default)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="split the model over N rank processes (float weights; KV transfer reshards heads "
                             "between nodes of different widths); default 1")
    parser.add_argument("--cpus", default="", metavar="LIST",
                        help="pin the node to these CPUs, e.g. 0 or 0,2-3 (default: not pinned)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="KV cache element type: auto (the model dtype) or fp8_e5m2 (half the bytes of bf16); "
                             "prefill and decode nodes of a cluster must agree")
    parser.add_argument("--speculative", default="off", choices=SPECULATIVE_METHODS,
                        help="speculative decoding without a draft model: ngram (prompt lookup) or suffix (a suffix "
                             "automaton over the request's tokens) drafts, verified in the batched decode step; "
                             "greedy and seeded output unchanged (default off; a models-file entry may override)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                        help="draft tokens a step at most (1-16; adapted per request below it)")
    parser.add_argument("--speculative-min-match", type=int, default=2, metavar="N",
                        help="shortest repeat, in tokens, a draft is taken from (ngram and suffix; default 2)")
    parser.add_argument("--kv-tier-dir", default=None, metavar="DIR",
                        help="a disk tier under the KV pool: committed blocks kept in DIR (per model), read back "
                             "when the pool has evicted a prefix, and found again after a restart (default: none)")
    parser.add_argument("--kv-tier-gib", type=float, default=8.0, metavar="GIB",
                        help="the most the KV tier keeps on disk; it evicts its least recently used blocks (default 8)")
    parser.add_argument("--grpc-host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, default=0)
    parser.add_argument("--advertise-host", default="")
    parser.add_argument("--kv-host", default="127.0.0.1")
    parser.add_argument("--kv-port", type=int, default=0)
    parser.add_argument("--kv-interface", default=None)
    parser.add_argument("--kv-handshake-timeout", type=float, default=5.0,
                        help="seconds a peer of the KV port has to prove it holds the cluster token")
    parser.add_argument("--lease-ttl", type=int, default=5)
    parser.add_argument("--load-interval", type=float, default=1.0)
    parser.add_argument("--join-timeout", type=float, default=30.0)
    parser.add_argument("--transfer-timeout", type=float, default=30.0,
                        help="seconds a KV transfer may wait with its pair channel standing still; every layer, "
                             "message or transfer that moves restarts it, so a slow prefill step is no timeout")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address /metrics is served on")
    parser.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: a free one)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds a drain (SIGTERM, pdserve drain) waits for requests in flight")
    parser.add_argument("--max-step-failures", type=int, default=3,
                        help="engine steps failing in a row before the node leaves and exits to be restarted")
    parser.add_argument("--step-stall-timeout", type=float, default=120.0,
                        help="seconds one engine step may run before the node counts as hung, leaves and exits")
    parser.add_argument("--log-level", default="INFO")
    add_rpc_args(parser)
    add_tracing_args(parser)


def node_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """`NodeConfig` keyword arguments from parsed `add_node_args` options."""
    cpus = parse_cpus(args.cpus) if args.cpus else ()
    num_threads = args.num_threads if args.num_threads is not None else (len(cpus) or None)
    engine = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, kernel_backend=args.kernel_backend,
        block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_mib << 20,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, prefix_hash_seed=args.prefix_hash_seed,
        seed=args.seed, num_threads=num_threads, kv_cache_dtype=args.kv_cache_dtype,
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        speculative_min_match=args.speculative_min_match, kv_tier_dir=args.kv_tier_dir,
        kv_tier_bytes=max(1, int(args.kv_tier_gib * 2**30)), tensor_parallel_size=args.tensor_parallel_size,
    )
    return dict(
        node_id=args.node_id, cluster=args.cluster,
        etcd_endpoints=tuple(e.strip() for e in args.etcd.split(",") if e.strip()), engine=engine,
        model_name=args.model_name, grpc_host=args.grpc_host, grpc_port=args.grpc_port,
        advertise_host=args.advertise_host, kv_host=args.kv_host, kv_port=args.kv_port,
        kv_interface=args.kv_interface, lease_ttl_s=args.lease_ttl, load_interval_s=args.load_interval,
        join_timeout_s=args.join_timeout, transfer_timeout_s=args.transfer_timeout,
        kv_handshake_timeout_s=args.kv_handshake_timeout,
        metrics_host=args.metrics_host, metrics_port=args.metrics_port, drain_timeout_s=args.drain_timeout,
        max_step_failures=args.max_step_failures, step_stall_timeout_s=args.step_stall_timeout,
        rpc=rpc_security_from_args(args), tracing=tracing_config_from_args(args), cpus=cpus,
    )


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
