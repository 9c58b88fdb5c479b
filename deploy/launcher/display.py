"""What `pdserve up` shows: the start-up progress table, each ready process's endpoint, and the banner."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pdserve.deploy.launcher.config import LauncherConfig, default_runs_dir
from pdserve.deploy.launcher.process import Slot


def progress_table(slots: Sequence[Slot], what: str) -> Table:
    """The start-up table: every process, its pool, pid and status."""
    table = Table(title=f"pdserve up: {what}", title_justify="left", box=None, pad_edge=False)
    for column in ("process", "pool", "pid", "status"):
        table.add_column(column)
    for slot in slots:
        table.add_row(slot.name, slot.pool, str(slot.pid or "-"), slot.status)
    return table


def endpoint(cfg: LauncherConfig, slot: Slot, etcd_endpoints: Sequence[str]) -> str:
    """Where a ready process answers."""
    if slot.pool == "etcd":
        return ",".join(etcd_endpoints)
    if slot.pool == "frontend":
        return cfg.base_url
    return f"grpc {slot.info.get('grpc_address')}  metrics {slot.info.get('metrics_address')}"


def served_dtype(cfg: LauncherConfig) -> str:
    """The dtype the nodes will serve in and why (what each node also logs at start)."""
    from pdserve.engine.dtype import checkpoint_dtype_name, resolve_dtype
    from pdserve.engine.model_config import GGUF_WEIGHTS

    quantized = (Path(cfg.model) / GGUF_WEIGHTS).is_file()
    try:
        return resolve_dtype(cfg.dtype, checkpoint_dtype_name(cfg.model), "cpu", quantized=quantized).reason
    except (OSError, ValueError) as e:
        return f"{cfg.dtype} (checkpoint dtype unreadable: {e})"


def _weights(slots: Sequence[Slot]) -> str:
    """How the nodes hold the weights, as their ready lines said (every node of a pool loads the same)."""
    said = {str(s.info["weights"]) for s in slots if s.pool in ("prefill", "decode") and s.info.get("weights")}
    return " | ".join(sorted(said)) or "unknown (no node said)"


def print_banner(out: Console, cfg: LauncherConfig, slots: Sequence[Slot], etcd_endpoints: Sequence[str],
                 logs_dir: Path) -> None:
    """What `pdserve up` prints once the cluster is up: the URL, how to call it, logs, metrics, status."""
    url, model = cfg.base_url, cfg.model_name
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    sdk = (
        "from openai import OpenAI\n"
        f'client = OpenAI(base_url="{url}/v1", api_key="local")\n'
        f'reply = client.chat.completions.create(model="{model}", max_tokens=32,\n'
        '                                        messages=[{"role": "user", "content": "Hello!"}])\n'
        "print(reply.choices[0].message.content)"
    )
    node_metrics = "\n".join(
        f"             {s.name:<11} http://{s.info.get('metrics_address')}/metrics"
        for s in slots if s.pool in ("prefill", "decode")
    )
    etcd_metrics = "".join(f"http://{e}/metrics" for e in etcd_endpoints[:1])
    out.print(
        f"\n[bold green]pdserve is up[/bold green]: {model}, {_shape(cfg)}, cluster {cfg.cluster!r}\n"
        f"  dtype      {served_dtype(cfg)}\n"
        f"  weights    {_weights(slots)}\n"
        f"  cores      {_cores(cfg)}\n\n"
        f"  URL        {url}/v1  (OpenAI-compatible)\n"
        f"  console    {url}/  (cluster, charts, requests, chat)\n\n"
        f"  curl       curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"               -d '{body}'\n\n"
        f"  openai SDK (python)\n{_indent(sdk, 13)}\n\n"
        f"  logs       {logs_dir}/*.log\n"
        f"  /metrics   frontend    {url}/metrics\n{node_metrics}\n"
        f"             etcd        {etcd_metrics}\n"
        f"  Prometheus {cfg.cluster_dir / 'prometheus_targets.json'} "
        f"(deploy/prometheus/prometheus.yml reads it)\n"
        f"  status     pdserve status{_status_flags(cfg)} [--json]\n\n"
        "Ctrl-C stops the cluster.\n",
        highlight=False, markup=True, soft_wrap=True,
    )


def _status_flags(cfg: LauncherConfig) -> str:
    flags = "" if cfg.cluster == "default" else f" --cluster {cfg.cluster}"
    if cfg.runs_dir.resolve() != default_runs_dir().resolve():
        flags += f" --runs-dir {cfg.runs_dir}"
    return flags


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())


def _shape(cfg: LauncherConfig) -> str:
    if cfg.num_prefill == 0:
        return f"{cfg.num_decode} colocated node(s) (decode nodes that prefill every prompt themselves)"
    return f"{cfg.num_prefill} prefill + {cfg.num_decode} decode node(s)"


def _cores(cfg: LauncherConfig) -> str:
    """Where each node runs and with how many torch threads."""
    cpus = cfg.node_cpus()
    return "; ".join(
        f"{name} {'cpus ' + ','.join(map(str, cpus[name])) if name in cpus else 'unpinned'} "
        f"x{cfg.node_threads(name)} thread(s)" for name in cfg.node_names
    )
