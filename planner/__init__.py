"""Capacity planning: is disaggregation worth it for a traffic, and how many prefill and decode nodes.

Torch-free except `measure` (which runs the engine to time it).

    profile_model.py  the cost model (step, prefill, transfer fits; KV capacity) and its JSON file
    measure.py        `pdserve profile`: times the real engine on this machine, fits the cost model
    sim.py            discrete-event simulation of a cluster shape under a workload
    sim_nodes.py      the simulated prefill and decode nodes and a request's state there
    traffic.py        loadgen's workloads and traces as simulated requests
    plan.py           the shape search (at a rate or swept), the recommendation, the k8s values file
    args.py           the `pdserve profile` / `pdserve plan` options (argparse only)
    cli.py            `pdserve plan`: options -> config, progress, the tables, the plot, JSON
    check.py          `pdserve plan --check`: a live cluster's traffic from its metrics, re-planned
    machine.py        the CPU kind a profile was measured on; plan refuses another kind
    autoscale.py      `pdserve autoscale` / `pdserve up --autoscale`: the damped controller, its metrics
"""

from __future__ import annotations
