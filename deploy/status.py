"""`pdserve status [--json]`: the registry's view of a cluster, one row per node.

With no arguments it reads `runs/<cluster>/cluster.json`, which `pdserve up` keeps while it runs, to find
etcd (and the /metrics addresses, which the registry does not hold); `--etcd` points it at any cluster.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pdserve.deploy.launcher import ClusterState, default_runs_dir
from pdserve.registry import Member, RegistryView


@dataclass(frozen=True)
class StatusConfig:
    """What `pdserve status` was asked for; validated once."""

    cluster: str = "default"
    etcd_endpoints: tuple[str, ...] = ()  # empty: find the local `pdserve up` cluster
    runs_dir: Path = Path("runs")
    as_json: bool = False
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.cluster or "/" in self.cluster:
            raise ValueError(f"bad --cluster {self.cluster!r}")
        if self.timeout_s <= 0:
            raise ValueError("--timeout must be > 0")


@dataclass(frozen=True)
class NodeStatus:
    """One node as the registry (and, for local clusters, the launcher) sees it."""

    role: str
    node_id: str
    model: str
    grpc_address: str
    kv_address: str
    metrics_address: str | None  # known for clusters `pdserve up` runs
    pid: int
    hostname: str
    queue_len: int | None  # None: no load record yet
    running: int | None
    in_flight: int | None
    tokens_per_s: float | None
    kv_blocks_used: int | None
    kv_blocks_total: int
    kv_usage: float | None  # used / total
    draining: bool
    load_age_s: float | None  # seconds since the node last published its load
    tokenizer_digest: str  # what the node loaded ("" from a node older than the digests)
    chat_template_digest: str
    digests_differ: bool = False  # not the digests most nodes of its model publish: frontends exclude it


@dataclass(frozen=True)
class ClusterStatus:
    cluster: str
    etcd_endpoints: list[str]
    url: str | None  # the frontend of a local cluster
    launcher_pid: int | None
    nodes: list[NodeStatus]


def node_status(member: Member, metrics: dict[str, str], now: float) -> NodeStatus:
    rec, load = member.record, member.load
    total = rec.capacity.num_kv_blocks
    return NodeStatus(
        role=rec.role, node_id=rec.node_id, model=rec.model, grpc_address=rec.grpc_address,
        kv_address=rec.kv_address, metrics_address=metrics.get(rec.node_id), pid=rec.pid, hostname=rec.hostname,
        queue_len=load.queue_len if load else None, running=load.running if load else None,
        in_flight=load.in_flight if load else None,
        tokens_per_s=load.tokens_per_s if load else None, kv_blocks_used=load.kv_blocks_used if load else None,
        kv_blocks_total=total, kv_usage=(load.kv_blocks_used / total if load and total else None),
        draining=bool(load and load.draining), load_age_s=(now - load.updated_at) if load else None,
        tokenizer_digest=rec.tokenizer_digest, chat_template_digest=rec.chat_template_digest,
    )


def mark_odd_digests(nodes: list[NodeStatus]) -> list[NodeStatus]:
    """`nodes`, each with digests_differ set when its model's nodes mostly publish other digests. The
    frontends compare with their own tokenizer, which `status` cannot read; this is the registry's view."""
    pairs: dict[str, Counter[tuple[str, str]]] = {}
    for n in nodes:
        if n.tokenizer_digest:
            pairs.setdefault(n.model, Counter())[(n.tokenizer_digest, n.chat_template_digest)] += 1
    out = []
    for n in nodes:
        ranked = pairs.get(n.model, Counter()).most_common(2)
        clear = len(ranked) == 2 and ranked[0][1] > ranked[1][1]
        odd = clear and bool(n.tokenizer_digest) and (n.tokenizer_digest, n.chat_template_digest) != ranked[0][0]
        out.append(replace(n, digests_differ=odd))
    return out


async def _members(endpoints: Sequence[str], cluster: str, timeout_s: float) -> dict[str, Member]:
    view = RegistryView(list(endpoints), cluster)
    await view.start(sync_timeout_s=timeout_s)
    try:
        return view.snapshot()
    finally:
        await view.close()


def collect(config: StatusConfig) -> ClusterStatus:
    """Reads the registry once. Raises LookupError when no cluster can be found, ConnectionError when
    etcd does not answer."""
    state = None
    endpoints = list(config.etcd_endpoints)
    if not endpoints:
        state = ClusterState.load(config.runs_dir, config.cluster)
        if state is None:
            raise LookupError(
                f"no cluster {config.cluster!r} started by `pdserve up` is running here "
                f"({ClusterState.path(config.runs_dir, config.cluster)}); start one, or pass --etcd HOST:PORT"
            )
        endpoints = state.etcd_endpoints
    members = asyncio.run(_members(endpoints, config.cluster, config.timeout_s))
    metrics = {str(p["name"]): str(p["metrics"]) for p in (state.processes if state else []) if p.get("metrics")}
    now = time.time()
    nodes = sorted(mark_odd_digests([node_status(m, metrics, now) for m in members.values()]),
                   key=lambda n: (n.role != "prefill", n.node_id))
    return ClusterStatus(config.cluster, endpoints, state.url if state else None,
                         state.launcher_pid if state else None, nodes)


def to_json(status: ClusterStatus) -> str:
    return json.dumps(asdict(status), indent=2)


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _digests(n: NodeStatus) -> str:
    if not n.tokenizer_digest:
        return "-"
    return f"{n.tokenizer_digest[:8]}/{n.chat_template_digest[:8]}" + (" (differ)" if n.digests_differ else "")


def render(status: ClusterStatus, console: Console) -> None:
    """Prints the cluster header and the node table."""
    where = f"frontend {status.url}, launcher pid {status.launcher_pid}, " if status.url else ""
    console.print(f"cluster [bold]{status.cluster}[/bold]: {where}etcd {','.join(status.etcd_endpoints)}")
    table = Table(box=None, pad_edge=False)
    for column in ("role", "node", "model", "grpc", "kv", "metrics", "pid", "queue", "running", "in flight",
                   "tok/s", "KV used", "KV %", "load age", "tokenizer/template"):
        table.add_column(column, justify="right" if column in ("pid", "queue", "running", "in flight", "tok/s",
                                                               "KV used", "KV %", "load age") else "left")
    for n in status.nodes:
        table.add_row(
            n.role + (" (draining)" if n.draining else ""), n.node_id, n.model, n.grpc_address, n.kv_address,
            n.metrics_address or "-", str(n.pid), _fmt(n.queue_len), _fmt(n.running), _fmt(n.in_flight),
            _fmt(n.tokens_per_s, ".1f"), f"{_fmt(n.kv_blocks_used)}/{n.kv_blocks_total}",
            _fmt(None if n.kv_usage is None else 100 * n.kv_usage, ".1f"), _fmt(n.load_age_s, ".1f") + "s",
            _digests(n),
        )
    console.print(table if status.nodes else "no node is registered")


def run(config: StatusConfig) -> int:
    """`pdserve status`: prints the view; 1 when no cluster is found or etcd does not answer."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=240)  # piped or redirected: no column is cut to fit 80 characters
    try:
        status = collect(config)
    except (LookupError, ConnectionError) as err:
        Console(stderr=True).print(f"pdserve status: {err}", highlight=False)
        return 1
    if config.as_json:
        print(to_json(status))
    else:
        render(status, console)
    return 0


def build_config(args: Any) -> StatusConfig:
    endpoints = tuple(e.strip() for item in (args.etcd or []) for e in item.split(",") if e.strip())
    return StatusConfig(
        cluster=args.cluster, etcd_endpoints=endpoints,
        runs_dir=Path(args.runs_dir) if args.runs_dir else default_runs_dir(), as_json=args.json,
    )
