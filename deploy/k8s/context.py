"""The checks on the k8s values and the template context derived from them (object names, the etcd
member list, the frontend's tenants and models files, command lines): `build_context`."""

from __future__ import annotations

import copy
import hashlib
import re
import urllib.parse
from pathlib import Path
from typing import Any

import yaml

RULES_FILE = Path(__file__).resolve().parent.parent / "prometheus" / "rules.yml"
DASHBOARDS_DIR = Path(__file__).resolve().parent.parent / "grafana"
CONFIG_DIR = "/etc/pdserve"  # where the frontend finds tenants.yaml and models.yaml
ROLES = ("prefill", "decode")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
# PostgreSQL role and database names that need no quoting, in SQL or in a URL.
_PG_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
# Pod names add up to 17 characters (ReplicaSet hash and pod suffix) to a Deployment's name, and the pod
# name must stay a 63-character DNS label because it is the node id and appears in label values.
_MAX_NAME = 46
SOURCE_MOUNT = "/model-source"  # where an init container finds a model's source volume
# API keys written in this repository (README, examples, tests, benchmarks): anyone can read them, so a
# tenants file that accepts one is open to everyone. Their digests are refused.
PUBLIC_KEYS = (
    "sk-pdserve-example-acme", "sk-pdserve-example-beta", "sk-test", "test", "sk-admin", "sk-admin-1234abcd",
    "sk-acme", "sk-abc", "sk-abcdefghijklmnop123", "sk-any", "sk-whatever", "sk-other", "sk-wrong", "sk-nope",
    "sk-none", "sk-plaintext", "sk-alpha-0123456789abcdef", "sk-beta-0123456789abcdef", "sk-gamma-0123456789ab",
    "sk-alpha-live-0123456789", "sk-beta-live-0123456789", "sk-bench-0123456789abcdef0123",
    "sk-overload-0123456789abcdef", "sk-overload-bench-0123456789", "", "changeme", "password", "secret",
)
PUBLIC_DIGESTS = {hashlib.sha256(k.encode()).hexdigest(): k for k in PUBLIC_KEYS}
MAKE_KEY_HINT = ("make a key with `python3 -c 'import secrets; print(\"sk-\" + secrets.token_urlsafe(32))'` and "
                 "store its digest from `pdserve frontend --hash-key KEY` (or `printf %s KEY | sha256sum`)")


class ValuesError(ValueError):
    """Values that cannot produce a working deployment; the message names the key."""


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` merged into a copy of `base`: mappings merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _dns_label(where: str, text: str, max_len: int = 63) -> str:
    """`text` as a DNS label (lowercase; dots and underscores become dashes); raises if still invalid."""
    label = re.sub(r"[._]", "-", str(text).lower())
    if not _DNS_LABEL.match(label) or len(label) > max_len:
        raise ValuesError(f"{where}: {text!r} does not make a DNS label of at most {max_len} characters")
    return label


def _int(where: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValuesError(f"{where} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_pdb(where: str, pdb: dict[str, Any], replicas: int) -> dict[str, Any]:
    """A PDB spec that names exactly one bound and does not forbid every eviction."""
    if not isinstance(pdb, dict) or len(pdb.keys() & {"minAvailable", "maxUnavailable"}) != 1:
        raise ValuesError(f"{where}: give exactly one of minAvailable, maxUnavailable")
    low = pdb.get("minAvailable")
    if isinstance(low, int) and replicas > 0 and low >= replicas:
        # A node drain would then wait forever on this workload.
        raise ValuesError(f"{where}: minAvailable {low} >= replicas {replicas} blocks every voluntary eviction")
    if pdb.get("maxUnavailable") == 0:
        raise ValuesError(f"{where}: maxUnavailable 0 blocks every voluntary eviction")
    return pdb


def _rollout_count(where: str, key: str, value: Any) -> int:
    """The number in a rollingUpdate maxSurge / maxUnavailable value (an integer or "N%")."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\d+%", value):
        return int(value[:-1])
    raise ValuesError(f"{where}: strategy.rollingUpdate.{key}: {value!r} is neither an integer nor a percentage")


def _check_rollout(where: str, strategy: dict[str, Any]) -> dict[str, Any]:
    """A rollout that never drops below the desired replica count: a new pod comes up (and passes
    readiness) before an old one drains."""
    rolling = (strategy or {}).get("rollingUpdate") or {}
    if (strategy or {}).get("type") != "RollingUpdate":
        raise ValuesError(f"{where}: strategy.type must be RollingUpdate (Recreate stops the whole pool at once)")
    unavailable = _rollout_count(where, "maxUnavailable", rolling.get("maxUnavailable", 0))
    surge = _rollout_count(where, "maxSurge", rolling.get("maxSurge", 0))
    if unavailable != 0 or surge < 1:
        raise ValuesError(f"{where}: strategy.rollingUpdate must keep capacity during a rollout: maxUnavailable: 0 "
                          f"and maxSurge >= 1 (got maxUnavailable {rolling.get('maxUnavailable')!r}, maxSurge "
                          f"{rolling.get('maxSurge')!r}); a surge pod needs a free GPU")
    return strategy


# ---------------------------------------------------------------------------------------- context


def _selector(v: dict[str, Any], component: str, model: str | None = None) -> dict[str, str]:
    sel = {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": v["name"],
        "app.kubernetes.io/component": component,
    }
    if model is not None:
        sel["pdserve.io/model"] = model
    return sel


def _labels(v: dict[str, Any], component: str, model: str | None = None) -> dict[str, str]:
    return {
        **_selector(v, component, model),
        "app.kubernetes.io/part-of": "pdserve",
        "app.kubernetes.io/version": str(v["image"]["tag"]),
        "pdserve.io/cluster": v["cluster"],
    }


def _scrape_annotations(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def _models_file(v: dict[str, Any]) -> str:
    """The frontend's models file (format: frontend/config.py)."""
    mount = v["modelStorage"]["mountPath"].rstrip("/")
    entries = []
    for m in v["models"]:
        entry: dict[str, Any] = {"name": m["name"], "path": f"{mount}/{m['path']}", "pool": m["name"]}
        if m.get("aliases"):
            entry["aliases"] = list(m["aliases"])
        for key, out_key in (("fallback", "fallback"), ("maxContext", "max_context"),
                             ("maxOutputTokens", "max_output_tokens"), ("defaultMaxTokens", "default_max_tokens"),
                             ("speculative", "speculative")):
            if m.get(key) is not None:
                entry[out_key] = m[key]
        if m.get("prices") is not None:
            entry["prices"] = _prices(m["name"], m["prices"])
        entries.append(entry)
    return yaml.safe_dump({"models": entries}, sort_keys=False)


def _prices(model: str, prices: Any) -> dict[str, Any]:
    """A model's price table, checked by the frontend's own rule (it would refuse to start otherwise)."""
    from pdserve.frontend.config import ConfigError, read_prices  # the models file's format

    try:
        read_prices(prices, model)
    except ConfigError as err:
        raise ValuesError(f"models[{model}]: {err}") from None
    return dict(prices)


def _tenants_file(v: dict[str, Any], served: set[str]) -> str:
    """The frontend's tenants file (format: frontend/tenants.py); only digests of keys, never keys."""
    items = v["tenants"].get("items") or []
    if not items:
        raise ValuesError("tenants.items: list at least one tenant, or set tenants.enabled: false")
    for i, t in enumerate(items):
        where = f"tenants.items[{i}]"
        for digest in t.get("keys_sha256") or []:
            if not isinstance(digest, str) or not _SHA256_HEX.match(digest):
                raise ValuesError(f"{where}: {digest!r} is not a lowercase SHA-256 hex digest (store hashed keys only)")
            if digest in PUBLIC_DIGESTS:
                raise ValuesError(f"{where}: {digest} is the digest of the published key {PUBLIC_DIGESTS[digest]!r}, "
                                  f"which anyone can use: {MAKE_KEY_HINT}")
        if not t.get("keys_sha256"):
            raise ValuesError(f"{where}: keys_sha256 must list at least one digest")
        unknown = sorted(set(t.get("models") or ["*"]) - served - {"*"})
        if unknown:
            raise ValuesError(f"{where}: models {unknown} are not served (names and aliases: {sorted(served)})")
    return yaml.safe_dump({"tenants": items}, sort_keys=False)


def _flags(pairs: list[tuple[str, Any]]) -> list[str]:
    """`--flag=value` items (one per line in the manifest, readable next to its value)."""
    return [f"--{flag}={value}" for flag, value in pairs]


def _node_args(v: dict[str, Any], m: dict[str, Any], cfg: dict[str, Any], etcd: str) -> list[str]:
    mount = v["modelStorage"]["mountPath"].rstrip("/")
    pairs: list[tuple[str, Any]] = [
        ("node-id", "$(POD_NAME)"),  # pod names are unique, and the dashboards show them as `node`
        ("cluster", v["cluster"]),
        ("etcd", etcd),
        ("model", f"{mount}/{m['path']}"),
        ("model-name", m["name"]),
        ("dtype", cfg["dtype"]),
        ("device", cfg.get("device", "cuda")),
        ("kv-cache-memory-mib", cfg["kvCacheMemoryMiB"]),
        ("max-num-seqs", cfg["maxNumSeqs"]),
        ("max-num-batched-tokens", cfg["maxNumBatchedTokens"]),
    ]
    if m.get("maxContext"):
        pairs.append(("max-model-len", m["maxContext"]))
    if cfg.get("tp", 1) > 1:  # the node's ranks: one process (and device, or core) each
        pairs.append(("tensor-parallel-size", cfg["tp"]))
    if cfg.get("speculative"):
        pairs += [("speculative", cfg["speculative"]), ("num-speculative-tokens", cfg.get("numSpeculativeTokens", 4))]
    if cfg.get("kvTierGiB"):  # the pod's kv-tier emptyDir (40-pools.yaml.j2)
        pairs += [("kv-tier-dir", "/var/lib/pdserve/kv-tier"), ("kv-tier-gib", cfg["kvTierGiB"])]
    if cfg.get("kvInterface"):
        pairs.append(("kv-interface", cfg["kvInterface"]))  # gloo's NIC (NCCL takes NCCL_SOCKET_IFNAME)
    # The node's own drain bound is the preStop hook's (one value, `drainTimeoutSeconds`): a node that
    # gave up earlier would cut requests the hook still waits for.
    pairs.append(("drain-timeout", cfg["drainTimeoutSeconds"]))
    if "drainGraceSeconds" in cfg:
        pairs.append(("drain-grace", cfg["drainGraceSeconds"]))
    pairs += [
        # Bind everywhere, advertise the pod IP: peers and the frontends dial what the registry says.
        ("grpc-host", "0.0.0.0"),
        ("grpc-port", cfg["grpcPort"]),
        ("advertise-host", "$(POD_IP)"),
        # The KV rendezvous address is both bound and advertised, so it must be the pod IP itself.
        ("kv-host", "$(POD_IP)"),
        ("kv-port", cfg["kvPort"]),
        ("metrics-host", "0.0.0.0"),
        ("metrics-port", cfg["metricsPort"]),
        ("log-level", cfg["logLevel"]),
    ]
    return _flags(pairs) + [str(a) for a in cfg.get("extraArgs") or []]


def _pools(v: dict[str, Any], etcd: str) -> list[dict[str, Any]]:
    """One pool per (model, role), with the model's overrides merged over the role's values."""
    pools = []
    labels: dict[str, str] = {}
    for m in v["models"]:
        model_label = _dns_label(f"models[{m['name']}].name", m["name"])
        if model_label in labels:
            raise ValuesError(f"models {labels[model_label]!r} and {m['name']!r} make the same object names")
        labels[model_label] = m["name"]
        source = _model_source(v, m, model_label)
        for role in ROLES:
            override = m.get(role) or {}
            if not isinstance(override, dict):
                raise ValuesError(f"models[{m['name']}].{role} must be a mapping of {role} keys")
            unknown = sorted(set(override) - set(v[role]))
            if unknown:
                raise ValuesError(f"models[{m['name']}].{role}: unknown keys {unknown}")
            pool = _pool(v, m, role, model_label, deep_merge(v[role], override), etcd)
            pool["init_containers"] = [source["container"]] if source else []
            pool["source_volumes"] = [source["volume"]] if source and source["volume"] else []
            pools.append(pool)
    return pools


def _pool(v: dict[str, Any], m: dict[str, Any], role: str, model_label: str, cfg: dict[str, Any],
          etcd: str) -> dict[str, Any]:
    where = f"{role} (model {m['name']})"
    replicas = _int(f"{where}: replicas", cfg["replicas"], 0)
    gpus = _int(f"{where}: gpus", cfg["gpus"], 1)
    drain = _int(f"{where}: drainTimeoutSeconds", cfg["drainTimeoutSeconds"], 1)
    margin = _int(f"{where}: terminationMarginSeconds", cfg["terminationMarginSeconds"], 5)
    grace = cfg.get("terminationGracePeriodSeconds")
    if grace is None:
        grace = drain + margin
    elif _int(f"{where}: terminationGracePeriodSeconds", grace, 1) < drain + margin:
        # Kubernetes kills the pod at the end of the grace period, preStop hook or not: the drain is cut.
        raise ValuesError(f"{where}: terminationGracePeriodSeconds {grace} is shorter than drainTimeoutSeconds "
                          f"{drain} + terminationMarginSeconds {margin}: the drain would be cut (leave it null)")
    if role == "decode" and _int(f"{where}: drainGraceSeconds", cfg["drainGraceSeconds"], 0) >= drain:
        raise ValuesError(f"{where}: drainGraceSeconds {cfg['drainGraceSeconds']} must be shorter than "
                          f"drainTimeoutSeconds {drain}, or nothing is left to hand the remaining requests over")
    for arg in cfg.get("extraArgs") or []:
        if str(arg).split("=", 1)[0] in ("--drain-timeout", "--drain-grace"):
            raise ValuesError(f"{where}: extraArgs sets {arg}: use drainTimeoutSeconds / drainGraceSeconds, which "
                              "also size the preStop hook and the grace period")
        if str(arg).split("=", 1)[0] in ("--tensor-parallel-size", "--device"):
            raise ValuesError(f"{where}: extraArgs sets {arg}: use tp / device, which also size the pod's GPU or "
                              "CPU requests")
    tp, device = _check_tp(where, cfg, m, gpus)
    _check_rollout(where, cfg["strategy"])
    startup = _int(f"{where}: startupTimeoutSeconds", cfg["startupTimeoutSeconds"], 10)
    for port in ("grpcPort", "kvPort", "metricsPort"):
        _int(f"{where}: {port}", cfg[port], 1)
    if len({cfg["grpcPort"], cfg["kvPort"], cfg["metricsPort"]}) != 3:
        raise ValuesError(f"{where}: grpcPort, kvPort and metricsPort must differ")
    fullname = f"{v['name']}-{role}-{model_label}"
    if len(fullname) > _MAX_NAME:
        raise ValuesError(f"{where}: object name {fullname!r} is longer than {_MAX_NAME} characters")
    resources = copy.deepcopy(cfg.get("resources") or {})
    extra = cfg.get("extraResources") or {}
    if not isinstance(extra, dict) or "nvidia.com/gpu" in extra:
        raise ValuesError(f"{where}: extraResources must map resource names to counts (GPUs go in `gpus`)")
    # Extended resources (GPUs, RDMA devices) cannot be overcommitted: request and limit must be equal.
    # A TP-N node drives N GPUs (one a rank); on CPU its N ranks take N times the pod's CPU.
    for kind in ("requests", "limits"):
        if device == "cuda":
            resources.setdefault(kind, {})["nvidia.com/gpu"] = tp if tp > 1 else gpus
        elif tp > 1 and (resources.get(kind) or {}).get("cpu") is not None:
            resources[kind]["cpu"] = _scale_cpu(f"{where}: resources.{kind}.cpu", resources[kind]["cpu"], tp)
        if extra:
            resources.setdefault(kind, {}).update(extra)
    extra_env = cfg.get("extraEnv") or []
    reserved = {"POD_NAME", "POD_IP", "POD_NAMESPACE", "PDSERVE_CLUSTER_TOKEN"}
    if not isinstance(extra_env, list) or any(not isinstance(e, dict) or e.get("name") in reserved for e in extra_env):
        raise ValuesError(f"{where}: extraEnv must be a list of {{name, value}} (or valueFrom) entries, none of "
                          f"{sorted(reserved)}")
    annotations = {**_scrape_annotations(cfg["metricsPort"]), **(cfg.get("podAnnotations") or {})}
    if annotations.get("prometheus.io/port") != str(cfg["metricsPort"]):
        raise ValuesError(f"{where}: podAnnotations must not move prometheus.io/port off metricsPort")
    security = deep_merge(v.get("containerSecurityContext") or {}, cfg.get("securityContext") or {})
    return {
        "role": role,
        "model": m["name"],
        "model_label": model_label,
        "fullname": fullname,
        "replicas": replicas,
        "cfg": cfg,
        "resources": resources,
        "args": _node_args(v, m, cfg, etcd),
        "labels": _labels(v, role, model_label),
        "selector": _selector(v, role, model_label),
        "annotations": annotations,
        "env": extra_env,
        "security_context": security,
        "affinity": _pool_affinity(v, where, cfg, model_label),
        "autoscaler": _autoscaler(v, where, role, cfg, m["name"]),
        "grpc_service": "pdserve.v1.PrefillNode" if role == "prefill" else "pdserve.v1.DecodeNode",
        "drain_timeout": drain,
        # The preStop drain and the exit after SIGTERM both count against this budget.
        "termination_grace": grace,
        "startup_failure_threshold": -(-startup // 10),
        "pdb": _check_pdb(f"{where}: pdb", cfg["pdb"], replicas),
    }


def _check_tp(where: str, cfg: dict[str, Any], m: dict[str, Any], gpus: int) -> tuple[int, str]:
    """The pool's TP width and device, checked: an integer in [1, 64]; on CUDA, `gpus` left at 1 or equal
    to it (a rank drives one device); no KV tier (its files hold every KV head: TP 1 only). `m`: the model."""
    tp = _int(f"{where}: tp", cfg.get("tp", 1), 1)
    if tp > 64:
        raise ValuesError(f"{where}: tp must be in [1, 64], got {tp}")
    device = cfg.get("device", "cuda")
    if device not in ("cuda", "cpu"):
        raise ValuesError(f"{where}: device must be cuda or cpu, got {device!r}")
    if tp == 1:
        return tp, device
    if device == "cuda" and gpus not in (1, tp):
        raise ValuesError(f"{where}: gpus {gpus} with tp {tp}: a TP-{tp} node drives {tp} GPUs, one a rank "
                          f"(leave gpus at 1, or set it to {tp})")
    if cfg.get("kvTierGiB"):
        raise ValuesError(f"{where}: kvTierGiB with tp {tp}: a KV tier runs at tp 1 only (its files hold every "
                          "KV head); set kvTierGiB: 0")
    # Every source the init containers fetch is float weights (a `gguf` source is dequantized to its dtype),
    # which is what TP splits; a `dir` or `none` source holding quantized weights is refused by the node.
    return tp, device


def _scale_cpu(where: str, quantity: Any, factor: int) -> str:
    """A CPU quantity ("4", 4, "500m", 0.5) times `factor`, as millicores or whole cores."""
    text = str(quantity).strip()
    try:
        milli = int(text[:-1]) if text.endswith("m") else round(float(text) * 1000)
    except ValueError:
        raise ValuesError(f"{where}: {quantity!r} is not a CPU quantity (e.g. 4 or 500m)") from None
    milli *= factor
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _autoscaler(v: dict[str, Any], where: str, role: str, cfg: dict[str, Any], model: str) -> dict[str, Any] | None:
    """The pool's scaling triggers for autoscaling.mode hpa|keda; None for none and for a pool of
    `replicas: 0` (a colocated plan: decode nodes prefill locally), which stays empty. Each trigger is a per-pod
    target over one series the nodes export (deploy/prometheus/README.md): a total across the pool's pods
    divided by the target gives the pod count (AverageValue)."""
    mode = v["autoscaling"]["mode"]
    if mode not in ("none", "hpa", "keda"):
        raise ValuesError(f"autoscaling.mode must be none, hpa or keda, got {mode!r}")
    if mode == "none" or cfg["replicas"] == 0:
        return None
    a = cfg.get("autoscaling") or {}
    lo = _int(f"{where}: autoscaling.minReplicas", a.get("minReplicas"), 1)
    hi = _int(f"{where}: autoscaling.maxReplicas", a.get("maxReplicas"), 1)
    if hi < lo:
        raise ValuesError(f"{where}: autoscaling.maxReplicas {hi} < minReplicas {lo}")
    labels = {"namespace": v["namespace"], "cluster": v["cluster"], "pool": role, "model": model}
    targets = [("pdserve_requests_waiting", "targetWaitingPerPod")] if role == "prefill" else \
        [("pdserve_kv_usage_ratio", "targetKVUsage"), ("pdserve_requests_running", "targetRunningPerPod")]
    triggers = []
    for metric, key in targets:
        target = a.get(key)
        if isinstance(target, bool) or not isinstance(target, (int, float)) or target <= 0:
            raise ValuesError(f"{where}: autoscaling.{key} must be a number > 0, got {target!r}")
        if key == "targetKVUsage" and target > 1:
            raise ValuesError(f"{where}: autoscaling.targetKVUsage is a fraction of the KV cache (<= 1), got {target}")
        matchers = ",".join(f'{k}="{val}"' for k, val in labels.items())
        triggers.append({"metric": metric, "target": str(target), "labels": labels,
                         "query": f"sum({metric}{{{matchers}}})"})
    return {"min": lo, "max": hi, "triggers": triggers}


def _pool_affinity(v: dict[str, Any], where: str, cfg: dict[str, Any], model_label: str) -> dict[str, Any]:
    """The pool's `affinity`, plus, with `zoneAffinity`, a pod-affinity term that keeps a model's prefill
    and decode pods in one zone (KV transfers then never cross zones). The first pod of a model matches
    its own term, which Kubernetes lets schedule anywhere; the rest follow it."""
    affinity = copy.deepcopy(cfg.get("affinity") or {})
    mode = cfg.get("zoneAffinity") or "none"
    if mode not in ("none", "preferred", "required"):
        raise ValuesError(f"{where}: zoneAffinity must be none, preferred or required, got {mode!r}")
    if mode == "none":
        return affinity
    term = {
        "topologyKey": "topology.kubernetes.io/zone",
        "labelSelector": {
            "matchLabels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": v["name"],
                            "pdserve.io/model": model_label},
            "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In", "values": list(ROLES)}],
        },
    }
    pod_affinity = affinity.setdefault("podAffinity", {})
    if mode == "required":
        pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    else:
        pod_affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
            {"weight": 100, "podAffinityTerm": term})
    return affinity


def build_context(v: dict[str, Any]) -> dict[str, Any]:
    """Checks the values and computes everything the templates use. Raises ValuesError."""
    name = _check_names(v)
    etcd = _etcd(v, name)
    served = _served_models(v)
    store = _response_store(v, name)
    frontend, models_yaml, tenants_yaml = _frontend(v, name, etcd["endpoints"], served, store)
    instance = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": name}
    mon = v["monitoring"]
    rules: dict[str, Any] = {}
    if mon["prometheusRule"].get("enabled"):
        rules = yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))
    pools = _pools(v, etcd["endpoints"])
    return {
        "v": v,
        "name": name,
        "ns": v["namespace"],
        "image": f"{v['image']['repository']}:{v['image']['tag']}",
        "etcd": etcd,
        "store": store,
        "pools": pools,
        "node_metrics_ports": [{"port": p} for p in sorted({p["cfg"]["metricsPort"] for p in pools})],
        "frontend": frontend,
        "tenants_on": bool(v["tenants"].get("enabled")),
        "tenants_cm": f"{name}-tenants",
        "models_cm": f"{name}-models",
        "tenants_yaml": tenants_yaml,
        "models_yaml": models_yaml,
        "config_dir": CONFIG_DIR,
        "model_volume": _model_storage(v),
        # The frontends read every model's tokenizer: they fill every model, once per model.
        "frontend_init": _unique([c for p in pools for c in p["init_containers"]]),
        "frontend_source_volumes": _unique([vol for p in pools for vol in p["source_volumes"]]),
        "instance_selector": instance,
        "monitors": _monitors(v),
        "grafana": _grafana(v, name),
        "rules": rules,
        "rule_labels": {**instance, "app.kubernetes.io/part-of": "pdserve", **(mon["prometheusRule"].get("labels") or {})},
    }


def _unique(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`items` without repeats (a model's prefill and decode pools share its init container), in order."""
    out: list[dict[str, Any]] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out


def _check_names(v: dict[str, Any]) -> str:
    """The deployment's name, once the names and the model list are usable."""
    name = _dns_label("name", v["name"], max_len=20)
    if name != v["name"]:
        raise ValuesError(f"name: {v['name']!r} must already be a DNS label (e.g. {name!r})")
    _dns_label("namespace", v["namespace"])
    if not v["cluster"] or "/" in str(v["cluster"]):
        raise ValuesError(f"cluster: {v['cluster']!r} must be non-empty and contain no '/'")
    if not v.get("models"):
        raise ValuesError("models: list at least one model")
    return name


def _etcd(v: dict[str, Any], name: str) -> dict[str, Any]:
    etcd_cfg = v["etcd"]
    members = _int("etcd.replicas", etcd_cfg["replicas"], 1)
    if members % 2 == 0:
        # An even member count tolerates no more failures than one fewer member, and splits votes.
        raise ValuesError(f"etcd.replicas must be odd, got {members}")
    if etcd_cfg["antiAffinity"] not in ("soft", "hard"):
        raise ValuesError(f"etcd.antiAffinity must be soft or hard, got {etcd_cfg['antiAffinity']!r}")
    etcd_svc = f"{name}-etcd"
    domain = f"{etcd_svc}.{v['namespace']}.svc.{v['clusterDomain']}"
    member_names = [f"{etcd_svc}-{i}" for i in range(members)]
    return {
        "svc": etcd_svc,
        "client_svc": f"{etcd_svc}-client",
        "replicas": members,
        "domain": domain,
        "endpoints": ",".join(f"{m}.{domain}:{etcd_cfg['clientPort']}" for m in member_names),
        "initial_cluster": ",".join(f"{m}=http://{m}.{domain}:{etcd_cfg['peerPort']}" for m in member_names),
        "labels": _labels(v, "etcd"),
        "selector": _selector(v, "etcd"),
        "annotations": _scrape_annotations(etcd_cfg["metricsPort"]),
        "pdb": _check_pdb("etcd.pdb", etcd_cfg["pdb"], members),
    }


def _served_models(v: dict[str, Any]) -> dict[str, str]:
    """Served name or alias -> model name; checks names are unique and fallbacks exist."""
    served: dict[str, str] = {}
    for i, m in enumerate(v["models"]):
        for key in ("name", "path"):
            if not isinstance(m.get(key), str) or not m[key]:
                raise ValuesError(f"models[{i}].{key} is required")
        for n in (m["name"], *(m.get("aliases") or [])):
            if n in served:
                raise ValuesError(f"models[{i}]: name {n!r} is already served by {served[n]!r}")
            served[n] = m["name"]
    for m in v["models"]:
        fb = m.get("fallback")
        if fb is not None and (fb not in served or served[fb] == m["name"]):
            raise ValuesError(f"models[{m['name']}].fallback: {fb!r} is not another served model")
    return served


def _frontend(v: dict[str, Any], name: str, etcd_endpoints: str, served: dict[str, str], store: dict[str, Any]
              ) -> tuple[dict[str, Any], str, str]:
    """(the frontend's template values, models.yaml, tenants.yaml)."""
    fe = v["frontend"]
    fe_replicas = _int("frontend.replicas", fe["replicas"], 1)
    hpa = fe.get("hpa") or {}
    if hpa.get("enabled"):
        lo = _int("frontend.hpa.minReplicas", hpa["minReplicas"], 1)
        if _int("frontend.hpa.maxReplicas", hpa["maxReplicas"], 1) < lo:
            raise ValuesError("frontend.hpa.maxReplicas must be >= minReplicas")
    sleep = _int("frontend.preStopSleepSeconds", fe["preStopSleepSeconds"], 0)
    # After SIGTERM the frontend finishes every stream in flight; the longest lasts requestTimeoutSeconds.
    need = sleep + _int("frontend.requestTimeoutSeconds", fe["requestTimeoutSeconds"], 1) + \
        _int("frontend.terminationMarginSeconds", fe["terminationMarginSeconds"], 5)
    grace = fe.get("terminationGracePeriodSeconds")
    if grace is None:
        grace = need
    elif _int("frontend.terminationGracePeriodSeconds", grace, 1) < need:
        raise ValuesError(f"frontend.terminationGracePeriodSeconds {grace} is shorter than preStopSleepSeconds + "
                          f"requestTimeoutSeconds + terminationMarginSeconds = {need}: streams in flight would be cut "
                          "(leave it null)")
    tenants_on = bool(v["tenants"].get("enabled"))
    models_yaml = _models_file(v)
    tenants_yaml = _tenants_file(v, set(served)) if tenants_on else ""
    limit_share = fe.get("limitShare") or (hpa["maxReplicas"] if hpa.get("enabled") else fe_replicas)
    fe_pairs: list[tuple[str, Any]] = [
        ("frontend-id", "$(POD_NAME)"), ("cluster", v["cluster"]), ("etcd", etcd_endpoints), ("host", "0.0.0.0"),
        ("port", fe["port"]), ("models", f"{CONFIG_DIR}/models.yaml"),
    ]
    if tenants_on:
        fe_pairs.append(("tenants", f"{CONFIG_DIR}/tenants.yaml"))
    for arg in fe.get("extraArgs") or []:
        if str(arg).split("=", 1)[0] in ("--response-store", "--response-ttl"):
            raise ValuesError(f"frontend.extraArgs sets {arg}: use responseStore.url / responseStore.ttlSeconds, "
                              "which every frontend replica shares")
    fe_pairs += [("response-store", store["url"]), ("response-ttl", store["ttl"])]
    for arg in fe.get("extraArgs") or []:
        if str(arg).split("=", 1)[0] in ("--max-file-bytes", "--tls-cert", "--tls-key"):
            raise ValuesError(f"frontend.extraArgs sets {arg}: use frontend.maxFileBytes, and frontend.ingress for "
                              "TLS (the Ingress terminates it with a Secret cert-manager can fill)")
    fe_pairs += [
        ("limit-share", limit_share), ("ttft-slo", fe["ttftSloSeconds"]), ("tpot-slo", fe["tpotSloSeconds"]),
        ("request-timeout", fe["requestTimeoutSeconds"]), ("log-level", fe["logLevel"]),
        ("max-file-bytes", _int("frontend.maxFileBytes", fe["maxFileBytes"], 1)),
    ]
    frontend = {
        "fullname": f"{name}-frontend",
        "replicas": fe_replicas,
        "termination_grace": grace,
        "hpa": bool(hpa.get("enabled")),
        "args": _flags(fe_pairs) + [str(a) for a in fe.get("extraArgs") or []],
        "labels": _labels(v, "frontend"),
        "selector": _selector(v, "frontend"),
        "annotations": {
            **_scrape_annotations(fe["port"]),
            # Rolls the frontends when the tenants or models file changes.
            "pdserve.io/config-checksum": hashlib.sha256((models_yaml + tenants_yaml).encode()).hexdigest(),
        },
        "pdb": _check_pdb("frontend.pdb", fe["pdb"], fe_replicas),
        "ingress": _ingress(fe, name),
    }
    return frontend, models_yaml, tenants_yaml


def _ingress(fe: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The Ingress that serves the API over HTTPS (None when off): its host, TLS Secret and annotations."""
    ing = fe.get("ingress") or {}
    if not ing.get("enabled"):
        return None
    host = str(ing.get("host") or "")
    if len(host) > 253 or not all(_DNS_LABEL.match(label) for label in host.split(".")):
        raise ValuesError(f"frontend.ingress.host {host!r} must be the API's DNS name (e.g. api.example.com): "
                          "the certificate is issued for it")
    secret = _dns_label("frontend.ingress.tlsSecretName", str(ing.get("tlsSecretName") or f"{name}-api-tls"), 253)
    annotations: dict[str, str] = {}
    if ing.get("className") == "nginx":
        timeout = str(fe["requestTimeoutSeconds"])
        annotations = {
            "nginx.ingress.kubernetes.io/proxy-buffering": "off",  # SSE: each event as it is written
            "nginx.ingress.kubernetes.io/proxy-read-timeout": timeout,
            "nginx.ingress.kubernetes.io/proxy-send-timeout": timeout,
            # Room for the multipart framing around the largest upload; the frontend enforces the limit.
            "nginx.ingress.kubernetes.io/proxy-body-size": f"{-(-int(fe['maxFileBytes']) // (1 << 20)) + 1}m",
            "nginx.ingress.kubernetes.io/ssl-redirect": "true",
        }
    cm = ing.get("certManager") or {}
    if cm.get("issuer"):
        kind = cm.get("kind", "ClusterIssuer")
        if kind not in ("ClusterIssuer", "Issuer"):
            raise ValuesError(f"frontend.ingress.certManager.kind must be ClusterIssuer or Issuer, got {kind!r}")
        key = "cluster-issuer" if kind == "ClusterIssuer" else "issuer"
        annotations[f"cert-manager.io/{key}"] = str(cm["issuer"])
    annotations.update({str(k): str(val) for k, val in (ing.get("annotations") or {}).items()})
    return {"host": host, "secret": secret, "class_name": ing.get("className") or None, "annotations": annotations}


def _response_store(v: dict[str, Any], name: str) -> dict[str, Any]:
    """The Responses API store every frontend shares: the in-cluster PostgreSQL StatefulSet's values, or
    an external server's URL. The frontends get the URL (`--response-store`, never with a password in it)
    and the password as PGPASSWORD from the Secret."""
    rs = v["responseStore"]
    pg = rs.get("postgres") or {}
    url = rs.get("url") or ""
    enabled = bool(pg.get("enabled"))
    ttl = _int("responseStore.ttlSeconds", rs["ttlSeconds"], 1)
    secret = rs.get("passwordSecret") or {}
    if enabled == bool(url):
        raise ValuesError("responseStore: give exactly one of postgres.enabled: true (the in-cluster server) and url "
                          "(an external PostgreSQL, with postgres.enabled: false); a per-pod SQLite file would hide each "
                          "frontend's stored responses from the others and lose them on restart")
    if secret.get("name"):
        _dns_label("responseStore.passwordSecret.name", secret["name"], max_len=253)
        if not secret.get("key"):
            raise ValuesError("responseStore.passwordSecret.key: name the Secret's key that holds the password")
    elif enabled:
        raise ValuesError("responseStore.passwordSecret.name: the in-cluster PostgreSQL needs a password Secret")
    password_ref = {"name": secret["name"], "key": secret["key"]} if secret.get("name") else None
    out: dict[str, Any] = {"postgres": enabled, "ttl": ttl, "password_ref": password_ref}
    if not enabled:
        out["url"] = _external_store_url(url)
        return out
    for key in ("user", "database"):
        if not isinstance(pg.get(key), str) or not _PG_NAME.match(pg[key]):
            raise ValuesError(f"responseStore.postgres.{key}: {pg.get(key)!r} must be a lowercase PostgreSQL name "
                              "([a-z_][a-z0-9_]*, at most 63 characters)")
    port = _int("responseStore.postgres.port", pg["port"], 1)
    image = str(pg.get("image") or "")
    tag = image.rsplit("/", 1)[-1].partition(":")[2]
    if "@sha256:" not in image and (not tag or tag == "latest" or not re.match(r"^\d+\.\d+", tag)):
        # A data directory starts only under the major version that initialized it.
        raise ValuesError(f"responseStore.postgres.image: {image!r} must pin a version (e.g. postgres:16.6) or a "
                          "digest; a floating tag can move the server to a major version its data does not start under")
    svc = f"{name}-postgres"
    host = f"{svc}.{v['namespace']}.svc.{v['clusterDomain']}"
    out.update({
        "url": f"postgresql://{pg['user']}@{host}:{port}/{pg['database']}",
        "svc": svc,
        "headless_svc": f"{svc}-headless",
        "port": port,
        "labels": _labels(v, "response-store"),
        "selector": _selector(v, "response-store"),
        "pod_security": deep_merge(v.get("podSecurityContext") or {}, pg.get("podSecurityContext") or {}),
        "security": deep_merge(v.get("containerSecurityContext") or {}, pg.get("securityContext") or {}),
    })
    return out


def _external_store_url(url: Any) -> str:
    """An external PostgreSQL URL without a password (that comes from the Secret, as PGPASSWORD)."""
    if not isinstance(url, str) or not re.match(r"^postgres(ql)?://[^/?#]", url):
        raise ValuesError(
            f"responseStore.url: {url!r} must be postgresql://USER@HOST:PORT/DATABASE (every frontend replica must "
            "reach the same store; an SQLite path is one pod's)")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as err:
        raise ValuesError(f"responseStore.url: {url!r} does not parse: {err}") from err
    query = urllib.parse.parse_qs(parts.query)
    if parts.password is not None or "password" in query:
        raise ValuesError("responseStore.url must not hold the password (the Deployment's args are readable by "
                          "anyone who can read the Deployment): put it in responseStore.passwordSecret")
    if not parts.hostname or not parts.path.strip("/"):
        raise ValuesError(f"responseStore.url: {url!r} must name a host and a database")
    return url


def _model_storage(v: dict[str, Any]) -> dict[str, Any]:
    """The model volume (writable: the init containers fill it; the main containers mount it read-only)."""
    storage = v["modelStorage"]
    kind = storage["type"]
    if kind == "emptyDir":
        return {"name": "models", "emptyDir": {"sizeLimit": storage["size"]}}
    if kind == "pvc":
        modes = storage.get("accessModes") or []
        if storage.get("create") and not set(modes) & {"ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"}:
            # The init containers write the weights: a claim nobody can write stays empty forever.
            raise ValuesError(f"modelStorage.accessModes {modes}: the init containers must write the weights; "
                              "use ReadWriteMany (pods on several machines) or ReadWriteOnce")
        return {"name": "models", "persistentVolumeClaim": {"claimName": storage["claimName"]}}
    if kind == "hostPath":
        return {"name": "models", "hostPath": {"path": storage["hostPath"], "type": "DirectoryOrCreate"}}
    raise ValuesError(f"modelStorage.type must be emptyDir, pvc or hostPath, got {kind!r}")


def _model_source(v: dict[str, Any], m: dict[str, Any], label: str) -> dict[str, Any] | None:
    """The init container (and its source volume) that fills model `m` on the model volume; None for
    `source.type: none`."""
    where = f"models[{m['name']}].source"
    src = m.get("source") or {"type": "none"}
    kind = src.get("type")
    known = {"default": {"type"}, "gguf": {"type", "uri", "sha256", "dtype", "volume"},
             "dir": {"type", "uri", "sha256", "volume"}, "none": {"type"}}
    if kind not in known:
        raise ValuesError(f"{where}.type must be one of {sorted(known)}, got {kind!r}")
    if kind == "none":
        return None
    unknown = sorted(set(src) - known[kind])
    if unknown:
        raise ValuesError(f"{where}: unknown keys {unknown} for type {kind}")
    mount = v["modelStorage"]["mountPath"].rstrip("/")
    args = [f"--source={kind}", f"--dest={mount}/{m['path']}"]
    volume = src.get("volume")
    src_volume = None
    src_mount = f"{SOURCE_MOUNT}/{label}"
    if volume is not None:
        if not isinstance(volume, dict) or len(volume) != 1:
            raise ValuesError(f"{where}.volume must be one Kubernetes volume source, e.g. "
                              "{persistentVolumeClaim: {claimName: hf-weights}}")
        src_volume = {"name": f"src-{label}"[:63], **volume}
    if kind in ("gguf", "dir"):
        uri = src.get("uri")
        if not isinstance(uri, str) or not uri:
            raise ValuesError(f"{where}.uri is required for type {kind}")
        is_url = re.match(r"^https?://", uri) is not None
        if kind == "dir" and src_volume is None:
            raise ValuesError(f"{where}.volume is required for type dir (the volume holding the directory)")
        if is_url and src_volume is not None:
            raise ValuesError(f"{where}: a URL source takes no volume")
        location = uri if is_url or src_volume is None else f"{src_mount}/{uri.lstrip('/')}".rstrip("/")
        args.append(f"--from={location}")
    if kind == "gguf":
        digest = src.get("sha256")
        if not isinstance(digest, str) or not _SHA256_HEX.match(digest):
            raise ValuesError(f"{where}.sha256: give the GGUF file's sha256 (64 lowercase hex digits), "
                              "e.g. from `sha256sum FILE.gguf` or the publisher's page")
        dtype = src.get("dtype", "float32")
        if dtype not in ("float32", "bfloat16"):
            raise ValuesError(f"{where}.dtype must be float32 or bfloat16, got {dtype!r}")
        args += [f"--sha256={digest}", f"--dtype={dtype}"]
    if kind == "dir":
        digests = src.get("sha256") or {}
        if not isinstance(digests, dict):
            raise ValuesError(f"{where}.sha256 must map file names to sha256 digests")
        for name, digest in digests.items():
            if not isinstance(digest, str) or not _SHA256_HEX.match(digest):
                raise ValuesError(f"{where}.sha256[{name}]: {digest!r} is not a sha256 hex digest")
            args.append(f"--sha256={name}={digest}")
    fetch = v["modelStorage"].get("fetch") or {}
    container: dict[str, Any] = {
        "name": f"fetch-{label}"[:63],
        "image": f"{v['image']['repository']}:{v['image']['tag']}",
        "imagePullPolicy": v["image"]["pullPolicy"],
        "command": ["pdserve", "model", "fetch"],
        "args": args,
        "resources": fetch.get("resources") or {},
        "volumeMounts": [{"name": "models", "mountPath": v["modelStorage"]["mountPath"]}],
    }
    if fetch.get("extraEnv"):
        container["env"] = list(fetch["extraEnv"])
    if src_volume is not None:
        container["volumeMounts"].append({"name": src_volume["name"], "mountPath": src_mount, "readOnly": True})
    if v.get("containerSecurityContext"):
        container["securityContext"] = v["containerSecurityContext"]
    return {"container": container, "volume": src_volume}


def _grafana(v: dict[str, Any], name: str) -> dict[str, Any]:
    """The dashboards (file name -> JSON text, verbatim) and the provider file for Grafana provisioning."""
    g = v["monitoring"].get("grafana") or {}
    if not g.get("enabled"):
        return {}
    dashboards = {p.name: p.read_text(encoding="utf-8") for p in sorted(DASHBOARDS_DIR.glob("*.json"))}
    provider = {"apiVersion": 1, "providers": [{
        "name": f"{name}-pdserve", "folder": g["folder"], "type": "file", "disableDeletion": True,
        "allowUiUpdates": False, "updateIntervalSeconds": 60, "options": {"path": g["path"]},
    }]}
    return {
        "namespace": g.get("namespace") or v["namespace"],
        "dashboards": dashboards,
        "provider": yaml.safe_dump(provider, sort_keys=False),
        "labels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": name,
                   "app.kubernetes.io/part-of": "pdserve", **(g.get("labels") or {})},
        # The sidecar reads this folder annotation (kube-prometheus-stack's folderAnnotation setting).
        "annotations": {"grafana_folder": g["folder"]},
    }


def _monitors(v: dict[str, Any]) -> list[dict[str, Any]]:
    labels = v["monitoring"]["serviceMonitor"].get("labels") or {}
    return [
        {
            "component": component,
            "port": port,  # a port name of the component's Services
            "selector": _selector(v, component),
            "labels": {**_labels(v, component), **labels},
        }
        for component, port in (("frontend", "http"), ("prefill", "metrics"), ("decode", "metrics"), ("etcd", "metrics"))
    ]
