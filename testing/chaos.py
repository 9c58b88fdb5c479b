"""Chaos run: steady streaming load through the real frontend on a 2 prefill + 2 decode cluster (tiny
model, real etcd, real node processes, the real openai SDK) while nodes are SIGKILLed and restarted,
one is SIGSTOPped past its lease, and etcd is restarted. Every request is greedy with a known reference
(the single-process engine's tokens for the same token-id prompt), so what reaches each client can be
checked token for token: nothing failed, duplicated or lost. At the end every node must hold zero KV
blocks and pass its integrity check.

`run_chaos(ChaosConfig(...))` returns a `ChaosReport`; `bench/chaos.py` is the command line (the long
version adds per-process memory growth) and `tests/test_chaos.py` the quick version in the suite.
"""

from __future__ import annotations

import difflib
import random
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiny import default_model_dir
from pdserve.engine.tokenizer import Tokenizer
from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend
from testing.threads import start_thread


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run's shape."""

    workdir: Path
    duration_s: float = 60.0  # how long the load and the faults run
    clients: int = 16  # concurrent streaming clients
    num_prompts: int = 48  # distinct prompts (each with its reference)
    prompt_tokens: tuple[int, int] = (24, 160)  # prompt length range (some prefilled remotely, some not)
    max_tokens: tuple[int, int] = (24, 96)
    fault_interval_s: tuple[float, float] = (3.0, 6.0)  # pause between two faults
    down_s: tuple[float, float] = (0.5, 2.0)  # how long a killed node stays down before its restart
    lease_ttl_s: int = 3
    etcd_restart: bool = True
    sigstop: bool = True
    seed: int = 0
    sample_memory: bool = False  # sample every process's RSS (the long version's memory-growth report)
    frontend_args: tuple[str, ...] = ()
    node_args: tuple[str, ...] = ("--num-threads", "1", "--num-kv-blocks", "768", "--block-size", "16")
    decode_args: tuple[str, ...] = ("--local-prefill-threshold", "48", "--prefill-timeout", "2")

    def __post_init__(self) -> None:
        assert self.duration_s > 0 and self.clients >= 1 and self.num_prompts >= 1
        assert self.prompt_tokens[0] >= 1 and self.max_tokens[0] >= 1


@dataclass
class Outcome:
    """What one client request got, against its reference."""

    prompt_index: int
    ok: bool  # finished normally with exactly the reference's text
    error: str = ""  # the error the client saw (failed requests)
    lost: int = 0  # reference tokens missing from what arrived
    duplicated: int = 0  # tokens that arrived more often than the reference has them


@dataclass
class ChaosReport:
    completed: int = 0
    failed: int = 0
    mismatched: int = 0
    tokens_lost: int = 0
    tokens_duplicated: int = 0
    faults: dict[str, int] = field(default_factory=dict)  # fault kind -> times injected
    counters: dict[str, float] = field(default_factory=dict)  # retried, re-prefilled, migrated, ...
    kv_blocks_used: dict[str, int] = field(default_factory=dict)  # node -> used blocks at the end
    integrity: str = "ok"
    memory_growth: dict[str, float] = field(default_factory=dict)  # process -> RSS growth ratio
    memory_mib: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # process -> (base, max, last)
    errors: list[str] = field(default_factory=list)  # distinct client errors (first few)

    def problems(self) -> list[str]:
        """Every way this run missed its targets (empty: 0 failed, 0 duplicated, 0 lost, 0 leaked)."""
        out = []
        if self.failed:
            out.append(f"{self.failed} failed: {self.errors[:3]}")
        if self.mismatched or self.tokens_lost or self.tokens_duplicated:
            out.append(f"{self.mismatched} mismatched ({self.tokens_lost} tokens lost, "
                       f"{self.tokens_duplicated} duplicated)")
        leaked = {n: b for n, b in self.kv_blocks_used.items() if b}
        if leaked:
            out.append(f"KV blocks still used: {leaked}")
        if self.integrity != "ok":
            out.append(f"integrity: {self.integrity}")
        return out

    def lines(self) -> list[str]:
        w = 38
        out = [
            f"{'requests completed':<{w}}{self.completed}",
            f"{'requests failed':<{w}}{self.failed}",
            f"{'text mismatches':<{w}}{self.mismatched} (tokens lost {self.tokens_lost}, "
            f"duplicated {self.tokens_duplicated})",
            f"{'faults injected':<{w}}" + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())),
        ]
        out += [f"{name:<{w}}{value:g}" for name, value in sorted(self.counters.items())]
        out.append(f"{'KV blocks used at the end':<{w}}"
                   + ", ".join(f"{n} {b}" for n, b in sorted(self.kv_blocks_used.items())))
        out.append(f"{'integrity':<{w}}{self.integrity}")
        for name, growth in sorted(self.memory_growth.items()):
            base, peak, last = self.memory_mib[name]
            out.append(f"{'RSS ' + name:<{w}}{growth:+.1%} (after warm-up {base:.0f} MiB, max {peak:.0f}, "
                       f"last {last:.0f})")
        if self.errors:
            out += [f"{'client error':<{w}}{e}" for e in self.errors[:5]]
        return out


# Counters summed over every process lifetime (a restarted node starts from zero again).
NODE_COUNTERS = {
    "re-prefilled (before the first token)": "pdserve_decode_local_prefill_fallbacks_total",
    "re-prefilled (after the first token)": "pdserve_decode_reprefills_total",
    "KV checksum failures": "pdserve_decode_kv_checksum_failures_total",
}
FRONTEND_COUNTERS = {
    "migrated": "pdserve_frontend_migrations_total",
    "retried (other decode node)": "pdserve_frontend_upstream_retries_total",
}


def scrape(address: str) -> dict[str, float]:
    """Sample name -> value summed over label sets, from one /metrics endpoint ({} when unreachable)."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=3) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _CounterBook:
    """Counters per process lifetime: the last value seen of each (process, pid), summed at the end."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, int, str], float] = {}
        self._lock = threading.Lock()

    def record(self, process: str, pid: int, values: dict[str, float]) -> None:
        with self._lock:
            for name, value in values.items():
                self._last[(process, pid, name)] = value

    def total(self, name: str) -> float:
        with self._lock:
            return sum(v for (_, _, n), v in self._last.items() if n == name)


class ChaosRun:
    """One run: the cluster, the frontend, the clients and the fault thread."""

    def __init__(self, config: ChaosConfig, log: Callable[[str], None] = print) -> None:
        self.config = config
        self.log = log
        self.rng = random.Random(config.seed)
        self.model_dir = default_model_dir("llama")
        self.tokenizer = Tokenizer(self.model_dir)
        self.prompts, self.references = self._references()
        self.outcomes: list[Outcome] = []
        self.report = ChaosReport()
        self.book = _CounterBook()
        self._stop = threading.Event()  # the load and the faults end
        # Fault kinds not yet injected once: the run goes on past duration_s (up to 3x) until they all were,
        # so a slow machine, where restarted nodes take long to come back, still covers every kind.
        self._pending: list[str] = []
        self._overtime = threading.Event()  # past duration_s: only pending kinds are injected, no more kills
        self._watching = threading.Event()  # set while the observer thread should keep scraping
        self._lock = threading.Lock()
        self.cluster: LocalCluster | None = None
        self.frontend: FrontendProc | None = None
        self._rss: dict[str, list[int]] = {}  # "name/pid" -> samples

    def _references(self) -> tuple[list[list[int]], list[list[int]]]:
        cfg = self.config
        engine = LLMEngine(EngineConfig(model=str(self.model_dir), dtype="float32", num_kv_blocks=1024, num_threads=1))
        vocab = engine.model_config.vocab_size
        prompts, params = [], []
        for _ in range(cfg.num_prompts):
            n = self.rng.randint(*cfg.prompt_tokens)
            prompts.append([self.rng.randrange(5, vocab - 1) for _ in range(n)])
            params.append(SamplingParams(max_tokens=self.rng.randint(*cfg.max_tokens), temperature=0.0, ignore_eos=True))
        outs = [engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
        return prompts, outs

    # -- the run --------------------------------------------------------------------------------------

    def run(self) -> ChaosReport:
        cfg = self.config
        with LocalCluster(cfg.workdir / "cluster", self.model_dir, lease_ttl_s=cfg.lease_ttl_s,
                          node_args=list(cfg.node_args)) as cluster:
            self.cluster = cluster
            cluster.start(2, 2, decode_args=list(cfg.decode_args))
            self.frontend = start_frontend(
                "frontend", cfg.workdir, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                "--model", f"{self.model_dir.name}={self.model_dir}", "--request-log", "off", "--log-level", "warning",
                *cfg.frontend_args)
            try:
                self._load_and_faults()
                self._settle()
            finally:
                self.frontend.stop()
        return self.report

    def _load_and_faults(self) -> None:
        cfg = self.config
        self._watching.set()
        watcher = start_thread(self._watch, name="chaos-watch")
        clients = [start_thread(self._client, i, name=f"chaos-client-{i}") for i in range(cfg.clients)]
        faults = start_thread(self._faults, name="chaos-faults")
        start = time.monotonic()
        deadline, cap = start + cfg.duration_s, start + 3 * cfg.duration_s
        while not faults.done() and (time.monotonic() < deadline or (self._pending and time.monotonic() < cap)):
            if time.monotonic() >= deadline:
                self._overtime.set()
            time.sleep(0.2)  # the poll interval
        self._stop.set()
        faults.result(timeout=120)  # re-raises a harness failure (a node that did not come back)
        for c in clients:
            c.result(timeout=300)
        self._watching.clear()
        watcher.result(timeout=30)

    def _settle(self) -> None:
        """Every node back, idle and clean: the end-of-run accounting."""
        assert self.cluster is not None
        cluster = self.cluster
        for node_id in list(cluster.nodes):
            cluster.kill(node_id, signal.SIGCONT)
        self._scrape_all()
        try:
            loads = cluster.wait_clean(timeout_s=60)
            self.report.kv_blocks_used = {n: load.kv_blocks_used for n, load in loads.items()}
        except AssertionError as err:
            self.report.integrity = str(err)[:500]
            self.report.kv_blocks_used = {n: cluster.get_load(n).kv_blocks_used for n, node in cluster.nodes.items()
                                          if node.alive}
        r = self.report
        for o in self.outcomes:
            if o.error:
                r.failed += 1
                if o.error not in r.errors and len(r.errors) < 10:
                    r.errors.append(o.error)
            elif not o.ok:
                r.mismatched += 1
            else:
                r.completed += 1
            r.tokens_lost += o.lost
            r.tokens_duplicated += o.duplicated
        for label, name in {**NODE_COUNTERS, **FRONTEND_COUNTERS}.items():
            r.counters[label] = self.book.total(name)
        if self.config.sample_memory:
            r.memory_growth, r.memory_mib = self._memory_growth()

    # -- clients --------------------------------------------------------------------------------------

    def _client(self, index: int) -> None:
        import openai

        assert self.frontend is not None
        # No SDK retries: a request the cluster fails must count as failed, not be hidden by a retry.
        client = openai.OpenAI(base_url=f"{self.frontend.base_url}/v1", api_key="chaos", max_retries=0, timeout=120)
        rng = random.Random(self.config.seed * 1000 + index)
        while not self._stop.is_set():
            i = rng.randrange(len(self.prompts))
            outcome = self._one(client, i)
            with self._lock:
                self.outcomes.append(outcome)

    def _one(self, client: Any, i: int) -> Outcome:
        import openai

        ref = self.references[i]
        text: list[str] = []
        finish = None
        try:
            stream = client.completions.create(
                model=self.model_dir.name, prompt=self.prompts[i], max_tokens=len(ref), temperature=0.0, stream=True,
                extra_body={"ignore_eos": True})
            for chunk in stream:
                for choice in chunk.choices:
                    text.append(choice.text)
                    finish = choice.finish_reason or finish
        except openai.APIError as err:
            return Outcome(i, False, error=f"{type(err).__name__}: {err}"[:300])
        got = "".join(text)
        expected = self.tokenizer.decode(ref)
        if got == expected and finish == "length":
            return Outcome(i, True)
        lost, duplicated = _token_diff(ref, self.tokenizer.encode(got, add_special_tokens=False))
        return Outcome(i, False, lost=lost, duplicated=duplicated,
                       error="" if finish == "length" else f"finish_reason {finish!r}")

    # -- faults ---------------------------------------------------------------------------------------

    def _faults(self) -> None:
        """Injects faults until the run's end, never taking a pool's last live node: a killed node is
        restarted in the background, and its pool takes no other fault until it is back."""
        cfg = self.config
        kinds = ["kill_decode", "kill_prefill"]
        # Every kind once first (a short run covers them all), then random kills.
        pending = self._pending
        pending[:] = [*kinds, *(["sigstop"] if cfg.sigstop else []), *(["etcd_restart"] if cfg.etcd_restart else [])]
        while not self._stop.wait(self.rng.uniform(*cfg.fault_interval_s)):
            # The first pending kind that can be injected now (its pool has every node up), else a kill.
            extra = [] if self._overtime.is_set() else [self.rng.choice(kinds)]
            for kind in [*pending, *extra]:
                if self._inject(kind):
                    if kind in pending:
                        pending.remove(kind)
                    self.report.faults[kind] = self.report.faults.get(kind, 0) + 1
                    break
        assert self.cluster is not None
        self.cluster.wait_ready([n for n in self.cluster.nodes.values()], timeout_s=180)

    def _up(self, node_id: str) -> bool:
        assert self.cluster is not None
        node = self.cluster.nodes[node_id]
        return node.alive and node.ready.is_set() and not self.cluster.is_stopped(node_id)

    def _inject(self, kind: str) -> bool:
        """Injects one fault; False when it cannot be injected now (its pool has a node down)."""
        assert self.cluster is not None
        cluster, cfg = self.cluster, self.config
        if kind == "etcd_restart":
            assert cluster.etcd is not None
            self.log("chaos: restarting etcd")
            cluster.etcd.stop()
            time.sleep(self.rng.uniform(*cfg.down_s))  # the outage's length
            cluster.etcd.start()
            return True
        if kind == "sigstop":  # a node of a pool that has every node up
            roles = [r for r in ("prefill", "decode")
                     if all(self._up(n) for n, node in cluster.nodes.items() if node.role == r)]
            if not roles:
                return False
            role = self.rng.choice(roles)
        else:
            role = "prefill" if kind == "kill_prefill" else "decode"
        pool = [n for n, node in cluster.nodes.items() if node.role == role]
        if not all(self._up(n) for n in pool):
            return False  # a node of this pool is still down: it keeps its last live one
        node_id = self.rng.choice(pool)
        node = cluster.nodes[node_id]
        self._scrape_node(node_id)
        if kind == "sigstop":
            self.log(f"chaos: SIGSTOP {node_id} for {cfg.lease_ttl_s + 1.5:.1f}s (past its lease)")
            cluster.kill(node_id, signal.SIGSTOP)
            time.sleep(cfg.lease_ttl_s + 1.5)  # the fault's length: the lease lapses meanwhile
            cluster.kill(node_id, signal.SIGCONT)
            return True
        self.log(f"chaos: SIGKILL {node_id}")
        cluster.kill(node_id, signal.SIGKILL)
        time.sleep(self.rng.uniform(*cfg.down_s))  # how long it stays down before its restart begins
        extra = list(cfg.decode_args) if role == "decode" else []
        cluster.spawn_node(node.role, node_id, extra)  # ready in the background (`_up` watches for it)
        return True

    # -- observation ----------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Scrapes counters (and RSS) every second, so a killed node's counts are not lost with it."""
        while self._watching.is_set():
            self._scrape_all()
            time.sleep(1.0)  # the sampling period

    def _scrape_all(self) -> None:
        assert self.cluster is not None and self.frontend is not None
        for node_id in list(self.cluster.nodes):
            self._scrape_node(node_id)
        fe = self.frontend
        self.book.record("frontend", fe.proc.popen.pid, scrape(f"{fe.host}:{fe.port}"))
        if self.config.sample_memory:
            self._rss.setdefault(f"frontend/{fe.proc.popen.pid}", []).append(rss_bytes(fe.proc.popen.pid))
            etcd = self.cluster.etcd
            if etcd is not None and etcd.pid:
                self._rss.setdefault(f"etcd/{etcd.pid}", []).append(rss_bytes(etcd.pid))

    def _scrape_node(self, node_id: str) -> None:
        assert self.cluster is not None
        node = self.cluster.nodes[node_id]
        if not node.alive or self.cluster.is_stopped(node_id) or "metrics_address" not in node.info:
            return
        self.book.record(node_id, node.proc.pid, scrape(str(node.info["metrics_address"])))
        if self.config.sample_memory:
            self._rss.setdefault(f"{node_id}/{node.proc.pid}", []).append(rss_bytes(node.proc.pid))

    def _memory_growth(self) -> tuple[dict[str, float], dict[str, tuple[float, float, float]]]:
        """RSS growth of each process over its life after a warm-up (the first quarter of its samples,
        at least 30): last sample against the median of the samples just after the warm-up; and the
        (base, max, last) RSS in MiB behind it."""
        growth, mib = {}, {}
        for name, samples in self._rss.items():
            samples = [s for s in samples if s]
            if len(samples) < 60:
                continue  # too short a life to say anything
            warm = samples[max(30, len(samples) // 4):]
            base = sorted(warm[:10])[len(warm[:10]) // 2]
            growth[name] = samples[-1] / base - 1.0
            mib[name] = (base / 2**20, max(warm) / 2**20, samples[-1] / 2**20)
        return growth, mib


def _token_diff(expected: list[int], got: list[int]) -> tuple[int, int]:
    """(tokens of `expected` missing from `got`, tokens of `got` beyond `expected`), by a diff."""
    lost = duplicated = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=expected, b=got, autojunk=False).get_opcodes():
        if op in ("delete", "replace"):
            lost += i2 - i1
        if op in ("insert", "replace"):
            duplicated += j2 - j1
    return lost, duplicated


def run_chaos(config: ChaosConfig, log: Callable[[str], None] = print) -> ChaosReport:
    return ChaosRun(config, log).run()


__all__ = ["ChaosConfig", "ChaosReport", "run_chaos"]
