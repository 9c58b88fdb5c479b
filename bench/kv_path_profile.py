"""Where the KV path's extra CPU goes, against raw send/recv of the same messages, by perf.

kv_transfer_bench.py times the path (KVSender.send -> KVReceiver.recv) against raw send/recv and splits
the path's own stages; this script accounts for all the CPU, the threads gloo owns and the kernel
included. It runs `--transfers` back-to-back transfers of one prompt (default: 1,024 tokens of the
default model's geometry, whole-request mode, 1 MiB messages) twice, raw and then path, each in a
fresh pair of processes from kv_transfer_bench, under

  perf record -a -e cpu-clock -F 1999   samples of every thread on both cores, and
  perf stat -a -e <syscalls>            system calls and context switches,

with perf enabled only around the timed transfers (its control FIFO), so start-up and warm-up are not
counted. It prints CPU milliseconds per transfer by category (raw, path, path - raw) and system calls
per transfer. Idle is the cores' idle time: wall time the two processes left unused.

Needs `perf` on PATH and system-wide sampling (root, or kernel.perf_event_paranoid <= -1).

    .venv/bin/python bench/kv_path_profile.py [--tokens 1024] [--transfers 200] [--layerwise]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FREQ = 1999  # samples per second per core
SYSCALLS = ("syscalls:sys_enter_epoll_wait", "syscalls:sys_enter_writev", "syscalls:sys_enter_recvfrom",
            "syscalls:sys_enter_futex", "context-switches")
CATEGORIES = (
    "copies into and out of staging (memcpy)",
    "xxh3 digests",
    "socket data copies (kernel)",
    "gloo I/O threads: epoll loop, syscalls",
    "python threads in the kernel: wake-ups, futex",
    "python threads in user space: interpreter, torch",
    "other processes",
    "idle",
)


def category(comm: str, dso: str, sym: str) -> str:
    """The category of one perf sample's (thread name, object, symbol)."""
    kernel = "kernel" in dso
    if comm == "swapper":
        return "idle"
    if not kernel and ("memmove" in sym or "memcpy" in sym):
        return CATEGORIES[0]
    if "XXH" in sym:
        return CATEGORIES[1]
    if kernel and ("copy_from_iter" in sym or "copy_to_iter" in sym or "copy_user" in sym):
        return CATEGORIES[2]
    if comm == "gloo_tcp_loop":
        return CATEGORIES[3]
    if comm.startswith("python") or comm.startswith("pt_"):
        return CATEGORIES[4] if kernel else CATEGORIES[5]
    return CATEGORIES[6]


# --------------------------------------------------------------------------- one phase, under perf
def phase(mode: str, tokens: int, transfers: int, layerwise: bool, ctl: str, ack: str) -> None:
    """Set up a pair of processes, warm up, then time `transfers` transfers of `mode` with perf enabled."""
    import gc

    import kv_transfer_bench as kb

    gc.freeze()  # as kv_transfer_bench does: no full collection inside the timed part
    case = kb.Case(kb.SMOLLM2, tokens)
    bench = kb.Bench(1 << 20)
    try:
        kv, src, dst = bench.setup(case)
        sizes = bench.message_sizes(case, layerwise)
        bench.path(kv, src, dst, 4, layerwise=layerwise)
        bench.raw(sizes, 4)
        with open(ctl, "w") as c, open(ack) as a:
            c.write("enable\n")
            c.flush()
            a.readline()
            t0 = time.perf_counter()
            if mode == "raw":
                _, (cpu_s, cpu_r) = bench.raw(sizes, transfers)
            else:
                _, _, _, (cpu_s, cpu_r) = bench.path(kv, src, dst, transfers, layerwise=layerwise)
            wall = time.perf_counter() - t0
            c.write("disable\n")
            c.flush()
            a.readline()
        print(json.dumps({"wall": wall, "cpu": sum(cpu_s) + sum(cpu_r)}))
    finally:
        bench.close()


def run_under(perf_args: list[str], tmp: Path, mode: str, args: argparse.Namespace) -> dict:
    """Run one phase as a child of `perf <perf_args>`; its JSON line (wall and process CPU seconds)."""
    ctl, ack = tmp / f"{mode}.ctl", tmp / f"{mode}.ack"
    for f in (ctl, ack):
        f.unlink(missing_ok=True)
        os.mkfifo(f)
    child = [sys.executable, __file__, "--phase", mode, "--tokens", str(args.tokens), "--transfers",
             str(args.transfers), "--ctl", str(ctl), "--ack", str(ack)] + (["--layerwise"] if args.layerwise else [])
    out = subprocess.run(["perf", *perf_args, "-D", "-1", "--control", f"fifo:{ctl},{ack}", "--", *child],
                         capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.exit(f"perf {perf_args[0]} of the {mode} phase failed (rc {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def samples(data: Path) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Samples by category, and by "thread name: symbol"."""
    rep = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "-n", "--sort",
                          "comm,dso,sym", "-t", "|"], capture_output=True, text=True, check=True).stdout
    by_cat: collections.Counter[str] = collections.Counter()
    by_sym: collections.Counter[str] = collections.Counter()
    for line in rep.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if line.startswith("#") or len(parts) < 5 or not parts[1].isdigit():
            continue
        by_cat[category(parts[2], parts[3], parts[4])] += int(parts[1])
        by_sym[f"{parts[2]}: {parts[4]}"] += int(parts[1])
    return by_cat, by_sym


def syscall_counts(path: Path) -> dict[str, int]:
    counts = {}
    for line in path.read_text().splitlines():
        parts = line.split(",")
        if line.startswith("#") or len(parts) < 3 or not parts[0].strip().isdigit():
            continue
        counts[parts[2]] = int(parts[0])
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--transfers", type=int, default=200)
    ap.add_argument("--layerwise", action="store_true", help="layer-by-layer sends (one message per layer group)")
    ap.add_argument("--top", type=int, default=15, help="symbols listed by their path - raw difference")
    ap.add_argument("--phase", choices=["raw", "path"], help=argparse.SUPPRESS)
    ap.add_argument("--ctl", help=argparse.SUPPRESS)
    ap.add_argument("--ack", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        phase(args.phase, args.tokens, args.transfers, args.layerwise, args.ctl, args.ack)
        return
    if shutil.which("perf") is None:
        sys.exit("perf is not on PATH (Debian: apt install linux-perf)")
    n = args.transfers
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cpu: dict[str, collections.Counter[str]] = {}
        syms: dict[str, collections.Counter[str]] = {}
        calls: dict[str, dict[str, int]] = {}
        walls: dict[str, float] = {}
        for mode in ("raw", "path"):
            data = tmp / f"{mode}.data"
            res = run_under(["record", "-a", "-e", "cpu-clock", "-F", str(FREQ), "-o", str(data)], tmp, mode, args)
            walls[mode] = res["wall"]
            cpu[mode], syms[mode] = samples(data)
            stat = tmp / f"{mode}.stat"
            run_under(["stat", "-a", "-x", ",", "-e", ",".join(SYSCALLS), "-o", str(stat)], tmp, mode, args)
            calls[mode] = syscall_counts(stat)
    ms = 1e3 / FREQ / n  # one sample, in ms per transfer
    how = "layer-by-layer" if args.layerwise else "whole-request, 1 MiB messages"
    print(f"KV path against raw send/recv, {args.tokens} tokens of the default model ({how}), {n} transfers each; "
          f"perf cpu-clock at {FREQ} Hz on all cores")
    print(f"wall per transfer: raw {1e3 * walls['raw'] / n:.2f} ms, path {1e3 * walls['path'] / n:.2f} ms "
          f"(path/raw throughput {walls['raw'] / walls['path']:.0%})")
    print(f"\n{'CPU ms per transfer':<50} {'raw':>7} {'path':>7} {'path-raw':>9}")
    busy = {m: 0.0 for m in cpu}
    for c in CATEGORIES:
        r, p = cpu["raw"][c] * ms, cpu["path"][c] * ms
        if c != "idle":
            busy["raw"] += r
            busy["path"] += p
        print(f"{c:<50} {r:>7.2f} {p:>7.2f} {p - r:>+9.2f}")
    print(f"{'busy (all but idle)':<50} {busy['raw']:>7.2f} {busy['path']:>7.2f} {busy['path'] - busy['raw']:>+9.2f}")
    print(f"\nthe {args.top} symbols whose CPU grew most, ms per transfer (raw -> path)")
    grew = sorted(set(syms["raw"]) | set(syms["path"]), key=lambda k: syms["raw"][k] - syms["path"][k])
    for k in grew[: args.top]:
        print(f"  {ms * (syms['path'][k] - syms['raw'][k]):+6.2f}  {ms * syms['raw'][k]:5.2f} -> {ms * syms['path'][k]:5.2f}  {k[:90]}")
    print(f"\n{'per transfer':<50} {'raw':>7} {'path':>7} {'path-raw':>9}")
    for ev in SYSCALLS:
        r, p = calls["raw"].get(ev, 0) / n, calls["path"].get(ev, 0) / n
        print(f"{ev.replace('syscalls:sys_enter_', ''):<50} {r:>7.0f} {p:>7.0f} {p - r:>+9.0f}")


if __name__ == "__main__":
    main()
