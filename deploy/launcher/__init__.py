"""`pdserve up`: the whole cluster on one machine, supervised.

Processes, each in a session of its own so that a Ctrl-C in the terminal reaches only the launcher, which
then stops them in order:

    etcd        python -m pdserve.registry.etcd_server    (etcd's /metrics is on its client port)
    prefill-i   python -m prefill_node            (/metrics on a port the launcher picks)
    decode-i    python -m decode_node
    frontend    python -m pdserve.frontend                (the OpenAI API and /metrics on --host:--port)

Start-up: etcd, then every node at once (progress shown while the models load), then the frontend once
the nodes are registered. A process that dies after it was ready is reported and restarted, with a
backoff that doubles up to 30 s. Ctrl-C (or SIGTERM) stops the frontend, then the decode nodes, then the
prefill nodes (each drains: deregisters, finishes its requests, exits), checks that the cluster's registry
prefix is empty (deleting what a killed process left), then stops etcd. A second Ctrl-C stops what is
left at once.

Files, under `<runs>/<cluster>/` (`runs/` in the repository root by default):
    logs/<process>.log           every process's output (logs/requests.log: the frontend's request log)
    prometheus_targets.json      Prometheus file-discovery targets (deploy/prometheus/README.md),
                                 rewritten atomically whenever a process starts, moves or stops
    cluster.json                 what `pdserve status` reads to find the cluster (removed at exit)

Modules: `config` (LauncherConfig, build_config, ClusterState), `process` (Slot, command lines, start,
stdout reader), `supervisor` (Launcher: start order, supervision, files), `display` (progress table,
banner), `shutdown` (stop order, registry check), `autoscaling` (--autoscale: the planner's controller
starting and draining node slots).
"""

from __future__ import annotations

from pdserve.deploy.launcher.config import (
    POOLS,
    REPO_ROOT,
    ClusterState,
    LauncherConfig,
    build_config,
    default_runs_dir,
    pid_alive,
    write_json_atomic,
)
from pdserve.deploy.launcher.process import Slot, StartupError
from pdserve.deploy.launcher.shutdown import registry_keys
from pdserve.deploy.launcher.supervisor import Launcher

__all__ = [
    "POOLS", "REPO_ROOT", "ClusterState", "Launcher", "LauncherConfig", "Slot", "StartupError", "build_config",
    "default_runs_dir", "pid_alive", "registry_keys", "write_json_atomic",
]
