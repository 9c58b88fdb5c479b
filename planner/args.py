"""The `pdserve profile` and `pdserve plan` options. argparse only, so that building the `pdserve` parser
imports nothing else of the planner (nor torch); deploy/cli.py attaches the commands."""

from __future__ import annotations

import argparse


def tp_widths(text: str) -> tuple[int, ...]:
    """`1,2` -> (1, 2): distinct integers >= 1, ascending (argparse type; ArgumentTypeError otherwise)."""
    try:
        widths = tuple(sorted({int(w) for w in text.split(",") if w.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 1,2; got {text!r}") from None
    if not widths or widths[0] < 1:
        raise argparse.ArgumentTypeError(f"TP widths must be integers >= 1, got {text!r}")
    return widths


def add_profile_parser(sub: argparse._SubParsersAction, model_help: str) -> argparse.ArgumentParser:
    """`pdserve profile`: time the engine on this machine for the planner."""
    p = sub.add_parser("profile", help="time the engine on this machine (prefill, decode steps, KV transfer, "
                                       "KV capacity) and fit the planner's cost model",
                       description="Runs the engine in-process (no cluster) and writes a versioned JSON profile: "
                                   "machine facts, the model's fingerprint, raw timings and fitted coefficients. "
                                   "`pdserve plan --profile` reads it.")
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-memory", type=int, default=512, metavar="MIB", help="KV cache budget per node (MiB), "
                                                                             "as `pdserve up --kv-memory`")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the nodes' token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=128, help="the nodes' sequences per step")
    p.add_argument("--local-prefill-threshold", type=int, default=64, help="the decode nodes' threshold")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--tp-widths", default="1", metavar="W1,W2", type=tp_widths,
                   help="tensor-parallel widths to profile (default 1): the engine runs with tensor_parallel_size "
                        "W for each (W > 1 needs float weights); `pdserve plan --tp-widths` picks among them")
    p.add_argument("--out", default="profile.json", help="where to write the profile (default profile.json)")
    p.add_argument("--quick", action="store_true", help="few, small points (seconds on a tiny model): a smoke test")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def add_machine_flag(p: argparse.ArgumentParser) -> None:
    """--allow-other-machine: plan with a profile of another CPU kind (planner/machine.py)."""
    p.add_argument("--allow-other-machine", action="store_true",
                   help="use a profile measured on another CPU kind (vendor, model, ISA flags) anyway, with a "
                        "warning; by default such a profile is refused, its step times do not hold here")


def add_plan_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`pdserve plan`: the cheapest P:D (or colocated) shape meeting SLOs, by simulation."""
    p = sub.add_parser("plan", help="is disaggregation worth it, and how many prefill and decode nodes: "
                                    "simulates shapes under a traffic and SLOs",
                       description="Simulates every P:D and colocated shape up to --max-nodes under the traffic "
                                   "(a discrete-event model timed by a `pdserve profile`), prints the cheapest shape "
                                   "meeting the SLOs and the alternatives, writes a deploy/k8s values file.")
    p.add_argument("--profile", required=True, metavar="PROFILE.json", help="from `pdserve profile`")
    add_machine_flag(p)
    w = p.add_argument_group("traffic (one of --workload, --trace)")
    w.add_argument("--workload", default=None, metavar="SPEC",
                   help="prompt=DIST,output=DIST[,prefix=N]; DIST as `pdserve bench`: N, uniform:LO:HI, "
                        "normal:MEAN:STD (default prompt=256,output=128)")
    w.add_argument("--trace", default=None, metavar="FILE.jsonl", help="a `pdserve bench --trace` file; its "
                                                                        "arrivals are rescaled to --rate")
    w.add_argument("--tokenizer", default=None, metavar="DIR", help="counts a trace's text prompts exactly")
    w.add_argument("--rate", type=float, default=None, help="the request rate to plan for (req/s; a trace: its own)")
    w.add_argument("--sweep", action="store_true", help="find each shape's highest rate within the SLOs")
    w.add_argument("--requests", type=int, default=400, help="simulated requests per run (default 400)")
    w.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("goal and search")
    g.add_argument("--slo", default=None, metavar="ttft_p90=1s,tpot_p99=50ms",
                   help="as `pdserve bench --slo`: per-request thresholds, judged at the _pNN percentile")
    g.add_argument("--attainment", type=float, default=0.9, help="target fraction of good requests (0.9)")
    g.add_argument("--max-nodes", "--max-cores", dest="max_nodes", type=int, default=8,
                   help="budget: shapes up to this many node ranks, i.e. cores or GPUs (a TP-w node counts w; "
                        "at TP 1, nodes) (8)")
    g.add_argument("--tp-widths", default=None, metavar="W1,W2", type=tp_widths,
                   help="TP widths each pool may take, e.g. 1,2 (each must be in the profile: `pdserve profile "
                        "--tp-widths`); default: the profile's first width (1)")
    n = p.add_argument_group("node settings (default: the profile's)")
    n.add_argument("--local-prefill-threshold", type=int, default=None)
    n.add_argument("--max-num-seqs", type=int, default=None)
    n.add_argument("--max-num-batched-tokens", type=int, default=None)
    n.add_argument("--num-kv-blocks", type=int, default=None)
    n.add_argument("--overheads", default=None, metavar="FILE.json",
                   help="costs beyond the profile's engine steps (node CPU around steps, the frontend's latency "
                        "and CPU when it shares the nodes' cores), as `bench/shapes.py` measures them; "
                        "default: none")
    o = p.add_argument_group("output")
    o.add_argument("--values-out", default=None, metavar="FILE.yaml",
                   help="write the recommended replica counts (prefill.replicas, decode.replicas) for deploy/k8s")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="goodput against rate (needs matplotlib)")
    o.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    c = p.add_argument_group("check a live cluster (--check)")
    c.add_argument("--check", action="store_true", help="derive the traffic from a live cluster's metrics and say "
                                                        "whether its P:D still fits")
    c.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                   help="a frontend's /metrics (repeatable: every frontend of the cluster)")
    c.add_argument("--node-metrics-url", action="append", default=[], metavar="URL",
                   help="a prefill or decode node's /metrics (repeatable): counts the current shape")
    c.add_argument("--prometheus", default=None, metavar="URL", help="a Prometheus server instead of /metrics URLs")
    c.add_argument("--window", type=float, default=300.0,
                   help="seconds of traffic to average: scrape twice this far apart (/metrics), or the "
                        "query range (Prometheus); 0 with /metrics: since the frontend started")
    return p


def _add_damping(g: argparse._ArgumentGroup, prefix: str = "") -> None:
    g.add_argument(f"--{prefix}attainment", type=float, default=0.9, help="target fraction of good requests (0.9)")
    g.add_argument(f"--{prefix}interval", type=float, default=5.0, metavar="S", help="seconds between decisions (5)")
    g.add_argument(f"--{prefix}window", type=float, default=60.0, metavar="S",
                   help="seconds of traffic each decision averages (60)")
    g.add_argument(f"--{prefix}cooldown", type=float, default=60.0, metavar="S",
                   help="at least this long between two changes of the shape (60)")
    g.add_argument(f"--{prefix}band", type=float, default=0.2, metavar="F",
                   help="hysteresis: scale down only when the smaller shape meets the SLOs at the observed rate "
                        "times 1 + F (0.2)")


def add_up_autoscale_flags(u: argparse.ArgumentParser) -> None:
    """`pdserve up --autoscale`: the controller starts and drains this machine's nodes."""
    g = u.add_argument_group("autoscaling (--autoscale)")
    g.add_argument("--autoscale", action="store_true",
                   help="size the pools to the live traffic: the planner's model against --autoscale-slo decides "
                        "the P:D shape, nodes are started and drained within --node-budget")
    g.add_argument("--node-budget", type=int, default=None, metavar="N", help="the most nodes the autoscaler runs")
    g.add_argument("--autoscale-profile", default=None, metavar="PROFILE.json", help="from `pdserve profile`")
    g.add_argument("--autoscale-slo", default=None, metavar="ttft_p90=1s,tpot_p99=50ms",
                   help="the SLOs the shape must meet, as `pdserve plan --slo`")
    g.add_argument("--autoscale-overheads", default=None, metavar="FILE.json",
                   help="costs beyond the profile's engine steps, as `pdserve plan --overheads` (bench/shapes.py "
                        "measures them); default: none")
    _add_damping(g, "autoscale-")
    g.add_argument("--allow-other-machine", action="store_true",
                   help="use a profile measured on another CPU kind anyway, with a warning")


def add_autoscale_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`pdserve autoscale`: the controller against a cluster it does not run (Kubernetes)."""
    p = sub.add_parser("autoscale", help="decide the P:D shape from live metrics and export the desired replicas "
                                         "per pool (pdserve_autoscale_desired_replicas, for KEDA or an HPA)",
                       description="Reads the live traffic as `pdserve plan --check` does (each frontend's "
                                   "/metrics, or Prometheus), decides the cheapest shape within --node-budget "
                                   "that meets --slo with the planner's model, damped (hysteresis, cooldown), "
                                   "and serves its decisions on /metrics.")
    p.add_argument("--profile", required=True, metavar="PROFILE.json", help="from `pdserve profile`")
    add_machine_flag(p)
    p.add_argument("--slo", required=True, metavar="ttft_p90=1s,tpot_p99=50ms", help="as `pdserve plan --slo`")
    p.add_argument("--overheads", default=None, metavar="FILE.json",
                   help="costs beyond the profile's engine steps, as `pdserve plan --overheads`; default: none")
    p.add_argument("--node-budget", type=int, required=True, metavar="N",
                   help="the most node ranks of both pools (a TP-w node counts w; at TP 1, nodes)")
    p.add_argument("--colocated", action="store_true", help="the cluster runs colocated nodes (no prefill pool)")
    p.add_argument("--prefill-tp", type=int, default=1, metavar="N",
                   help="the prefill nodes' TP width (prefill.tp; default 1): kept, counted N ranks a node")
    p.add_argument("--decode-tp", type=int, default=1, metavar="N", help="the decode nodes' TP width (decode.tp)")
    s = p.add_argument_group("metrics source")
    s.add_argument("--metrics-url", action="append", default=[], metavar="URL", help="a frontend's /metrics "
                                                                                     "(repeatable)")
    s.add_argument("--node-metrics-url", action="append", default=[], metavar="URL",
                   help="a node's /metrics (repeatable): the current shape")
    s.add_argument("--prometheus", default=None, metavar="URL", help="a Prometheus server instead of /metrics URLs")
    d = p.add_argument_group("damping")
    _add_damping(d)
    o = p.add_argument_group("output")
    o.add_argument("--metrics-host", default="0.0.0.0", help="where its /metrics listens (0.0.0.0)")
    o.add_argument("--metrics-port", type=int, default=9400, help="its /metrics port (9400; 0: none)")
    o.add_argument("--once", action="store_true", help="one decision (after one --window), printed, then exit")
    return p
