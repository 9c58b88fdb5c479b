"""`pdserve up`'s configuration: the validated `LauncherConfig` (and `build_config`, from the CLI flags),
and `ClusterState`, the cluster.json through which `pdserve status` finds a running cluster."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.node_common.pinning import parse_cpus, split_cpus

if TYPE_CHECKING:
    from pdserve.deploy.launcher.autoscaling import AutoscaleOptions
    from pdserve.engine.default_model import ResolvedModel

REPO_ROOT = Path(__file__).resolve().parents[2]
POOLS = ("etcd", "prefill", "decode", "frontend")
# Unpinned nodes share this machine's cores: a decode node prefills a new request itself once its requests
# queued at the prefill node hold this many context tokens (and its own prefill backlog is shorter).
DEFAULT_LOCAL_MAX_PREFILL_QUEUE_TOKENS = 2048


def default_runs_dir() -> Path:
    """`runs/` in the repository root when running from a checkout, else in the working directory."""
    return REPO_ROOT / "runs" if (REPO_ROOT / "pyproject.toml").is_file() else Path.cwd() / "runs"


def write_json_atomic(path: Path, data: object) -> None:
    """Writes JSON to a temporary file beside `path`, then renames it over `path` (readers never see
    half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@dataclass(frozen=True)
class LauncherConfig:
    """Everything `pdserve up` was asked for; validated once."""

    model: str  # HF model directory
    model_name: str = ""  # the pool (and served) model name; "" = the directory's name
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"  # the frontend's address
    port: int = 8000
    dtype: str = "auto"
    kv_memory_mib: int = 512  # KV cache budget of each node
    kv_cache_dtype: str = "auto"  # KV cache element type of every node (they must agree)
    speculative: str = "off"  # every node's --speculative (engine.speculative.SPECULATIVE_METHODS)
    num_speculative_tokens: int = 4
    kv_tier_gib: float = 0.0  # each node's --kv-tier-gib, its tier in cluster_dir/kv-tier/<node> (0: no tier)
    prefill_tp: int = 1  # the prefill nodes' --tensor-parallel-size (ranks per node)
    decode_tp: int = 1
    # torch threads per node; None = `node_threads`' rule: with `pin` the size of the node's CPU set,
    # unpinned the usable CPUs divided among the nodes of the node's pool.
    num_threads: int | None = None
    # Pin each node to its own CPUs (`node_cpus`): the usable CPUs split evenly over the nodes, prefill
    # nodes first. The frontend and etcd stay unpinned. Makes shapes comparable on one machine.
    pin: bool = False
    cpus: tuple[int, ...] = ()  # the CPUs `pin` splits; () = every CPU this process may use
    # Decode nodes' --max-prefill-queue-tokens (conditional disaggregation). None: the launcher's default,
    # DEFAULT_LOCAL_MAX_PREFILL_QUEUE_TOKENS when unpinned (the nodes share every core, so a decode node
    # that prefills while the prefill node is backed up uses cores that would otherwise sit idle), else 0.
    max_prefill_queue_tokens: int | None = None
    cluster: str = "default"
    runs_dir: Path = field(default_factory=default_runs_dir)
    lease_ttl_s: int = 3  # a killed node leaves the registry this fast
    drain_timeout_s: float = 20.0  # per node, at Ctrl-C
    startup_timeout_s: float = 600.0  # model loading on a slow disk or a cold cache
    restart: bool = True
    node_args: tuple[str, ...] = ()  # extra flags for every node
    frontend_args: tuple[str, ...] = ()  # extra flags for the frontend
    limits_redis: str = ""  # the frontend's --limits-redis ("" none)
    # Tracing of every process ("" = what $OTEL_EXPORTER_OTLP_ENDPOINT, inherited, says; unset: off).
    otlp_endpoint: str = ""
    trace_sample_ratio: float = 1.0
    python: str = sys.executable
    autoscale: AutoscaleOptions | None = None  # --autoscale: the controller starts and drains nodes

    def __post_init__(self) -> None:
        checks = [
            (Path(self.model).is_dir(), f"model directory {self.model!r} does not exist"),
            (self.num_prefill >= 0, "--prefill must be >= 0"),
            (self.num_decode >= 1, "--decode must be >= 1 (decode nodes serve every request)"),
            (0 < self.port < 65536, f"--port must be in [1, 65535], got {self.port}"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), f"bad --dtype {self.dtype!r}"),
            (self.kv_memory_mib >= 1, "--kv-memory must be >= 1 MiB"),
            (self.kv_cache_dtype in ("auto", "fp8_e5m2", "fp8_e4m3"), f"bad --kv-cache-dtype {self.kv_cache_dtype!r}"),
            (self.speculative in ("off", "ngram", "suffix"), f"bad --speculative {self.speculative!r}"),
            (1 <= self.num_speculative_tokens <= 16, "--num-speculative-tokens must be in [1, 16]"),
            (self.kv_tier_gib >= 0, "--kv-tier-gib must be >= 0"),
            (self.num_threads is None or self.num_threads >= 1, "--num-threads must be >= 1"),
            (1 <= self.prefill_tp <= 64 and 1 <= self.decode_tp <= 64, "--tp/--prefill-tp/--decode-tp must be in [1, 64]"),
            (set(self.cpus) <= os.sched_getaffinity(0), f"--cpus {self.cpus} are not all usable here"),
            (not self.cpus or self.pin, "--cpus needs --pin"),
            (self.max_prefill_queue_tokens is None or self.max_prefill_queue_tokens >= 0,
             "--max-prefill-queue-tokens must be >= 0"),
            (bool(self.cluster) and "/" not in self.cluster, f"bad --cluster {self.cluster!r}"),
            (self.lease_ttl_s >= 1, "lease TTL must be >= 1 s"),
            (self.drain_timeout_s >= 0 and self.startup_timeout_s > 0, "timeouts must be positive"),
            (0.0 <= self.trace_sample_ratio <= 1.0, "--trace-sample-ratio must be in [0, 1]"),
            (not self.limits_redis or self.limits_redis.startswith(("redis://", "rediss://", "unix://")),
             f"--limits-redis must be a redis://, rediss:// or unix:// URL, got {self.limits_redis!r}"),
            (not self.otlp_endpoint or self.otlp_endpoint.startswith(("http://", "https://")),
             f"--otlp-endpoint must be an http(s) URL, got {self.otlp_endpoint!r}"),
        ]
        if self.autoscale is not None:
            checks += [
                (self.autoscale.node_budget >= self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp,
                 f"--node-budget {self.autoscale.node_budget} is below the starting shape's "
                 f"{self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp} node ranks"),
                (not self.pin, "--autoscale does not pin (--pin splits the CPUs over a fixed set of nodes)"),
                (self.autoscale.profile.is_file(), f"--autoscale needs a profile: {self.autoscale.profile} does not "
                                                   f"exist (run `pdserve profile --out FILE` on this machine)"),
                (bool(self.autoscale.slo), "--autoscale needs --autoscale-slo (e.g. ttft_p90=1s,tpot_p99=50ms)"),
                (self.autoscale.overheads is None or self.autoscale.overheads.is_file(),
                 f"--autoscale-overheads {self.autoscale.overheads} does not exist"),
            ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"pdserve up: {msg}")
        if not self.model_name:
            object.__setattr__(self, "model_name", Path(self.model).resolve().name)

    @property
    def node_names(self) -> list[str]:
        return [f"prefill-{i}" for i in range(self.num_prefill)] + [f"decode-{i}" for i in range(self.num_decode)]

    def node_cpus(self) -> dict[str, tuple[int, ...]]:
        """Each node's CPU set under `pin` (empty without it)."""
        if not self.pin:
            return {}
        sets = split_cpus(self.cpus or tuple(sorted(os.sched_getaffinity(0))), len(self.node_names))
        return dict(zip(self.node_names, sets, strict=True))

    @property
    def decode_max_prefill_queue_tokens(self) -> int:
        """What the decode nodes get as --max-prefill-queue-tokens."""
        if self.max_prefill_queue_tokens is not None:
            return self.max_prefill_queue_tokens
        return 0 if self.pin or self.num_prefill == 0 else DEFAULT_LOCAL_MAX_PREFILL_QUEUE_TOKENS

    def node_threads(self, name: str) -> int:
        """torch threads of the named node: --num-threads, else pinned the node's CPU count, else the
        usable CPUs divided among its pool's nodes. Unpinned nodes share every core: a pool's nodes work
        at the same time, the two pools largely in turn (prompts first, then their streams), so a decode
        node alone after the last prompt has all the cores instead of leaving the prefill node's idle
        (bench/cluster_bench.py measures the split). When both pools are busy the kernel shares the cores
        between the nodes' sessions fairly."""
        if self.num_threads is not None:
            return self.num_threads
        tp = self.node_tp(name)  # each rank runs this many threads
        if self.pin:
            return max(1, (len(self.node_cpus().get(name, ())) or 1) // tp)
        pool = self.num_prefill if name.startswith("prefill") else self.num_decode
        return max(1, len(os.sched_getaffinity(0)) // max(1, pool) // tp)

    def node_tp(self, name: str) -> int:
        """The named node's tensor-parallel width."""
        return self.prefill_tp if name.startswith("prefill") else self.decode_tp

    @property
    def cluster_dir(self) -> Path:
        return self.runs_dir / self.cluster

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class ClusterState:
    """The contents of `cluster.json`: how `pdserve status` finds a running `pdserve up`."""

    cluster: str
    launcher_pid: int
    etcd_endpoints: list[str]
    url: str
    model: str
    started_at: float
    processes: list[dict[str, Any]]  # name, pool, pid, metrics, log, restarts

    @staticmethod
    def path(runs_dir: Path, cluster: str) -> Path:
        return runs_dir / cluster / "cluster.json"

    @classmethod
    def load(cls, runs_dir: Path, cluster: str) -> ClusterState | None:
        """The state of a launcher that is still running, else None."""
        try:
            obj = json.loads(cls.path(runs_dir, cluster).read_text(encoding="utf-8"))
            state = cls(**obj)
        except (OSError, ValueError, TypeError):
            return None
        return state if pid_alive(state.launcher_pid) else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def build_config(args: Any, resolve_model: Callable[[str | None], ResolvedModel]) -> LauncherConfig:
    """The LauncherConfig from `pdserve up` flags. `resolve_model(args.model)` turns the --model value into
    a directory and a served name (`engine.default_model.resolve_model`: fetches the default model
    before anything starts); --model-name overrides the name."""
    model = resolve_model(args.model)
    return LauncherConfig(
        model=str(model.path), model_name=args.model_name or model.name, num_prefill=args.prefill,
        num_decode=args.decode, host=args.host, port=args.port, dtype=args.dtype, kv_memory_mib=args.kv_memory,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        speculative=getattr(args, "speculative", "off"), num_speculative_tokens=getattr(args, "num_speculative_tokens", 4),
        kv_tier_gib=getattr(args, "kv_tier_gib", 0.0),
        num_threads=args.num_threads, pin=bool(getattr(args, "pin", False)),
        prefill_tp=getattr(args, "prefill_tp", None) or 1, decode_tp=getattr(args, "decode_tp", None) or 1,
        max_prefill_queue_tokens=getattr(args, "max_prefill_queue_tokens", None),
        cpus=parse_cpus(args.cpus) if getattr(args, "cpus", None) else (), cluster=args.cluster,
        runs_dir=Path(args.runs_dir) if args.runs_dir else default_runs_dir(), lease_ttl_s=args.lease_ttl,
        drain_timeout_s=args.drain_timeout, restart=not args.no_restart,
        node_args=tuple(args.node_arg or ()), frontend_args=tuple(args.frontend_arg or ()),
        limits_redis=getattr(args, "limits_redis", "") or "",
        otlp_endpoint=getattr(args, "otlp_endpoint", "") or "", trace_sample_ratio=getattr(args, "trace_sample_ratio", 1.0),
        autoscale=_autoscale_options(args),
    )


def _autoscale_options(args: Any) -> AutoscaleOptions | None:
    """--autoscale's flags (None without --autoscale; the controller's other flags then must not be given)."""
    if not getattr(args, "autoscale", False):
        if getattr(args, "node_budget", None) is not None:
            raise ValueError("pdserve up: --node-budget needs --autoscale")
        return None
    from pdserve.deploy.launcher.autoscaling import AutoscaleOptions

    if args.node_budget is None:
        raise ValueError("pdserve up: --autoscale needs --node-budget N (the most nodes it may run)")
    if not args.autoscale_profile:
        raise ValueError("pdserve up: --autoscale needs --autoscale-profile FILE (from `pdserve profile`)")
    return AutoscaleOptions(Path(args.autoscale_profile), args.autoscale_slo or "", args.node_budget,
                            args.autoscale_attainment, args.autoscale_interval, args.autoscale_window,
                            args.autoscale_cooldown, args.autoscale_band, args.allow_other_machine,
                            Path(args.autoscale_overheads) if getattr(args, "autoscale_overheads", None) else None)
