"""The Kubernetes manifests (deploy/k8s) and the Prometheus config and rules (deploy/prometheus).

Manifests are rendered with deploy/k8s/render.py for several value sets and checked two ways:
- every built-in object against the Kubernetes OpenAPI schemas, offline, with `kubernetes-validate`
  (it bundles the schemas; strict mode rejects unknown fields), for the oldest version the manifests
  support (1.27: gRPC probes are GA there) and the newest it knows;
- structurally: what the schemas cannot say (etcd quorum wiring, pool sizes, GPU requests, probes, the
  drain hook agreeing with the node's drain timeout and the grace period, rollouts that keep capacity,
  init containers whose `pdserve model fetch` command lines the real parser accepts, transport knobs,
  autoscaling triggers on catalogued series, scrape annotations, selectors that select, ConfigMaps that
  exist, the frontends' response store URL and password agreeing with the PostgreSQL StatefulSet, whose
  probe and preStop commands run against a real PostgreSQL set up as the image sets itself up). The CRD objects (ServiceMonitor, PrometheusRule, KEDA ScaledObject) have no bundled schema and
  get structural checks only.

The Prometheus files are checked with `promtool` (Debian package `prometheus`, installed here when
missing and running as root), including unit tests of the recording rules and of every alert, firing and
quiet.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import secrets
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.deploy.k8s import render as k8s
from testing.debian import require_package

ROOT = Path(__file__).resolve().parents[1]
PROM_DIR = ROOT / "deploy" / "prometheus"
EXAMPLE = ROOT / "deploy" / "k8s" / "examples" / "multi-model.yaml"
RDMA = ROOT / "deploy" / "k8s" / "examples" / "rdma.yaml"
MIN_K8S = "1.27"
CRD_GROUPS = ("monitoring.coreos.com/", "keda.sh/")
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
# A key made as values.yaml says (never written down, so its digest is not a published one).
TENANT_KEY = "sk-" + secrets.token_urlsafe(32)
TENANT_SETS = (
    "tenants.enabled=true",
    f"tenants.items=[{{name: acme, keys_sha256: [{hashlib.sha256(TENANT_KEY.encode()).hexdigest()}], models: ['*'], "
    "requests_per_minute: 600}]",
)
STORE = "pdserve-postgres"  # the response store's StatefulSet, Service and NetworkPolicy
EXTERNAL_URL = "postgresql://responses@db.example.internal:6432/pdserve_responses?sslmode=require"
EXTERNAL_STORE = ("responseStore.postgres.enabled=false", f"responseStore.url={EXTERNAL_URL}")
ALL_FEATURES = [
    "monitoring.grafana.enabled=true",
    "monitoring.serviceMonitor.enabled=true",
    "monitoring.prometheusRule.enabled=true",
    "networkPolicy.enabled=true",
    "frontend.hpa.enabled=true",
    "frontend.ingress.enabled=true",
    "frontend.ingress.host=api.example.com",
    "frontend.ingress.certManager.issuer=letsencrypt-prod",
    "prefill.kvTierGiB=8",
    "decode.kvTierGiB=20",
]


def _render(*sets: str, files: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    return k8s.render_objects(k8s.load_values(list(files), list(sets)))


def _by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def _one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _pools(objs: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    return [o for o in _by_kind(objs, "Deployment")
            if o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == role]


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name} appears {len(values)} times in {args}"
    return values[0]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------------------------- schemas


@pytest.fixture(scope="module")
def kubernetes_validate() -> Any:
    return pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")


# Tensor parallelism: TP 2 prefill and TP 4 decode pools on GPUs, and a second model's TP 2 pools on CPU.
TP_SETS = ("prefill.tp=2", "decode.tp=4", "decode.gpus=4", "prefill.resources.limits.cpu=8",
           "decode.resources.limits.cpu=8")


@pytest.mark.parametrize("case", ["defaults", "all-features", "multi-model-example", "model-sources", "rdma-example",
                                  "autoscaling-hpa", "external-response-store", "tensor-parallel"])
def test_manifests_validate_against_kubernetes_schemas(case: str, kubernetes_validate: Any) -> None:
    if case == "defaults":
        objs = _render()
    elif case == "autoscaling-hpa":
        objs = _render("autoscaling.mode=hpa", files=(EXAMPLE,))
        assert len(_by_kind(objs, "HorizontalPodAutoscaler")) == 5  # 2 models x 2 pools + the frontends
    elif case == "rdma-example":
        objs = _render(*ALL_FEATURES, files=(RDMA,))
    elif case == "model-sources":
        values = k8s.load_values(sets=["modelStorage.type=pvc", *TENANT_SETS[:1]])
        values["models"] = SOURCES
        values["tenants"]["items"] = [{"name": "t", "keys_sha256": [hashlib.sha256(TENANT_KEY.encode()).hexdigest()]}]
        objs = k8s.render_objects(values)
    elif case == "all-features":
        objs = _render(*ALL_FEATURES, "prefill.replicas=3", "decode.replicas=5", "tenants.enabled=false",
                       "responseStore.postgres.storage.storageClassName=fast-ssd",
                       "responseStore.postgres.nodeSelector={pdserve.io/storage: 'true'}",
                       "responseStore.postgres.tolerations=[{key: storage, operator: Exists, effect: NoSchedule}]",
                       "podSecurityContext={runAsNonRoot: true}", "containerSecurityContext={allowPrivilegeEscalation: false}")
        assert _one(objs, "StatefulSet", STORE)["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "fast-ssd"
    elif case == "tensor-parallel":
        values = k8s.load_values([EXAMPLE], [*TP_SETS, "autoscaling.mode=hpa"])
        values["models"][1]["prefill"] = {"device": "cpu", "tp": 2}
        values["models"][1]["decode"] = {"device": "cpu", "tp": 2, "gpus": 1}
        objs = k8s.render_objects(values)
        assert {_flag(_container(d)["args"], "tensor-parallel-size") for d in _by_kind(objs, "Deployment")
                if "tensor-parallel-size" in str(_container(d)["args"])} == {"2", "4"}
    elif case == "external-response-store":
        objs = _render(*ALL_FEATURES, *EXTERNAL_STORE)
        assert not [o for o in objs if o["metadata"]["name"].startswith(STORE)]
    else:
        objs = _render(files=(EXAMPLE,))
    checked, errors = 0, []
    for version in (MIN_K8S, kubernetes_validate.latest_version()):
        for obj in objs:
            if obj["apiVersion"].startswith(CRD_GROUPS):
                continue  # CRDs: no bundled schema; see test_monitoring_objects and test_autoscaling_keda
            try:
                kubernetes_validate.validate(obj, version, strict=True)
                checked += 1
            except kubernetes_validate.ValidationError as err:
                path = ".".join(str(p) for p in err.path)
                errors.append(f"{version} {obj['kind']}/{obj['metadata']['name']} {path}: {err.message[:300]}")
    assert not errors, "\n".join(errors)
    kinds = {o["kind"] for o in objs}
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    assert checked == 2 * sum(1 for o in objs if not o["apiVersion"].startswith(CRD_GROUPS))


# ---------------------------------------------------------------------------------------- structure


@pytest.fixture(scope="module")
def default_objs() -> list[dict[str, Any]]:
    return _render()


def test_every_object_is_namespaced_and_labelled(default_objs: list[dict[str, Any]]) -> None:
    ns = _one(default_objs, "Namespace", "pdserve")
    assert ns is default_objs[0], "the Namespace must come first so that kubectl apply can create the rest"
    for obj in default_objs[1:]:
        meta = obj["metadata"]
        assert meta["namespace"] == "pdserve", f"{obj['kind']}/{meta['name']}"
        assert meta["labels"]["app.kubernetes.io/name"] == "pdserve", f"{obj['kind']}/{meta['name']}"
    names = [(o["kind"], o["metadata"]["name"]) for o in default_objs]
    assert len(names) == len(set(names)), "duplicate objects"


def test_etcd_is_a_three_member_statefulset_with_a_pdb(default_objs: list[dict[str, Any]]) -> None:
    sts = _one(default_objs, "StatefulSet", "pdserve-etcd")
    spec = sts["spec"]
    assert spec["replicas"] == 3
    assert spec["podManagementPolicy"] == "Parallel"  # OrderedReady would deadlock the bootstrap
    headless = _one(default_objs, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert _selects(headless["spec"]["selector"], spec["template"]["metadata"]["labels"])

    args = _container(sts)["args"]
    initial = next(a for a in args if a.startswith("--initial-cluster=")).split("=", 1)[1]
    members = dict(item.split("=", 1) for item in initial.split(","))
    domain = "pdserve-etcd.pdserve.svc.cluster.local"
    assert members == {f"pdserve-etcd-{i}": f"http://pdserve-etcd-{i}.{domain}:2380" for i in range(3)}
    # Each member announces itself under the name the others know it by.
    assert f"--initial-advertise-peer-urls=http://$(POD_NAME).{domain}:2380" in args
    assert "--name=$(POD_NAME)" in args
    assert spec["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert {"name": "data", "mountPath": "/var/lib/etcd"} in _container(sts)["volumeMounts"]

    pdb = _one(default_objs, "PodDisruptionBudget", "pdserve-etcd")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert _selects(pdb["spec"]["selector"]["matchLabels"], spec["template"]["metadata"]["labels"])

    # Every pdserve process is pointed at all three members.
    endpoints = {f"pdserve-etcd-{i}.{domain}:2379" for i in range(3)}
    for dep in _by_kind(default_objs, "Deployment"):
        assert set(_flag(_container(dep)["args"], "etcd").split(",")) == endpoints


@pytest.mark.parametrize(("prefill", "decode"), [(1, 1), (3, 5), (0, 2)])
def test_pool_sizes_are_parameters(prefill: int, decode: int) -> None:
    objs = _render(f"prefill.replicas={prefill}", f"decode.replicas={decode}")
    assert [d["spec"]["replicas"] for d in _pools(objs, "prefill")] == [prefill]
    assert [d["spec"]["replicas"] for d in _pools(objs, "decode")] == [decode]


def test_per_model_pools_and_overrides() -> None:
    objs = _render(files=(EXAMPLE,))
    sizes = {(d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"],
              _flag(_container(d)["args"], "model-name")): d["spec"]["replicas"]
             for d in _by_kind(objs, "Deployment") if "frontend" not in d["metadata"]["name"]}
    assert sizes == {
        ("prefill", "qwen2.5-32b-instruct"): 2, ("decode", "qwen2.5-32b-instruct"): 6,
        ("prefill", "qwen2.5-7b-instruct"): 1, ("decode", "qwen2.5-7b-instruct"): 2,
    }
    big_decode = _one(objs, "Deployment", "pdserve-decode-qwen2-5-32b-instruct")
    assert _flag(_container(big_decode)["args"], "kv-cache-memory-mib") == "49152"
    # The override of the drain timeout reaches both the hook and the grace period.
    assert _container(big_decode)["lifecycle"]["preStop"]["exec"]["command"][-1] == "600"
    assert big_decode["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 600


@pytest.fixture(scope="module")
def gpu_objs() -> list[dict[str, Any]]:
    """The manifests with GPUs asked for: one per prefill pod, two per decode pod."""
    return _render("prefill.gpus=1", "decode.gpus=2")


def _node_pod(objs: list[dict[str, Any]], role: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The role's one Deployment, its pod spec and its container."""
    (dep,) = _pools(objs, role)
    return dep, dep["spec"]["template"]["spec"], _container(dep)


def _grpc_port(c: dict[str, Any]) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_pods_request_their_gpus(gpu_objs: list[dict[str, Any]], role: str) -> None:
    gpus = {"prefill": 1, "decode": 2}[role]
    _, _, c = _node_pod(gpu_objs, role)
    assert c["command"] == ["pdserve", role]
    # Extended resources: the request must equal the limit.
    assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus == c["resources"]["limits"]["nvidia.com/gpu"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_pods_probe_their_grpc_port(gpu_objs: list[dict[str, Any]], role: str) -> None:
    _, _, c = _node_pod(gpu_objs, role)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert set(ports) == {"grpc", "kv", "metrics"}
    grpc_port = ports["grpc"]
    assert _flag(c["args"], "grpc-port") == str(grpc_port)
    assert _flag(c["args"], "kv-port") == str(ports["kv"])
    assert _flag(c["args"], "metrics-port") == str(ports["metrics"])
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[kind]["grpc"]["port"] == grpc_port, kind
    # Liveness asks about the process, readiness about the node's service (which stops while draining).
    assert "service" not in c["livenessProbe"]["grpc"]
    assert c["readinessProbe"]["grpc"]["service"] == f"pdserve.v1.{role.capitalize()}Node"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 900


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_pods_drain_before_they_stop(gpu_objs: list[dict[str, Any]], role: str) -> None:
    _, pod, c = _node_pod(gpu_objs, role)
    drain = c["lifecycle"]["preStop"]["exec"]["command"]
    assert drain[:2] == ["pdserve", "drain"]
    assert drain[drain.index("--grpc") + 1] == f"127.0.0.1:{_grpc_port(c)}"
    timeout = int(drain[drain.index("--timeout") + 1])
    assert timeout == {"prefill": 60, "decode": 300}[role]
    assert pod["terminationGracePeriodSeconds"] > timeout


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_pods_learn_identity_and_addresses_from_the_downward_api(gpu_objs: list[dict[str, Any]],
                                                                     role: str) -> None:
    _, _, c = _node_pod(gpu_objs, role)
    env = {e["name"]: e["valueFrom"] for e in c["env"]}
    assert env["POD_NAME"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["fieldRef"]["fieldPath"] == "status.podIP"
    # The cluster token every internal call carries (and the preStop drain presents) comes from a Secret.
    assert env["PDSERVE_CLUSTER_TOKEN"] == {"secretKeyRef": {"name": "pdserve-cluster-token", "key": "token"}}
    assert _flag(c["args"], "node-id") == "$(POD_NAME)"
    assert _flag(c["args"], "advertise-host") == "$(POD_IP)"
    assert _flag(c["args"], "kv-host") == "$(POD_IP)"
    assert _flag(c["args"], "model") == "/models/SmolLM2-135M-Instruct"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True and mounts["dshm"]["mountPath"] == "/dev/shm"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_pods_spread_over_hosts_and_have_a_pdb(gpu_objs: list[dict[str, Any]], role: str) -> None:
    dep, pod, _ = _node_pod(gpu_objs, role)
    spread = pod["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert _selects(spread["labelSelector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"])
    pdb = _one(gpu_objs, "PodDisruptionBudget", dep["metadata"]["name"])
    assert pdb["spec"]["maxUnavailable"] == 1
    assert _selects(pdb["spec"]["selector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"])


GGUF_DIGEST = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCES = [
    {"name": "from-url", "path": "a", "source": {"type": "gguf", "uri": "https://example.org/a.gguf", "sha256": GGUF_DIGEST}},
    {"name": "from-pvc-gguf", "path": "b", "source": {"type": "gguf", "uri": "ggufs/b.gguf", "sha256": GGUF_DIGEST,
                                                     "dtype": "bfloat16",
                                                     "volume": {"persistentVolumeClaim": {"claimName": "ggufs"}}}},
    {"name": "from-hf-dir", "path": "c", "source": {"type": "dir", "uri": "Qwen2.5-7B-Instruct",
                                                   "volume": {"persistentVolumeClaim": {"claimName": "hf"}},
                                                   "sha256": {"config.json": GGUF_DIGEST}}},
    {"name": "prefilled", "path": "d", "source": {"type": "none"}},
]


def _fetch_args(init: dict[str, Any]) -> Any:
    """An init container's command line, parsed by the real `pdserve` parser."""
    from pdserve.deploy.cli import build_parser

    assert init["command"] == ["pdserve", "model", "fetch"]
    return build_parser().parse_args(["model", "fetch", *init["args"]])


def test_defaults_fetch_the_default_model_into_a_per_pod_volume(default_objs: list[dict[str, Any]]) -> None:
    deployments = _by_kind(default_objs, "Deployment")
    assert len(deployments) == 3 and not _by_kind(default_objs, "PersistentVolumeClaim")
    for dep in deployments:
        pod = dep["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        args = _fetch_args(init)
        assert args.source == "default" and args.dest == "/models/SmolLM2-135M-Instruct"
        assert init["image"] == _container(dep)["image"]
        # The init container writes the volume; the server only reads it.
        assert init["volumeMounts"] == [{"name": "models", "mountPath": "/models"}]
        main = {m["name"]: m for m in _container(dep)["volumeMounts"]}["models"]
        assert main["readOnly"] is True and main["mountPath"] == "/models"
        volume = {v["name"]: v for v in pod["volumes"]}["models"]
        assert volume == {"name": "models", "emptyDir": {"sizeLimit": "20Gi"}}
        if "frontend" not in dep["metadata"]["name"]:
            assert _flag(_container(dep)["args"], "model") == args.dest
            assert _flag(_container(dep)["args"], "model-name") == "SmolLM2-135M-Instruct"
    models = yaml.safe_load(_one(default_objs, "ConfigMap", "pdserve-models")["data"]["models.yaml"])["models"]
    assert [(m["name"], m["path"]) for m in models] == [("SmolLM2-135M-Instruct", "/models/SmolLM2-135M-Instruct")]


def test_model_sources_render_verified_fetches() -> None:
    values = k8s.load_values(sets=["modelStorage.type=pvc"])
    values["models"] = SOURCES
    objs = k8s.render_objects(values)
    (pvc,) = _by_kind(objs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    expected = {
        "from-url": ("gguf", "https://example.org/a.gguf", [GGUF_DIGEST], None),
        "from-pvc-gguf": ("gguf", "/model-source/from-pvc-gguf/ggufs/b.gguf", [GGUF_DIGEST], "ggufs"),
        "from-hf-dir": ("dir", "/model-source/from-hf-dir/Qwen2.5-7B-Instruct", [f"config.json={GGUF_DIGEST}"], "hf"),
    }
    for dep in _by_kind(objs, "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "pdserve-models"}
        inits = {init["name"]: init for init in pod.get("initContainers", [])}
        if "frontend" in dep["metadata"]["name"]:
            assert set(inits) == {f"fetch-{m}" for m in expected}  # every tokenizer, once
        else:
            model = dep["spec"]["template"]["metadata"]["labels"]["pdserve.io/model"]
            assert set(inits) == ({f"fetch-{model}"} if model in expected else set())
        for name, init in inits.items():
            source, location, digests, claim = expected[name.removeprefix("fetch-")]
            args = _fetch_args(init)
            assert (args.source, args.location, args.sha256) == (source, location, digests)
            if claim is None:
                continue
            (mount,) = [m for m in init["volumeMounts"] if m["name"] != "models"]
            assert mount["readOnly"] is True and location.startswith(mount["mountPath"] + "/")
            assert volumes[mount["name"]]["persistentVolumeClaim"] == {"claimName": claim}
        if "fetch-from-pvc-gguf" in inits:
            assert _fetch_args(inits["fetch-from-pvc-gguf"]).dtype == "bfloat16"


def test_model_prices_reach_the_models_file_and_bad_ones_are_refused() -> None:
    """`models[].prices` lands in the frontend's models file as the frontend reads it; a price the frontend
    would refuse at start-up is refused at render time, naming the model and the field."""
    from pdserve.frontend.config import read_prices
    from pdserve.frontend.pricing import Prices

    values = k8s.load_values()
    values["models"][0]["prices"] = {"input": 0.15, "cached_input": 0.075, "output": 0.6, "batch_discount": 0.5}
    objs = k8s.render_objects(values)
    [entry] = yaml.safe_load(_one(objs, "ConfigMap", "pdserve-models")["data"]["models.yaml"])["models"]
    assert read_prices(entry["prices"], entry["name"]) == Prices(0.15, 0.075, 0.6, 0.5)
    assert "prices" not in yaml.safe_load(_one(k8s.render_objects(k8s.load_values()), "ConfigMap", "pdserve-models")
                                          ["data"]["models.yaml"])["models"][0]
    for bad, message in (({"output": -1}, "output must be a finite number >= 0"),
                         ({"batch_discount": 1.0}, r"batch_discount must be a number in \[0, 1\)"),
                         ({"inputs": 1}, r"unknown field\(s\) \['inputs'\]")):
        values["models"][0]["prices"] = bad
        with pytest.raises(k8s.ValuesError, match=f"models\\[SmolLM2-135M-Instruct\\]: model 'SmolLM2-135M-Instruct': "
                           f"prices: {message}"):
            k8s.render(values)


@pytest.mark.parametrize(("source", "sets", "message"), [
    pytest.param({"type": "gguf", "uri": "https://x/a.gguf"}, (), "sha256", id="gguf-no-digest"),
    pytest.param({"type": "dir", "uri": "m"}, (), "volume is required", id="dir-no-volume"),
    pytest.param({"type": "hf"}, (), "type must be one of", id="unknown-type"),
    pytest.param({"type": "default"}, ("modelStorage.type=pvc", "modelStorage.accessModes=[ReadOnlyMany]"),
                 "must write the weights", id="read-only-claim"),
])
def test_bad_model_sources_are_refused(source: dict[str, Any], sets: tuple[str, ...], message: str) -> None:
    values = k8s.load_values(sets=list(sets))
    values["models"][0]["source"] = source
    with pytest.raises(k8s.ValuesError, match=message):
        k8s.render(values)


@pytest.mark.parametrize("case", ["defaults", "multi-model-example", "overrides"])
def test_drain_hook_node_flag_and_grace_period_agree_for_every_pool(case: str) -> None:
    if case == "defaults":
        objs = _render()
    elif case == "multi-model-example":
        objs = _render(files=(EXAMPLE,))
    else:
        objs = _render("decode.drainTimeoutSeconds=900", "decode.drainGraceSeconds=120", "prefill.terminationMarginSeconds=45",
                       "frontend.requestTimeoutSeconds=1800", "prefill.strategy.rollingUpdate={maxSurge: '50%', maxUnavailable: 0}")
    values = k8s.load_values(files=[EXAMPLE] if case == "multi-model-example" else [])
    pools = [d for d in _by_kind(objs, "Deployment") if "frontend" not in d["metadata"]["name"]]
    assert pools
    for dep in pools:
        name, c = dep["metadata"]["name"], _container(dep)
        role = dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        hook = c["lifecycle"]["preStop"]["exec"]["command"]
        hook_timeout = int(hook[hook.index("--timeout") + 1])
        node_timeout = int(_flag(c["args"], "drain-timeout"))
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        # One number: the node gives up when the hook does, and Kubernetes waits for both plus the exit.
        assert hook_timeout == node_timeout, name
        assert grace >= node_timeout + 5, name
        if role == "decode":
            assert float(_flag(c["args"], "drain-grace")) < node_timeout, name
        # Rollouts keep capacity: surge first, never take a serving pod away.
        rolling = dep["spec"]["strategy"]["rollingUpdate"]
        assert dep["spec"]["strategy"]["type"] == "RollingUpdate" and rolling["maxUnavailable"] in (0, "0%"), name
        if (case, role) == ("overrides", "prefill"):
            assert rolling["maxSurge"] == "50%"
        else:
            assert rolling["maxSurge"] >= 1, name
    if case == "overrides":
        (decode,) = _pools(objs, "decode")
        assert _flag(_container(decode)["args"], "drain-timeout") == "900"
        assert decode["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 930
        (prefill,) = _pools(objs, "prefill")
        assert prefill["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60 + 45
    fe = _one(objs, "Deployment", "pdserve-frontend")
    c = _container(fe)
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    longest = float(_flag(c["args"], "request-timeout"))
    assert longest == (1800 if case == "overrides" else values["frontend"]["requestTimeoutSeconds"])
    assert fe["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= sleep + longest
    assert fe["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_node_command_lines_parse_into_the_drain_the_hook_waits_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendered node arguments through the nodes' own parsers (a cached tiny model stands in for the
    weights, which the parsers check exist): the drain timeout, drain grace and KV interface they end up
    with are the values' and the preStop hook's."""
    from pdserve.decode_node.config import DecodeNodeConfig
    from pdserve.engine.tiny import default_model_dir
    from pdserve.prefill_node.config import PrefillNodeConfig

    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", secrets.token_hex(16))  # what the Secret provides
    model = default_model_dir("llama")
    values = k8s.load_values([RDMA], [f"modelStorage.mountPath={model.parent}", "decode.drainTimeoutSeconds=420"])
    values["models"][0]["path"] = model.name
    parsers = {"prefill": PrefillNodeConfig.from_argv, "decode": DecodeNodeConfig.from_argv}
    for dep in [d for d in _by_kind(k8s.render_objects(values), "Deployment") if "frontend" not in d["metadata"]["name"]]:
        c = _container(dep)
        role = c["command"][1]
        config, _ = parsers[role](c["args"])
        hook = c["lifecycle"]["preStop"]["exec"]["command"]
        assert config.drain_timeout_s == float(hook[hook.index("--timeout") + 1]) == values[role]["drainTimeoutSeconds"]
        assert config.kv_interface == "net1" and config.model_name == "llama-3.1-8b-instruct"
        if role == "decode":
            assert config.drain_timeout_s == 420 and config.drain_grace_s == values["decode"]["drainGraceSeconds"]


def test_a_kv_tier_is_a_flag_and_an_emptydir_of_its_pool_when_set() -> None:
    for dep in _pools(_render(), "prefill") + _pools(_render(), "decode"):
        assert not any(a.startswith("--kv-tier") for a in _container(dep)["args"])
    objs = _render("decode.kvTierGiB=20")
    (prefill,), (decode,) = _pools(objs, "prefill"), _pools(objs, "decode")
    assert not any(a.startswith("--kv-tier") for a in _container(prefill)["args"])
    args = _container(decode)["args"]
    assert _flag(args, "kv-tier-dir") == "/var/lib/pdserve/kv-tier" and _flag(args, "kv-tier-gib") == "20"
    mounts = {m["name"]: m["mountPath"] for m in _container(decode)["volumeMounts"]}
    volumes = {v["name"]: v for v in decode["spec"]["template"]["spec"]["volumes"]}
    assert mounts["kv-tier"] == "/var/lib/pdserve/kv-tier" and volumes["kv-tier"]["emptyDir"] == {"sizeLimit": "22Gi"}


def test_transport_knobs_reach_every_node_pod_when_set() -> None:
    plain = _render()
    for dep in _pools(plain, "prefill") + _pools(plain, "decode"):
        pod = dep["spec"]["template"]["spec"]
        assert "affinity" not in pod and "securityContext" not in _container(dep)
        assert not any(a.startswith("--kv-interface=") for a in _container(dep)["args"])
    objs = _render(files=(RDMA,))
    values = k8s.load_values([RDMA])
    pools = _pools(objs, "prefill") + _pools(objs, "decode")
    assert len(pools) == 2
    for dep in pools:
        name, c = dep["metadata"]["name"], _container(dep)
        template = dep["spec"]["template"]
        pod = template["spec"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["NCCL_IB_HCA"] == "mlx5" and env["NCCL_SOCKET_IFNAME"] == "net1", name
        assert {"POD_NAME", "POD_IP", "PDSERVE_CLUSTER_TOKEN"} <= set(env)  # the knobs add, never replace
        assert _flag(c["args"], "kv-interface") == "net1"
        # Multus attaches the secondary network; the scrape annotations stay.
        ann = template["metadata"]["annotations"]
        assert ann["k8s.v1.cni.cncf.io/networks"] == "rdma-net" and ann["prometheus.io/scrape"] == "true"
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        for kind in ("requests", "limits"):
            assert c["resources"][kind]["rdma/hca"] == 1 and c["resources"][kind]["nvidia.com/gpu"] == 1, name
        # A model's prefill and decode pods share a zone.
        (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "topology.kubernetes.io/zone"
        same_model = [d for d in pools if _selects(term["labelSelector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])]
        assert same_model == pools
        (expr,) = term["labelSelector"]["matchExpressions"]
        assert expr["operator"] == "In" and set(expr["values"]) == {"prefill", "decode"}
        shm = {vol["name"]: vol for vol in pod["volumes"]}["dshm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": values["prefill"]["shmSize"]} == \
            {"medium": "Memory", "sizeLimit": "32Gi"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        # The weights come from the HF directory on the source claim, verified.
        (init,) = pod["initContainers"]
        assert _fetch_args(init).source == "dir" and init.get("securityContext") is None
    # Preferred instead of required, and a per-model override.
    objs = _render("decode.zoneAffinity=preferred", "prefill.zoneAffinity=none", files=(RDMA,))
    (decode,) = _pools(objs, "decode")
    (pref,) = decode["spec"]["template"]["spec"]["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["weight"] == 100 and pref["podAffinityTerm"]["topologyKey"] == "topology.kubernetes.io/zone"
    (prefill,) = _pools(objs, "prefill")
    assert "affinity" not in prefill["spec"]["template"]["spec"]


def test_every_pod_has_scrape_annotations_on_a_declared_port() -> None:
    objs = _render(files=(EXAMPLE,))
    # The response store's PostgreSQL exports no metrics and says so.
    store = _one(objs, "StatefulSet", STORE)
    assert store["spec"]["template"]["metadata"]["annotations"] == {"prometheus.io/scrape": "false"}
    workloads = [o for o in objs if o["kind"] in WORKLOAD_KINDS and o is not store]
    assert len(workloads) == 6  # etcd, frontend, 2 models x (prefill, decode)
    for w in workloads:
        ann = w["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true", w["metadata"]["name"]
        assert ann["prometheus.io/path"] == "/metrics"
        declared = {p["containerPort"] for p in _container(w)["ports"]}
        assert int(ann["prometheus.io/port"]) in declared, w["metadata"]["name"]


def test_selectors_select_their_pods() -> None:
    objs = _render(*ALL_FEATURES, files=(EXAMPLE,))
    pods = [o["spec"]["template"]["metadata"]["labels"] for o in objs if o["kind"] in WORKLOAD_KINDS]
    for w in (o for o in objs if o["kind"] in WORKLOAD_KINDS):
        assert _selects(w["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
    for obj in _by_kind(objs, "Service"):
        assert any(_selects(obj["spec"]["selector"], p) for p in pods), obj["metadata"]["name"]
    for obj in _by_kind(objs, "PodDisruptionBudget"):
        matched = [p for p in pods if _selects(obj["spec"]["selector"]["matchLabels"], p)]
        assert len(matched) == 1, f"PDB {obj['metadata']['name']} selects {len(matched)} workloads"


@pytest.fixture(scope="module")
def tenant_objs() -> list[dict[str, Any]]:
    """The manifests with a tenants file."""
    return _render(*TENANT_SETS)


def _frontend_config_files(objs: list[dict[str, Any]]) -> dict[str, str]:
    """The files of every ConfigMap the frontend Deployment mounts as its config volume, by name."""
    pod = _one(objs, "Deployment", "pdserve-frontend")["spec"]["template"]
    (config,) = [v for v in pod["spec"]["volumes"] if v["name"] == "config"]
    files: dict[str, str] = {}
    for source in config["projected"]["sources"]:
        files.update(_one(objs, "ConfigMap", source["configMap"]["name"])["data"])
    return files


def test_frontend_service_selects_its_pods_and_probes_them(tenant_objs: list[dict[str, Any]]) -> None:
    dep = _one(tenant_objs, "Deployment", "pdserve-frontend")
    c = _container(dep)
    pod = dep["spec"]["template"]
    svc = _one(tenant_objs, "Service", "pdserve-frontend")
    assert _selects(svc["spec"]["selector"], pod["metadata"]["labels"])
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert dep["spec"]["replicas"] == 2 and _flag(c["args"], "limit-share") == "2"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"


def test_ingress_serves_the_api_over_https_with_a_cert_manager_secret() -> None:
    """The Ingress routes the API host to the frontend Service's port, with TLS from the Secret that
    cert-manager (by the issuer annotation) fills; nginx streams SSE unbuffered and accepts the largest
    upload the frontends accept."""
    assert not _by_kind(_render(), "Ingress")
    objs = _render(*ALL_FEATURES, "frontend.maxFileBytes=52428800")
    ing = _one(objs, "Ingress", "pdserve-frontend")
    svc = _one(objs, "Service", "pdserve-frontend")
    spec = ing["spec"]
    assert spec["tls"] == [{"hosts": ["api.example.com"], "secretName": "pdserve-api-tls"}]
    (rule,) = spec["rules"]
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert rule["host"] == "api.example.com" and backend["name"] == svc["metadata"]["name"]
    assert backend["port"]["name"] in {p["name"] for p in svc["spec"]["ports"]}
    notes = ing["metadata"]["annotations"]
    assert notes["cert-manager.io/cluster-issuer"] == "letsencrypt-prod"
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert notes["nginx.ingress.kubernetes.io/proxy-read-timeout"] == "600"
    assert notes["nginx.ingress.kubernetes.io/proxy-body-size"] == "51m"
    assert _flag(_container(_one(objs, "Deployment", "pdserve-frontend"))["args"], "max-file-bytes") == "52428800"
    # A namespaced Issuer, a Secret made by hand, another controller with its own annotations.
    objs = _render("frontend.ingress.enabled=true", "frontend.ingress.host=llm.internal.example",
                   "frontend.ingress.certManager.issuer=private-ca", "frontend.ingress.certManager.kind=Issuer",
                   "frontend.ingress.className=traefik", "frontend.ingress.tlsSecretName=llm-tls",
                   "frontend.ingress.annotations={traefik.ingress.kubernetes.io/router.tls: 'true'}")
    ing = _one(objs, "Ingress", "pdserve-frontend")
    assert ing["spec"]["ingressClassName"] == "traefik" and ing["spec"]["tls"][0]["secretName"] == "llm-tls"
    assert ing["metadata"]["annotations"] == {"cert-manager.io/issuer": "private-ca",
                                              "traefik.ingress.kubernetes.io/router.tls": "true"}


def test_frontend_config_flags_name_files_of_its_config_maps(tenant_objs: list[dict[str, Any]]) -> None:
    """Every ConfigMap the frontend mounts exists, and the files its flags name are in them."""
    c = _container(_one(tenant_objs, "Deployment", "pdserve-frontend"))
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
    files = _frontend_config_files(tenant_objs)
    for flag in ("models", "tenants"):
        path = Path(_flag(c["args"], flag))
        assert str(path.parent) == mount and path.name in files, flag


def test_frontend_config_files_are_in_the_frontends_formats(tenant_objs: list[dict[str, Any]]) -> None:
    """Keys the frontend accepts, key digests only, models that are served."""
    from pdserve.frontend.config import ModelSpec
    from pdserve.frontend.tenants import TenantLimits

    files = _frontend_config_files(tenant_objs)
    models = yaml.safe_load(files["models.yaml"])["models"]
    assert {k for m in models for k in m} <= {f.name for f in dataclasses.fields(ModelSpec)}
    served = {n for m in models for n in (m["name"], *m.get("aliases", []))}
    tenants = yaml.safe_load(files["tenants.yaml"])["tenants"]
    allowed = {"name", "keys_sha256", "models"} | {f.name for f in dataclasses.fields(TenantLimits)}
    for t in tenants:
        assert set(t) <= allowed
        assert all(re.fullmatch(r"[0-9a-f]{64}", d) for d in t["keys_sha256"])
        assert set(t["models"]) <= served | {"*"}


def test_frontend_pods_roll_when_a_config_file_changes(tenant_objs: list[dict[str, Any]]) -> None:
    """The config checksum annotation follows the files."""
    pod = _one(tenant_objs, "Deployment", "pdserve-frontend")["spec"]["template"]
    values = k8s.load_values(sets=TENANT_SETS)
    _tenant(requests_per_minute=1)(values)
    edited = _one(k8s.render_objects(values), "Deployment", "pdserve-frontend")
    key = "pdserve.io/config-checksum"
    assert edited["spec"]["template"]["metadata"]["annotations"][key] != pod["metadata"]["annotations"][key]


def test_tenants_configmap_is_a_loadable_tenants_file(tenant_objs: list[dict[str, Any]], tmp_path: Path) -> None:
    from pdserve.frontend.tenants import TenantTable

    path = tmp_path / "tenants.yaml"
    path.write_text(_one(tenant_objs, "ConfigMap", "pdserve-tenants")["data"]["tenants.yaml"])
    table = TenantTable.from_file(path)
    acme = table.authenticate(TENANT_KEY)
    assert acme is not None and acme.name == "acme" and acme.limits.requests_per_minute == 600
    assert table.authenticate("sk-not-a-key") is None


def test_defaults_run_in_local_mode_and_published_keys_are_refused(default_objs: list[dict[str, Any]]) -> None:
    # No tenants file by default: the frontends accept any key (local mode) behind a ClusterIP Service.
    args = _container(_one(default_objs, "Deployment", "pdserve-frontend"))["args"]
    assert not any(a.startswith("--tenants=") for a in args)
    assert _one(default_objs, "Service", "pdserve-frontend")["spec"]["type"] == "ClusterIP"
    assert not [o for o in default_objs if o["metadata"]["name"] == "pdserve-tenants"]
    # The keys this repository prints (the former example digests among them) are refused with a recipe.
    from pdserve.frontend.tenants import hash_key

    for key in ("sk-pdserve-example-acme", "sk-pdserve-example-beta", "sk-test", "test"):
        values = k8s.load_values(sets=TENANT_SETS)
        values["tenants"]["items"][0]["keys_sha256"] = [hash_key(key)]
        with pytest.raises(k8s.ValuesError, match="published key") as err:
            k8s.render(values)
        assert "secrets.token_urlsafe" in str(err.value) and "--hash-key" in str(err.value)


def test_local_mode_without_tenants_and_hpa_replicas() -> None:
    objs = _render("tenants.enabled=false", "frontend.hpa.enabled=true", "frontend.hpa.maxReplicas=5")
    assert not [o for o in _by_kind(objs, "ConfigMap") if o["metadata"]["name"] == "pdserve-tenants"]
    dep = _one(objs, "Deployment", "pdserve-frontend")
    args = _container(dep)["args"]
    assert not any(a.startswith("--tenants=") for a in args)
    # The HPA owns the replica count, and limits are split over the most frontends it may run.
    assert "replicas" not in dep["spec"]
    assert _flag(args, "limit-share") == "5"
    hpa = _one(objs, "HorizontalPodAutoscaler", "pdserve-frontend")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "pdserve-frontend" and hpa["spec"]["maxReplicas"] == 5


def test_monitoring_objects() -> None:
    assert not [o for o in _render() if o["apiVersion"].startswith("monitoring.coreos.com/")]
    objs = _render(*ALL_FEATURES, "monitoring.serviceMonitor.labels.release=kps")
    monitors = _by_kind(objs, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {f"pdserve-{c}" for c in ("frontend", "prefill", "decode", "etcd")}
    services = _by_kind(objs, "Service")
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1" and m["metadata"]["labels"]["release"] == "kps"
        (endpoint,) = m["spec"]["endpoints"]
        assert endpoint["honorLabels"] is True and endpoint["path"] == "/metrics"
        # Some Service that the monitor selects has the port it scrapes.
        ports = [p["name"] for s in services if _selects(m["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
                 for p in s["spec"]["ports"]]
        assert endpoint["port"] in ports, m["metadata"]["name"]
    (rule,) = _by_kind(objs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((PROM_DIR / "rules.yml").read_text())


def test_grafana_provisioning_config_maps() -> None:
    assert not [o for o in _render() if "grafana" in o["metadata"]["name"]]
    objs = _render("monitoring.grafana.enabled=true")
    dashboards = _one(objs, "ConfigMap", "pdserve-grafana-dashboards")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboards["metadata"]["annotations"]["grafana_folder"] == "pdserve"
    sources = sorted((ROOT / "deploy" / "grafana").glob("*.json"))
    assert sources and set(dashboards["data"]) == {p.name for p in sources}
    for path in sources:
        assert dashboards["data"][path.name] == path.read_text(), path.name  # verbatim: the tested dashboard
    provider = yaml.safe_load(_one(objs, "ConfigMap", "pdserve-grafana-provisioning")["data"]["pdserve-dashboards.yaml"])
    (prov,) = provider["providers"]
    assert provider["apiVersion"] == 1 and prov["type"] == "file"
    assert prov["options"]["path"] == "/var/lib/grafana/dashboards/pdserve" and prov["folder"] == "pdserve"
    other = _render("monitoring.grafana.enabled=true", "monitoring.grafana.namespace=monitoring")
    assert _one(other, "ConfigMap", "pdserve-grafana-dashboards")["metadata"]["namespace"] == "monitoring"


def test_network_policies_let_the_cluster_talk() -> None:
    objs = _render("networkPolicy.enabled=true")
    policies = {p["metadata"]["name"]: p for p in _by_kind(objs, "NetworkPolicy")}
    assert set(policies) == {"pdserve-etcd", "pdserve-nodes", "pdserve-frontend", STORE}
    pods = {o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["metadata"]["labels"]
            for o in objs if o["kind"] in WORKLOAD_KINDS}
    nodes = policies["pdserve-nodes"]["spec"]
    # Node pods accept every port from the release's pods (KV transfers use ports beyond --kv-port).
    peers = nodes["ingress"][0]
    assert "ports" not in peers and _selects(peers["from"][0]["podSelector"]["matchLabels"], pods["frontend"])
    etcd_clients = policies["pdserve-etcd"]["spec"]["ingress"][0]
    assert all(_selects(etcd_clients["from"][0]["podSelector"]["matchLabels"], pods[r])
               for r in ("frontend", "prefill", "decode"))
    # The response store: its port, from the frontends and no other pod.
    store = policies[STORE]["spec"]
    assert _selects(store["podSelector"]["matchLabels"], pods["response-store"])
    (rule,) = store["ingress"]
    assert rule["ports"] == [{"port": 5432}]
    (peer,) = rule["from"]
    assert [c for c, labels in pods.items() if _selects(peer["podSelector"]["matchLabels"], labels)] == ["frontend"]
    assert "namespaceSelector" not in peer
    # An external store: no policy for a server that is not here.
    external = _render("networkPolicy.enabled=true", *EXTERNAL_STORE)
    assert {p["metadata"]["name"] for p in _by_kind(external, "NetworkPolicy")} == set(policies) - {STORE}


AUTOSCALED_METRICS = {"prefill": {"pdserve_requests_waiting"}, "decode": {"pdserve_kv_usage_ratio", "pdserve_requests_running"}}


def _catalogue() -> set[str]:
    return set(re.findall(r"^\| `(pdserve_[a-z0-9_]+)`", (PROM_DIR / "README.md").read_text(), re.M))


def test_autoscaling_is_off_by_default(default_objs: list[dict[str, Any]]) -> None:
    objs = default_objs
    assert not [o for o in objs if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]
    assert all("replicas" in d["spec"] for d in _by_kind(objs, "Deployment"))


def test_hpa_per_pool_scales_on_the_series_the_nodes_export() -> None:
    objs = _render("autoscaling.mode=hpa", files=(EXAMPLE,))
    values = k8s.load_values([EXAMPLE])
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in _by_kind(objs, "HorizontalPodAutoscaler")}
    pools = [d for d in _by_kind(objs, "Deployment") if "frontend" not in d["metadata"]["name"]]
    assert len(pools) == 4 and set(hpas) == {d["metadata"]["name"] for d in pools} | {"pdserve-frontend"}
    for dep in pools:
        role = dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        hpa = hpas[dep["metadata"]["name"]]["spec"]
        assert "replicas" not in dep["spec"]  # the HPA owns the count; `kubectl apply` must not reset it
        bounds = values[role]["autoscaling"]
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (bounds["minReplicas"], bounds["maxReplicas"])
        assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
        metrics = {m["external"]["metric"]["name"]: m["external"] for m in hpa["metrics"]}
        # Prefill on its queue, decode on KV usage and running requests: series the nodes export.
        assert set(metrics) == AUTOSCALED_METRICS[role] and set(metrics) <= _catalogue()
        for ext in metrics.values():
            assert ext["metric"]["selector"]["matchLabels"] == {
                "namespace": "pdserve", "cluster": "default", "pool": role,
                "model": _flag(_container(dep)["args"], "model-name")}
            assert ext["target"]["type"] == "AverageValue"
        if role == "decode":
            assert metrics["pdserve_kv_usage_ratio"]["target"]["averageValue"] == "0.85"


def test_hpa_leaves_the_empty_prefill_pool_of_a_colocated_plan_unscaled() -> None:
    objs = _render("autoscaling.mode=hpa", "prefill.replicas=0")
    (prefill,) = _pools(objs, "prefill")
    assert prefill["spec"]["replicas"] == 0
    assert {h["spec"]["scaleTargetRef"]["name"] for h in _by_kind(objs, "HorizontalPodAutoscaler")} == \
        {d["metadata"]["name"] for d in _pools(objs, "decode")}


def test_autoscaling_keda_queries_parse_and_select_each_pool(promtool: str, tmp_path: Path) -> None:
    objs = _render("autoscaling.mode=keda", "decode.autoscaling.maxReplicas=12", files=(EXAMPLE,))
    assert not _by_kind(objs, "HorizontalPodAutoscaler")[1:]  # only the frontends' (CPU) HPA
    scaled = {o["spec"]["scaleTargetRef"]["name"]: o for o in _by_kind(objs, "ScaledObject")}
    pools = [d for d in _by_kind(objs, "Deployment") if "frontend" not in d["metadata"]["name"]]
    assert set(scaled) == {d["metadata"]["name"] for d in pools}
    queries = []
    for dep in pools:
        role = dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        spec = scaled[dep["metadata"]["name"]]["spec"]
        assert scaled[dep["metadata"]["name"]]["apiVersion"] == "keda.sh/v1alpha1" and "replicas" not in dep["spec"]
        assert spec["maxReplicaCount"] == (12 if role == "decode" else 4) and spec["minReplicaCount"] == 1
        used = set()
        for trigger in spec["triggers"]:
            assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
            meta = trigger["metadata"]
            assert meta["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
            float(meta["threshold"])
            (metric,) = re.findall(r"(pdserve_[a-z_]+)\{", meta["query"])
            used.add(metric)
            assert f'model="{_flag(_container(dep)["args"], "model-name")}"' in meta["query"]
            assert f'pool="{role}"' in meta["query"]
            queries.append(meta["query"])
        assert used == AUTOSCALED_METRICS[role]
    # promtool parses every query (as the expression of a recording rule).
    rules = {"groups": [{"name": "q", "rules": [{"record": f"q{i}", "expr": q} for i, q in enumerate(queries)]}]}
    (tmp_path / "q.yml").write_text(yaml.safe_dump(rules))
    assert "SUCCESS" in _promtool(promtool, "check", "rules", "q.yml", cwd=tmp_path)


@pytest.mark.parametrize("role,tp", [("prefill", 2), ("decode", 4)])
def test_a_tp_pool_runs_its_ranks_and_requests_a_gpu_for_each(role: str, tp: int) -> None:
    """`tp: N`: the node gets --tensor-parallel-size N and the pod N GPUs (requested = limited); at TP 1
    the flag is left out and `gpus` is what the pod asks for, as before."""
    objs = _render(*TP_SETS)
    _, _, c = _node_pod(objs, role)
    assert _flag(c["args"], "tensor-parallel-size") == str(tp) and _flag(c["args"], "device") == "cuda"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == tp == c["resources"]["limits"]["nvidia.com/gpu"]
    assert c["resources"]["requests"]["cpu"] == "4"  # a GPU pod's CPU is the pod's, as given
    _, _, plain = _node_pod(_render("decode.gpus=2"), role)
    assert not any(a.startswith("--tensor-parallel-size") for a in plain["args"])
    assert plain["resources"]["requests"]["nvidia.com/gpu"] == {"prefill": 1, "decode": 2}[role]


def test_a_tp_pool_on_cpu_scales_its_cpu_and_asks_for_no_gpu() -> None:
    objs = _render("decode.device=cpu", "decode.tp=3", "decode.resources.requests.cpu=1500m",
                   "decode.resources.limits.cpu=2", "prefill.device=cpu")
    _, _, c = _node_pod(objs, "decode")
    assert _flag(c["args"], "device") == "cpu" and _flag(c["args"], "tensor-parallel-size") == "3"
    assert c["resources"]["requests"]["cpu"] == "4500m" and c["resources"]["limits"]["cpu"] == "6"
    assert "nvidia.com/gpu" not in c["resources"]["requests"] and "nvidia.com/gpu" not in c["resources"]["limits"]
    _, _, p = _node_pod(objs, "prefill")  # TP 1 on CPU: its resources as given
    assert p["resources"]["requests"]["cpu"] == "4" and "nvidia.com/gpu" not in p["resources"]["requests"]


def test_the_planners_tp_values_file_renders() -> None:
    """What `pdserve plan --tp-widths` writes for a TP shape (planner.plan.values_document) renders."""
    from pdserve.planner.plan import values_document
    from pdserve.planner.sim import Shape

    values = k8s.deep_merge(k8s.load_values(), yaml.safe_load(values_document(Shape.parse("1P(tp2):3D(tp1)"), "x")))
    objs = k8s.render_objects(values)
    (pre,), (dec,) = _pools(objs, "prefill"), _pools(objs, "decode")
    assert (pre["spec"]["replicas"], dec["spec"]["replicas"]) == (1, 3)
    assert _flag(_container(pre)["args"], "tensor-parallel-size") == "2"
    assert not any(a.startswith("--tensor-parallel-size") for a in _container(dec)["args"])


def _set(assignment: str) -> Callable[[dict[str, Any]], None]:
    return lambda values: k8s.set_value(values, assignment)


def _tenant(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def edit(values: dict[str, Any]) -> None:
        for assignment in TENANT_SETS:
            k8s.set_value(values, assignment)
        values["tenants"]["items"][0].update(fields)
    return edit


@pytest.mark.parametrize(("edit", "message"), [
    pytest.param(_set("etcd.replicas=2"), "must be odd", id="even-etcd"),
    pytest.param(_set("frontend.pdb={minAvailable: 2}"), "blocks every voluntary eviction", id="pdb-min"),
    pytest.param(_set("prefill.pdb={maxUnavailable: 0}"), "blocks every voluntary eviction", id="pdb-max"),
    pytest.param(_tenant(keys_sha256=["sk-a-raw-key"]), "SHA-256", id="raw-key"),
    pytest.param(_tenant(models=["no-such-model"]), "not served", id="tenant-model"),
    pytest.param(lambda v: v["models"][0].update(fallback="SmolLM2-135M-Instruct"), "not another served model",
                 id="self-fallback"),
    pytest.param(_set("decode.kvPort=50051"), "must differ", id="port-clash"),
    pytest.param(lambda v: v["models"].append({"name": "smollm2_135m-instruct", "path": "x"}), "same object names",
                 id="name-clash"),
    pytest.param(_set("name=a-name-that-is-far-too-long"), "DNS label", id="long-name"),
    pytest.param(_set("decode.terminationGracePeriodSeconds=30"), "the drain would be cut", id="grace-below-drain"),
    pytest.param(_set("decode.drainGraceSeconds=300"), "must be shorter than drainTimeoutSeconds", id="drain-grace"),
    pytest.param(_set("prefill.extraArgs=[--drain-timeout=5]"), "use drainTimeoutSeconds", id="drain-in-extra-args"),
    pytest.param(_set("frontend.terminationGracePeriodSeconds=120"), "streams in flight would be cut", id="frontend-grace"),
    pytest.param(_set("decode.strategy.rollingUpdate={maxSurge: 0, maxUnavailable: 1}"), "keep capacity",
                 id="rollout-unavailable"),
    pytest.param(_set("prefill.strategy={type: Recreate}"), "RollingUpdate", id="rollout-recreate"),
    pytest.param(_set("decode.extraEnv=[{name: POD_IP, value: 1.2.3.4}]"), "extraEnv", id="env-overrides-downward-api"),
    pytest.param(_set("decode.extraResources={nvidia.com/gpu: 2}"), "GPUs go in", id="gpus-in-extra-resources"),
    pytest.param(_set("decode.zoneAffinity=always"), "zoneAffinity", id="zone-affinity"),
    pytest.param(_set("prefill.podAnnotations={prometheus.io/port: '9999'}"), "prometheus.io/port", id="scrape-port"),
    pytest.param(_set("autoscaling.mode=vpa"), "autoscaling.mode", id="autoscaling-mode"),
    pytest.param(lambda v: (k8s.set_value(v, "autoscaling.mode=hpa"), k8s.set_value(v, "decode.autoscaling.maxReplicas=0")),
                 "maxReplicas", id="autoscaling-bounds"),
    pytest.param(lambda v: (k8s.set_value(v, "autoscaling.mode=keda"), k8s.set_value(v, "decode.autoscaling.targetKVUsage=85")),
                 "fraction", id="autoscaling-kv-target"),
    pytest.param(_set(f"responseStore.url={EXTERNAL_URL}"), "exactly one of", id="store-both"),
    pytest.param(_set("responseStore.postgres.enabled=false"), "exactly one of", id="store-neither"),
    pytest.param(lambda v: (k8s.set_value(v, EXTERNAL_STORE[0]), k8s.set_value(v, "responseStore.url=/data/responses.db")),
                 "postgresql://", id="store-sqlite"),
    pytest.param(lambda v: (k8s.set_value(v, EXTERNAL_STORE[0]),
                            k8s.set_value(v, "responseStore.url=postgresql://u:hunter2@db:5432/r")),
                 "must not hold the password", id="store-password-in-url"),
    pytest.param(lambda v: (k8s.set_value(v, EXTERNAL_STORE[0]),
                            k8s.set_value(v, "responseStore.url=postgresql://u@db/r?password=hunter2")),
                 "must not hold the password", id="store-password-in-query"),
    pytest.param(lambda v: (k8s.set_value(v, EXTERNAL_STORE[0]), k8s.set_value(v, "responseStore.url=postgresql://db:5432")),
                 "host and a database", id="store-no-database"),
    pytest.param(_set("responseStore.postgres.image=postgres:latest"), "must pin a version", id="store-image-latest"),
    pytest.param(_set("responseStore.postgres.image=postgres"), "must pin a version", id="store-image-untagged"),
    pytest.param(_set("responseStore.postgres.image=postgres:16"), "must pin a version", id="store-image-major-only"),
    pytest.param(_set("responseStore.postgres.user=Pd-Serve"), "PostgreSQL name", id="store-user"),
    pytest.param(_set("responseStore.passwordSecret.name="), "needs a password Secret", id="store-no-secret"),
    pytest.param(_set("responseStore.ttlSeconds=0"), "ttlSeconds", id="store-ttl"),
    pytest.param(_set("frontend.extraArgs=[--response-store=/tmp/r.db]"), "responseStore.url", id="store-in-extra-args"),
    pytest.param(_set("frontend.ingress.enabled=true"), "must be the API's DNS name", id="ingress-no-host"),
    pytest.param(lambda v: (k8s.set_value(v, "frontend.ingress.enabled=true"),
                            k8s.set_value(v, "frontend.ingress.host=https://api.example.com/")),
                 "must be the API's DNS name", id="ingress-url-host"),
    pytest.param(lambda v: (k8s.set_value(v, "frontend.ingress.enabled=true"),
                            k8s.set_value(v, "frontend.ingress.host=api.example.com"),
                            k8s.set_value(v, "frontend.ingress.certManager.issuer=x"),
                            k8s.set_value(v, "frontend.ingress.certManager.kind=Cluster")),
                 "ClusterIssuer or Issuer", id="ingress-issuer-kind"),
    pytest.param(_set("frontend.extraArgs=[--tls-cert=/x.pem]"), "frontend.ingress", id="tls-in-extra-args"),
    pytest.param(_set("frontend.maxFileBytes=0"), "maxFileBytes", id="max-file-bytes"),
    pytest.param(_set("decode.tp=0"), "tp must be an integer >= 1", id="tp-zero"),
    pytest.param(_set("prefill.tp=1.5"), "tp must be an integer >= 1", id="tp-fraction"),
    pytest.param(_set("prefill.tp='2'"), "tp must be an integer >= 1", id="tp-string"),
    pytest.param(_set("decode.tp=true"), "tp must be an integer >= 1", id="tp-bool"),
    pytest.param(_set("decode.tp=65"), r"tp must be in \[1, 64\]", id="tp-too-wide"),
    pytest.param(lambda v: (k8s.set_value(v, "decode.tp=2"), k8s.set_value(v, "decode.gpus=3")),
                 "drives 2 GPUs", id="tp-gpus-mismatch"),
    pytest.param(lambda v: (k8s.set_value(v, "prefill.tp=2"), k8s.set_value(v, "prefill.kvTierGiB=8")),
                 "KV tier runs at tp 1 only", id="tp-kv-tier"),
    pytest.param(_set("decode.extraArgs=[--tensor-parallel-size=2]"), "use tp / device", id="tp-in-extra-args"),
    pytest.param(_set("decode.device=tpu"), "device must be cuda or cpu", id="device"),
    pytest.param(lambda v: (k8s.set_value(v, "decode.device=cpu"), k8s.set_value(v, "decode.tp=2"),
                            k8s.set_value(v, "decode.resources.requests.cpu=lots")),
                 "not a CPU quantity", id="tp-cpu-quantity"),
    pytest.param(lambda v: v["models"][0].update(decode={"tp": -1}), "tp must be an integer", id="tp-model-override"),
])
def test_bad_values_are_refused(edit: Callable[[dict[str, Any]], None], message: str) -> None:
    values = k8s.load_values()
    edit(values)
    with pytest.raises(k8s.ValuesError, match=message):
        k8s.render(values)


def test_render_cli_writes_the_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pdserve.yaml"
    assert k8s.main(["-f", str(EXAMPLE), "--set", "decode.replicas=7", "--set", "etcd.replicas=5", "-o", str(out)]) == 0
    objs = [o for o in yaml.safe_load_all(out.read_text()) if o]
    assert _one(objs, "StatefulSet", "pdserve-etcd")["spec"]["replicas"] == 5
    # Both models in the file size their decode pools themselves, which wins over the --set default.
    assert sorted(d["spec"]["replicas"] for d in _pools(objs, "decode")) == [2, 6]
    assert k8s.main(["--set", "etcd.replicas=4"]) == 2
    assert "etcd.replicas must be odd" in capsys.readouterr().err


def test_values_merge_replaces_lists_and_merges_maps() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    merged = k8s.deep_merge(base, {"a": {"c": [3]}, "e": 2})
    assert merged == {"a": {"b": 1, "c": [3]}, "d": 1, "e": 2}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    values: dict[str, Any] = {}
    k8s.set_value(values, "x.y=4")
    k8s.set_value(values, "x.z={a: true}")
    assert values == {"x": {"y": 4, "z": {"a": True}}}


# ---------------------------------------------------------------------------------------- response store


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_response_store_is_one_postgres_statefulset_on_a_pvc(default_objs: list[dict[str, Any]]) -> None:
    sts = _one(default_objs, "StatefulSet", STORE)
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] == 1 and labels["app.kubernetes.io/component"] == "response-store"
    assert _selects(spec["selector"]["matchLabels"], labels)
    headless = _one(default_objs, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and _selects(headless["spec"]["selector"], labels)
    svc = _one(default_objs, "Service", STORE)
    assert "clusterIP" not in svc["spec"] and _selects(svc["spec"]["selector"], labels)
    c = _container(sts)
    assert c["name"] == "postgres" and re.fullmatch(r"docker\.io/library/postgres:16\.\d+", c["image"])
    (port,) = c["ports"]
    assert svc["spec"]["ports"] == [{"name": "postgres", "port": 5432, "targetPort": port["name"]}]
    assert port["containerPort"] == 5432
    env = _env(c)
    assert (env["POSTGRES_USER"], env["POSTGRES_DB"], env["PGPORT"]) == ("pdserve", "pdserve", "5432")
    assert env["POSTGRES_PASSWORD"] == {"secretKeyRef": {"name": "pdserve-response-store", "key": "password"}}
    # The data on the claim, in a subdirectory of its mount (initdb refuses a lost+found).
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"] == {"storage": "10Gi"}
    assert "storageClassName" not in claim["spec"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert env["PGDATA"].startswith(mounts[claim["metadata"]["name"]] + "/")
    # pg_isready over TCP on the server's port, for every probe; a fast shutdown before SIGTERM.
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        cmd = c[kind]["exec"]["command"]
        assert cmd[0] == "pg_isready" and cmd[cmd.index("-h") + 1] == "127.0.0.1", kind
        assert (cmd[cmd.index("-p") + 1], cmd[cmd.index("-U") + 1], cmd[cmd.index("-d") + 1]) == ("5432", "pdserve", "pdserve")
    stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert stop[:2] == ["pg_ctl", "stop"] and stop[stop.index("-m") + 1] == "fast"
    assert int(stop[stop.index("-t") + 1]) < pod["terminationGracePeriodSeconds"]
    # Requests and a memory limit, like every other container.
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
    # Not root, no privilege escalation, a read-only root with writable socket and temp directories.
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/var/run/postgresql", "/tmp"):
        (name,) = [n for n, m in mounts.items() if m == path]
        assert "emptyDir" in volumes[name], path
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    # The password is referenced, never rendered: no Secret in the manifests.
    assert not _by_kind(default_objs, "Secret")


def test_store_security_contexts_merge_over_the_global_ones() -> None:
    objs = _render("podSecurityContext={runAsNonRoot: true, runAsUser: 1000, supplementalGroups: [5]}",
                   "containerSecurityContext={readOnlyRootFilesystem: false, privileged: false}")
    sts = _one(objs, "StatefulSet", STORE)
    pod = sts["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsUser"] == 999 and pod["supplementalGroups"] == [5]  # the image's postgres user wins
    sc = _container(sts)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["privileged"] is False


def test_frontends_share_the_in_cluster_store(default_objs: list[dict[str, Any]]) -> None:
    """The frontends' --response-store names the store's Service, user and database, without the password,
    which comes as PGPASSWORD from the server's own Secret; the frontend's parser and open_store accept it."""
    from pdserve.frontend.config import build_parser
    from pdserve.frontend.response_store import PostgresResponseStore, open_store

    sts = _one(default_objs, "StatefulSet", STORE)
    server_env = _env(_container(sts))
    c = _container(_one(default_objs, "Deployment", "pdserve-frontend"))
    url = urllib.parse.urlsplit(_flag(c["args"], "response-store"))
    assert url.scheme == "postgresql" and url.password is None
    assert url.hostname == f"{STORE}.pdserve.svc.cluster.local" and url.port == 5432
    assert (url.username, url.path) == (server_env["POSTGRES_USER"], "/" + server_env["POSTGRES_DB"])
    assert _env(c)["PGPASSWORD"] == server_env["POSTGRES_PASSWORD"]
    assert _flag(c["args"], "response-ttl") == str(30 * 24 * 3600)
    args = build_parser().parse_args(c["args"])
    assert args.response_store == url.geturl() and args.response_ttl_s == 30 * 24 * 3600
    store = open_store(args.response_store)
    assert isinstance(store, PostgresResponseStore)
    assert store.description == f"PostgreSQL response store postgresql://pdserve@{STORE}.pdserve.svc.cluster.local:5432/pdserve"


def test_external_store_renders_no_postgres_and_passes_its_url() -> None:
    objs = _render(*EXTERNAL_STORE, "responseStore.ttlSeconds=86400")
    assert [o["metadata"]["name"] for o in _by_kind(objs, "StatefulSet")] == ["pdserve-etcd"]
    assert not [o for o in objs if "postgres" in o["metadata"]["name"]]
    c = _container(_one(objs, "Deployment", "pdserve-frontend"))
    assert _flag(c["args"], "response-store") == EXTERNAL_URL
    assert _flag(c["args"], "response-ttl") == "86400"
    assert _env(c)["PGPASSWORD"] == {"secretKeyRef": {"name": "pdserve-response-store", "key": "password"}}
    # Another Secret, or none (a server that authenticates the frontends otherwise).
    other = _render(*EXTERNAL_STORE, "responseStore.passwordSecret={name: rds-credentials, key: pw}")
    c = _container(_one(other, "Deployment", "pdserve-frontend"))
    assert _env(c)["PGPASSWORD"] == {"secretKeyRef": {"name": "rds-credentials", "key": "pw"}}
    none = _render(*EXTERNAL_STORE, "responseStore.passwordSecret.name=")
    assert "PGPASSWORD" not in _env(_container(_one(none, "Deployment", "pdserve-frontend")))


def test_every_container_pins_its_image_and_sets_resources() -> None:
    for objs in (_render(*ALL_FEATURES, files=(EXAMPLE,)), _render(*ALL_FEATURES, files=(RDMA,)), _render()):
        for w in (o for o in objs if o["kind"] in WORKLOAD_KINDS):
            pod = w["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                where = f"{w['metadata']['name']}/{c['name']}"
                tag = c["image"].rsplit("/", 1)[-1].partition(":")[2]
                assert tag and tag != "latest", where
                assert c["resources"].get("requests") and c["resources"].get("limits", {}).get("memory"), where


class _PasswordServer:
    """A PostgreSQL initialized as the postgres image's entrypoint does it from the StatefulSet's env
    (POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB; password authentication over TCP), on PGPORT."""

    def __init__(self, env: dict[str, str]) -> None:
        from testing.postgres import PostgresServer

        class Server(PostgresServer):
            def _initdb(server) -> None:  # noqa: N805
                pwfile = server.root / "pw"
                pwfile.write_text(env["POSTGRES_PASSWORD"] + "\n")
                if server._as is not None:
                    os.chown(pwfile, server._as.pw_uid, server._as.pw_gid)
                server._run(str(server.bin_dir / "initdb"), "-D", str(server.data_dir), "-U", env["POSTGRES_USER"],
                            f"--pwfile={pwfile}", "--auth-local=trust", "--auth-host=scram-sha-256",
                            "--encoding=UTF8", "--locale=C", "--no-sync")
                with open(server.data_dir / "postgresql.conf", "a") as conf:
                    conf.write(f"\nport = {server.port}\nlisten_addresses = '127.0.0.1'\n"
                               f"unix_socket_directories = '{server.root}'\nfsync = off\n")
                server.start()
                import psycopg

                try:
                    with psycopg.connect(host=str(server.root), port=server.port, user=env["POSTGRES_USER"],
                                         dbname="postgres", autocommit=True, connect_timeout=10) as conn:
                        conn.execute(f"CREATE DATABASE {env['POSTGRES_DB']}")  # the socket: trust, like the image
                except BaseException:
                    server.stop()
                    raise

        self.server = Server()

    def run(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        """A container command (probe, hook) as the server's user, with the container's env."""
        cmd = list(argv)
        cmd[0] = str(self.server.bin_dir / cmd[0]) if (self.server.bin_dir / cmd[0]).exists() else cmd[0]
        return subprocess.run(self.server._cmd(*cmd), env={**os.environ, **env}, cwd=self.server.root,
                              capture_output=True, text=True, timeout=120, check=False)


def test_rendered_probes_hook_and_frontend_url_work_against_a_real_postgres(monkeypatch: pytest.MonkeyPatch) -> None:
    """The StatefulSet's probe and preStop commands and the frontends' URL + PGPASSWORD, run against a
    PostgreSQL set up the way the image sets itself up from the rendered env (the Service name stands for
    127.0.0.1): the probe passes, the frontends' store works with the Secret's password and not without it,
    and the preStop hook stops the server while a frontend holds a connection (SIGTERM's smart shutdown
    would wait for it)."""
    import asyncio

    from pdserve.frontend.response_store import StoredResponse, StoreUnavailable, open_store

    password = secrets.token_hex(12)
    probe_values = k8s.load_values()
    pg = _PasswordServer({"POSTGRES_USER": "pdserve", "POSTGRES_DB": "pdserve", "POSTGRES_PASSWORD": password})
    server = pg.server
    try:
        probe_values["responseStore"]["postgres"]["port"] = server.port
        objs = k8s.render_objects(probe_values)
        c = _container(_one(objs, "StatefulSet", STORE))
        env = {k: v for k, v in _env(c).items() if isinstance(v, str)}
        env["PGDATA"] = str(server.data_dir)  # the claim's mount stands here
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            done = pg.run(c[kind]["exec"]["command"], env)
            assert done.returncode == 0, (kind, done.stdout, done.stderr)

        fe = _container(_one(objs, "Deployment", "pdserve-frontend"))
        url = _flag(fe["args"], "response-store").replace(f"{STORE}.pdserve.svc.cluster.local", "127.0.0.1")

        async def use(pgpassword: str) -> Any:
            monkeypatch.setenv("PGPASSWORD", pgpassword)  # what the frontend container gets from the Secret
            store = open_store(url)
            try:
                await store.start()
                now = time.time()
                rec = StoredResponse(id="resp_k8s", tenant="t", created_at=now, expires_at=now + 60, status="completed",
                                     response={"id": "resp_k8s"}, input_items=[], context=[])
                await store.put(rec)
                got = await store.get("t", "resp_k8s")
                return got.response if got else None
            finally:
                await store.close()

        assert asyncio.run(use(password)) == {"id": "resp_k8s"}
        with pytest.raises(StoreUnavailable) as err:
            asyncio.run(use("wrong-" + password))
        assert "password authentication failed" in str(err.value) and password not in str(err.value)
        monkeypatch.delenv("PGPASSWORD")

        import psycopg

        held = psycopg.connect(url, password=password, connect_timeout=10)  # a frontend's pooled connection
        try:
            started = time.monotonic()
            done = pg.run(c["lifecycle"]["preStop"]["exec"]["command"], env)
            assert done.returncode == 0, (done.stdout, done.stderr)
            assert not server.running and time.monotonic() - started < 30
        finally:
            held.close()
    finally:
        server.close()


# ---------------------------------------------------------------------------------------- prometheus


@pytest.fixture(scope="module")
def promtool() -> Iterator[str]:
    """promtool from PATH, else from Debian's `prometheus` package (root only)."""
    yield require_package("prometheus", lambda: shutil.which("promtool"), "promtool")


def _promtool(promtool: str, *args: str, cwd: Path = PROM_DIR) -> str:
    done = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_promtool_checks_rules_and_their_unit_tests(promtool: str) -> None:
    out = _promtool(promtool, "check", "rules", "rules.yml")
    assert re.search(r"SUCCESS: \d+ rules found", out)
    _promtool(promtool, "test", "rules", "rules_test.yml")


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    """rules_test.yml pins down each alert both ways: an evaluation where it fires (with its labels and
    summary) and one where it does not (before its `for`, or under its traffic guard)."""
    rules = yaml.safe_load((PROM_DIR / "rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert len(alerts) >= 13
    fires: set[str] = set()
    quiet: set[str] = set()
    for test in yaml.safe_load((PROM_DIR / "rules_test.yml").read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            (fires if case["exp_alerts"] else quiet).add(case["alertname"])
    assert alerts - fires == set(), "alerts never shown firing"
    assert alerts - quiet == set(), "alerts never shown quiet"
    # Every SLO and error-rate alert has a minimum-traffic guard, and the burn-rate alerts two windows.
    by_name = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    for name in ("PdserveSLOBudgetBurnFast", "PdserveSLOBudgetBurnSlow", "PdserveErrorRateHigh"):
        expr = by_name[name]["expr"]
        assert re.search(r":rate(5m|1h) >= 0\.05", expr), name
        assert len(set(re.findall(r":ratio_rate(\w+)", expr))) == 2, name
    # The KV alert does not fire on a full decode cache alone.
    assert "pdserve_requests_waiting" in by_name["PdserveKVFullAndQueueing"]["expr"]
    # Every recording rule keeps the cluster label.
    for g in rules["groups"]:
        for r in g["rules"]:
            for by in re.findall(r"by \(([^)]*)\)", r["expr"]):
                assert "cluster" in by, (r.get("record") or r.get("alert"), by)


def test_promtool_checks_the_local_scrape_config(promtool: str, tmp_path: Path) -> None:
    out = _promtool(promtool, "check", "config", "prometheus.yml")
    assert "SUCCESS" in out
    # The file_sd path resolves to <repo>/runs/default/prometheus_targets.json, where `pdserve up` writes.
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["file_sd_configs"]
    assert [(PROM_DIR / f).resolve() for f in sd["files"]] == [ROOT / "runs" / "default" / "prometheus_targets.json"]
    assert job["honor_labels"] is True
    # A targets file in the documented format passes promtool's file_sd check.
    work = tmp_path / "deploy" / "prometheus"
    work.mkdir(parents=True)
    for name in ("prometheus.yml", "rules.yml"):
        shutil.copy(PROM_DIR / name, work / name)
    targets = tmp_path / "runs" / "default" / "prometheus_targets.json"
    targets.parent.mkdir(parents=True)
    targets.write_text(
        '[{"targets": ["127.0.0.1:8000"], "labels": {"cluster": "default", "pool": "frontend", "node": "frontend-0"}},'
        ' {"targets": ["127.0.0.1:41234"], "labels": {"cluster": "default", "pool": "decode", "node": "decode-0"}}]'
    )
    out = _promtool(promtool, "check", "config", "prometheus.yml", cwd=work)
    assert "does not exist" not in out and "SUCCESS" in out


def test_kubernetes_scrape_config_matches_the_manifests() -> None:
    config = yaml.safe_load((PROM_DIR / "prometheus-k8s.yml").read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == [k8s.load_values()["namespace"]]
    assert job["honor_labels"] is True
    relabel = job["relabel_configs"]
    # The keep rules match what every rendered pod carries, and the port rewrite picks the annotated port.
    keeps = {r["source_labels"][0]: r["regex"] for r in relabel if r.get("action") == "keep"}
    assert len(keeps) == 2
    port = next(r for r in relabel if r.get("target_label") == "__address__")
    workloads = [o for o in _render() if o["kind"] in WORKLOAD_KINDS]
    assert len(workloads) == 5
    for w in workloads:
        meta = w["spec"]["template"]["metadata"]
        pod_meta = {f"__meta_kubernetes_pod_label_{_sanitize(k)}": v for k, v in meta["labels"].items()}
        pod_meta |= {f"__meta_kubernetes_pod_annotation_{_sanitize(k)}": v for k, v in meta["annotations"].items()}
        if w["metadata"]["name"] == STORE:  # PostgreSQL has no /metrics: a keep rule drops it
            assert not all(re.fullmatch(regex, pod_meta.get(label, "")) for label, regex in keeps.items())
            continue
        for label, regex in keeps.items():
            assert re.fullmatch(regex, pod_meta.get(label, "")), (w["metadata"]["name"], label)
        annotated = meta["annotations"]["prometheus.io/port"]
        joined = f"10.1.2.3:50051;{annotated}"  # __address__;annotation, as source_labels join them
        rewritten = re.sub(f"^(?:{port['regex']})$", port["replacement"].replace("$", "\\"), joined)
        assert rewritten == f"10.1.2.3:{annotated}"
        pool = next(r for r in relabel if r.get("target_label") == "pool")["source_labels"][0]
        assert pod_meta[pool] in {"frontend", "prefill", "decode", "etcd"}


def test_promtool_checks_the_kubernetes_relabelling(promtool: str, tmp_path: Path) -> None:
    # Debian's promtool is built without Kubernetes discovery, so the rest of the config (relabel
    # regexes and actions) is checked on a static job instead.
    config = yaml.safe_load((PROM_DIR / "prometheus-k8s.yml").read_text())
    del config["scrape_configs"][0]["kubernetes_sd_configs"]
    config["scrape_configs"][0]["static_configs"] = [{"targets": ["127.0.0.1:1"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(PROM_DIR / "rules.yml", tmp_path / "rules.yml")
    assert "SUCCESS" in _promtool(promtool, "check", "config", "prometheus.yml", cwd=tmp_path)


def _sanitize(name: str) -> str:
    """Kubernetes SD's label-name sanitizing: every character outside [a-zA-Z0-9_] becomes '_'."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def test_rules_use_only_catalogued_metrics() -> None:
    """Every metric the rules read is documented in deploy/prometheus/README.md's catalogue."""
    catalogue = set(re.findall(r"^\| `(pdserve_[a-z0-9_]+)`", (PROM_DIR / "README.md").read_text(), re.M))
    assert len(catalogue) >= 25
    rules = yaml.safe_load((PROM_DIR / "rules.yml").read_text())
    used: set[str] = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            for name in re.findall(r"(?<![:\w])(pdserve_[a-z0-9_]+)", rule["expr"]):
                used.add(re.sub(r"_(bucket|sum|count)$", "", name))
    assert used, "no metrics found in the rules"
    assert used <= catalogue, f"not in the README catalogue: {sorted(used - catalogue)}"
