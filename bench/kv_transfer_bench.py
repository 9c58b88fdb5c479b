"""KV transfer throughput between two processes on this machine, through the whole data plane.

For each geometry and prompt length it measures, on the same pair channel:
  path      KVSender.send -> KVReceiver.recv: pack, send, receive into staging, unpack
            (whole-request mode, and layer by layer with every layer already computed)
  raw       plain send/recv of the same bytes in the same messages as that mode (the whole-request
            message plan, or one message per layer), on the same channel
  memcpy    one local copy of the same bytes, in one process
and prints GiB/s plus the ratio path/raw. A transfer's time runs from the sender's submission to the
receiver's completion (a system-wide monotonic clock on both sides), over `--iters` back-to-back
transfers, so the control-plane hop that carries the metadata is paid once per batch, as by raw.
Each figure is the median over `--repeats` batches, raw and path interleaved, after a warm-up.
The production path is the "layer-by-layer" row: prefill_node/sends.py sends each layer as its
forward finishes it (`--no-layerwise-send` gives the "whole" row: whole-request transfers with
KVSender's default 1 MiB messages, the bench's default `--message-mib`). The default cases are the
default model's (SmolLM2-135M, bf16) at 128, 1,024 and 4,096 prompt tokens.

Both processes call gc.freeze() after startup, as a serving process should: otherwise a full
collection over torch's heap (~100 ms on a small machine) lands inside some timed batch.

Two more tables say where the path's extra time goes, per transfer: each side's phases (copy, digest,
wire, layer waits: `TransferResult.phases`) against the raw and path times, and each process's CPU time
(its channel worker, and its other threads: gloo's I/O thread doing the socket copies, the main thread)
against raw's. On a machine with fewer cores than busy threads the gap is about the extra CPU divided
by the cores, plus what the pipeline leaves idle. `--window 2 4` compares staging depths interleaved.

A last table shows what layer-by-layer is for: with a simulated prefill that takes as long per
layer as the wire does, the KV still "exposed" after the last layer is computed (whole-request must
then move all of it; layer-by-layer only the last layer).

    .venv/bin/python bench/kv_transfer_bench.py [--iters 8] [--message-mib 1] [--geometry smollm2|all] [--quick]
        [--tokens 128 1024 4096] [--window 2] [--no-exposed]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdserve.kernels import get_kernel_ops
from pdserve.kv_transfer import (
    ChannelConfig,
    ChannelManager,
    KVReceiver,
    KVSender,
    PhaseSeconds,
    SendHandle,
    TransferMeta,
    TransferResult,
    message_ranges,
)
from pdserve.kv_transfer.staging import StagingBuffers

RAW_TAG = 1 << 30  # far above any transfer's seq_no on the bench's fresh channel
GiB = float(1 << 30)


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.float32

    def block_bytes(self) -> int:
        return self.layers * 2 * self.block_size * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Case:
    geometry: Geometry
    tokens: int

    @property
    def blocks(self) -> int:
        return -(-self.tokens // self.geometry.block_size)

    @property
    def nbytes(self) -> int:
        return self.blocks * self.geometry.block_bytes()


@dataclass(frozen=True)
class Side:
    """One side's per-transfer means over a batch, in seconds: `seconds` is the job's execution time,
    `phases` its split (`PhaseSeconds`); the remainder is bookkeeping."""

    seconds: float
    phases: PhaseSeconds

    @staticmethod
    def of(results: list[TransferResult]) -> Side:
        n = len(results)
        phases = [r.phases or PhaseSeconds() for r in results]
        return Side(sum(r.seconds for r in results) / n, PhaseSeconds(
            layers=sum(s.layers for s in phases) / n, copy=sum(s.copy for s in phases) / n,
            digest=sum(s.digest for s in phases) / n, wire=sum(s.wire for s in phases) / n))

    @property
    def other(self) -> float:
        return self.seconds - self.phases.total


Cpu = tuple[float, float]  # CPU seconds of (the channel worker threads, every other thread) of a process


def cpu_now() -> Cpu:
    """This process's CPU time so far, split into its channel workers and the rest (gloo's I/O
    threads doing the socket copies, the main thread); from the scheduler's per-thread ns counters."""
    workers = {t.native_id for t in threading.enumerate() if t.name.startswith("kv-channel")}
    worker = rest = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:  # the thread exited meanwhile
            continue
        if int(task) in workers:
            worker += ns
        else:
            rest += ns
    return worker / 1e9, rest / 1e9


def cpu_since(start: Cpu) -> Cpu:
    now = cpu_now()
    return now[0] - start[0], now[1] - start[1]


def median_side(sides: list[Side]) -> Side:
    """The phase-wise median over batches."""
    med = statistics.median
    return Side(med(s.seconds for s in sides), PhaseSeconds(
        layers=med(s.phases.layers for s in sides), copy=med(s.phases.copy for s in sides),
        digest=med(s.phases.digest for s in sides), wire=med(s.phases.wire for s in sides)))


@dataclass(frozen=True)
class Breakdown:
    """Per-transfer medians for one case and mode: the raw and path times, and each side's phases."""

    raw_s: float
    path_s: float
    sender: Side
    receiver: Side
    # CPU seconds per transfer, (sender, receiver), each split as `Cpu` (kernel time in syscalls included).
    raw_cpu: tuple[Cpu, Cpu]
    path_cpu: tuple[Cpu, Cpu]


@dataclass(frozen=True)
class Row:
    case: Case
    mode: str
    path_gib_s: float  # median over the repeats
    raw_gib_s: float  # median over the repeats, same message sizes as the mode
    memcpy_gib_s: float
    ratios: tuple[float, ...]  # path/raw of each interleaved repeat
    breakdown: Breakdown


TINY = Geometry("tiny 4Lx2Hx64", layers=4, kv_heads=2, head_dim=64)
BIG = Geometry("big 32Lx8Hx128", layers=32, kv_heads=8, head_dim=128)
# The default model, SmolLM2-135M, served in bf16: 30 layers x 3 KV heads x 64 = 23,040 bytes a token.
SMOLLM2 = Geometry("smollm2 bf16", layers=30, kv_heads=3, head_dim=64, dtype=torch.bfloat16)


def _pool(g: Geometry, blocks: int, random: bool) -> torch.Tensor:
    shape = (g.layers, 2, blocks, g.block_size, g.kv_heads, g.head_dim)  # [L, 2, NB, BS, H, D]
    return torch.randn(shape, dtype=g.dtype) if random else torch.zeros(shape, dtype=g.dtype)


# --------------------------------------------------------------------------- decode process
def _decode_main(conn: Connection, window: int) -> None:
    gc.freeze()  # see main()
    StagingBuffers.NUM_SLOTS = window
    ops = get_kernel_ops("torch")
    receiver = KVReceiver(ops)
    mgr = ChannelManager(ChannelConfig("bench-d", "decode", "127.0.0.1:0", idle_timeout_s=600.0))
    conn.send(mgr.kv_address)
    pool: torch.Tensor | None = None
    raw_bufs: list[torch.Tensor] | None = None
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            break
        if cmd == "window":
            StagingBuffers.NUM_SLOTS = arg
            conn.send(None)
        elif cmd == "pool":
            g, blocks = arg
            pool = None  # free the previous pool before the next one
            pool = _pool(g, blocks, random=False)
            conn.send(None)
        elif cmd == "path":
            cpu0 = cpu_now()
            metas, dst, addr, ready_layers = arg
            metas = [TransferMeta.from_dict(m) for m in metas]
            ch = mgr.channel_from(metas[0].prefill_id, addr, metas[0].epoch)
            done_at: list[float] = []
            handles = [
                receiver.recv(ch, pool, dst, m, timeout_s=120.0,
                              on_layer=done_at.append if ready_layers else None)
                for m in metas
            ]
            results = [h.result(180) for h in handles]
            end = time.perf_counter()
            bad = [r.error for r in results if not r.ok]
            conn.send((end, bad, Side.of(results), cpu_since(cpu0)))
        elif cmd == "raw":
            cpu0 = cpu_now()
            sizes, count, addr, prefill_id, epoch = arg
            ch = mgr.channel_from(prefill_id, addr, epoch)
            group = ch.wait_connected(60.0)
            # As deep as the receiver: messages up to i + NUM_SLOTS - 1 are posted before message i
            # is waited. Kept across batches (as the receiver's staging is): no page faults inside
            # the timing.
            window = StagingBuffers.NUM_SLOTS
            if raw_bufs is None or len(raw_bufs) < window or raw_bufs[0].numel() < max(sizes):
                raw_bufs = [torch.zeros(max(sizes), dtype=torch.uint8) for _ in range(window)]
            bufs = raw_bufs
            plan = sizes * count
            deadline = time.monotonic() + 120.0
            ops_ = [group.irecv(bufs[j][: plan[j]], ch.peer, RAW_TAG) for j in range(min(window - 1, len(plan)))]
            for i in range(len(plan)):
                j = i + window - 1
                if j < len(plan):
                    ops_.append(group.irecv(bufs[j % window][: plan[j]], ch.peer, RAW_TAG))
                ops_.pop(0).wait(deadline)
            conn.send((time.perf_counter(), [], None, cpu_since(cpu0)))
    mgr.close()
    conn.send(None)


# --------------------------------------------------------------------------- prefill process
class Bench:
    def __init__(self, message_bytes: int | None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_main, args=(child, StagingBuffers.NUM_SLOTS), daemon=True)
        self.proc.start()
        self.decode_addr = self.conn.recv()
        self.mgr = ChannelManager(ChannelConfig("bench-p", "prefill", "127.0.0.1:0", idle_timeout_s=600.0))
        self.sender = KVSender(get_kernel_ops("torch"), message_bytes=message_bytes)
        self._raw_buf: torch.Tensor | None = None

    def set_window(self, window: int) -> None:
        """Messages in flight per side from now on, in both processes (at most the startup value,
        which sized the staging slot lists); call only between batches."""
        StagingBuffers.NUM_SLOTS = window
        self.call("window", window)

    def call(self, cmd: str, arg: Any) -> Any:
        self.conn.send((cmd, arg))
        return self.conn.recv()

    def close(self) -> None:
        self.call("stop", None)
        self.proc.join(10)
        self.mgr.close()

    def setup(self, case: Case) -> tuple[torch.Tensor, list[int], list[int]]:
        g = case.geometry
        src_pool, dst_pool = case.blocks + 16, case.blocks + 8  # different pool sizes
        self.call("pool", (g, dst_pool))
        kv = _pool(g, src_pool, random=True)
        gen = torch.Generator().manual_seed(case.tokens)
        src = torch.randperm(src_pool, generator=gen)[: case.blocks].tolist()
        dst = torch.randperm(dst_pool, generator=gen)[: case.blocks].tolist()
        return kv, src, dst

    def path(
        self, kv: torch.Tensor, src: list[int], dst: list[int], iters: int, layerwise: bool
    ) -> tuple[float, Side, Side, tuple[Cpu, Cpu]]:
        """Seconds for `iters` back-to-back transfers, submission to the receiver's last unpack; the
        sender's and receiver's per-transfer phase means; both processes' CPU seconds."""
        ch = self.mgr.channel_to("bench-d")
        cpu0 = cpu_now()
        t0 = time.perf_counter()
        handles = [
            self.sender.send(ch, kv, src, request_id=f"b{i}", num_tokens=len(src) * 16, timeout_s=120.0,
                             layerwise=layerwise)
            for i in range(iters)
        ]
        if layerwise:
            for h in handles:
                h.all_layers_ready()
        end, bad, received, cpu_r = self.call("path", ([h.meta.to_dict() for h in handles], dst, self.mgr.kv_address, False))
        sent = [h.result(60) for h in handles]
        cpu_s = cpu_since(cpu0)
        assert not bad and all(r.ok for r in sent), bad
        return end - t0, Side.of(sent), received, (cpu_s, cpu_r)

    def message_sizes(self, case: Case, layerwise: bool) -> list[int]:
        """Bytes of each message of one transfer of `case`, as the sender plans them."""
        layers = case.geometry.layers
        layer_bytes = case.nbytes // layers
        k = self.sender.layers_per_message(layers, layer_bytes, layerwise)
        return [(l1 - l0) * layer_bytes for l0, l1 in message_ranges(layers, k, case.blocks)]

    def raw(self, sizes: list[int], iters: int) -> tuple[float, tuple[Cpu, Cpu]]:
        """Seconds for `iters` transfers of plain messages of `sizes` bytes each, from the command to
        the receiver (the hop the path's metadata takes too) to the receiver's last completion."""
        ch = self.mgr.channel_to("bench-d")
        group = ch.wait_connected(60.0)
        # Real bytes, kept across batches: an untouched buffer would be read from the kernel's zero
        # page (one 4 KiB page, always in L1), which no staged message is.
        if self._raw_buf is None or self._raw_buf.numel() < max(sizes):
            self._raw_buf = torch.randint(0, 256, (max(sizes),), dtype=torch.uint8)
        buf = self._raw_buf
        deadline = time.monotonic() + 120.0
        cpu0 = cpu_now()
        t0 = time.perf_counter()
        self.conn.send(("raw", (sizes, iters, self.mgr.kv_address, ch.key.prefill_id, ch.key.epoch)))
        pending = [group.isend(buf[:size], ch.peer, RAW_TAG) for _ in range(iters) for size in sizes]
        for op in pending:
            op.wait(deadline)
        end, _, _, cpu_r = self.conn.recv()
        return end - t0, (cpu_since(cpu0), cpu_r)

    def exposed(self, kv: torch.Tensor, src: list[int], dst: list[int], layer_s: float, layerwise: bool) -> float:
        """Seconds from the last layer's simulated compute to the receiver's completion."""
        ch = self.mgr.channel_to("bench-d")
        layers = kv.shape[0]
        h: SendHandle | None = None
        if layerwise:
            h = self.sender.send(ch, kv, src, request_id="x", num_tokens=len(src) * 16, timeout_s=120.0,
                                 layerwise=True)
            self.conn.send(("path", ([h.meta.to_dict()], dst, self.mgr.kv_address, False)))
        for layer in range(layers):
            time.sleep(layer_s)  # the prefill computing this layer
            if h is not None:
                h.layer_ready(layer)
        computed = time.perf_counter()
        if h is None:
            h = self.sender.send(ch, kv, src, request_id="x", num_tokens=len(src) * 16, timeout_s=120.0)
            self.conn.send(("path", ([h.meta.to_dict()], dst, self.mgr.kv_address, False)))
        end, bad, _, _ = self.conn.recv()
        assert not bad and h.result(60).ok, bad
        return end - computed


def memcpy_seconds(nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(bench: Bench, case: Case, iters: int, repeats: int, windows: list[int]) -> list[Row]:
    kv, src, dst = bench.setup(case)
    # Scale the batch so small prompts still move enough bytes to time (at least ~64 MiB per batch).
    n = max(iters, min(200, (64 << 20) // case.nbytes))
    # Each mode at each window depth, interleaved batch by batch, so the depths see the same load.
    modes = {f"{name}{f' w{w}' if len(windows) > 1 else ''}": (layerwise, w)
             for name, layerwise in (("whole", False), ("layer-by-layer", True)) for w in windows}
    sizes = {mode: bench.message_sizes(case, layerwise) for mode, (layerwise, _) in modes.items()}
    # Warm up channel, staging, both pools and both plans; the deepest window first, since the
    # channel's staging is created at its first transfer with that many slots.
    for mode, (layerwise, w) in sorted(modes.items(), key=lambda m: -m[1][1]):
        bench.set_window(w)
        bench.path(kv, src, dst, 2, layerwise=layerwise)
        bench.raw(sizes[mode], 2)
    cpu_raw: dict[str, list[tuple[Cpu, Cpu]]] = {mode: [] for mode in modes}
    cpu_path: dict[str, list[tuple[Cpu, Cpu]]] = {mode: [] for mode in modes}
    # Interleaved, raw right before path in each repeat, so a burst of load from other processes
    # hits both alike; medians, since the machine is shared and single batches vary a lot.
    raw: dict[str, list[float]] = {mode: [] for mode in modes}
    path: dict[str, list[float]] = {mode: [] for mode in modes}
    sent: dict[str, list[Side]] = {mode: [] for mode in modes}
    received: dict[str, list[Side]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode, (layerwise, w) in modes.items():
            bench.set_window(w)
            seconds, cpu = bench.raw(sizes[mode], n)
            raw[mode].append(seconds)
            cpu_raw[mode].append(cpu)
            seconds, s, r, cpu = bench.path(kv, src, dst, n, layerwise=layerwise)
            path[mode].append(seconds)
            cpu_path[mode].append(cpu)
            sent[mode].append(s)
            received[mode].append(r)
    mem = memcpy_seconds(case.nbytes, 5)
    total = n * case.nbytes
    med = statistics.median
    return [
        Row(case, mode, total / med(path[mode]) / GiB, total / med(raw[mode]) / GiB,
            case.nbytes / mem / GiB, tuple(r / p for r, p in zip(raw[mode], path[mode], strict=True)),
            Breakdown(med(raw[mode]) / n, med(path[mode]) / n, median_side(sent[mode]), median_side(received[mode]),
                      median_cpu(cpu_raw[mode], n), median_cpu(cpu_path[mode], n)))
        for mode in modes
    ]


def median_cpu(batches: list[tuple[Cpu, Cpu]], n: int) -> tuple[Cpu, Cpu]:
    """Per-transfer medians over batches of `n` transfers each."""
    med = statistics.median
    return tuple(  # type: ignore[return-value]
        (med(b[side][0] for b in batches) / n, med(b[side][1] for b in batches) / n) for side in (0, 1)
    )


def print_breakdown(rows: list[Row]) -> None:
    """Where a transfer's time goes, per transfer, medians over the batches (ms). The path's extra
    work over raw is the sender's copy + digest and the receiver's digest + copy; on a machine with
    fewer cores than the two processes' busy threads, that work competes with the wire for CPU."""
    print("\nPer-transfer breakdown (ms, medians over batches): sender S and receiver R phases of the path")
    print(f"{'tokens':>6} {'mode':<18} {'raw':>7} {'path':>7} {'gap':>7} | {'S copy':>7} {'S dig':>6} {'S wire':>7} "
          f"{'S lay':>6} {'S oth':>6} | {'R wire':>7} {'R dig':>6} {'R copy':>7} {'R oth':>6} | {'extra':>6} {'gap-extra':>9}")
    for r in rows:
        b = r.breakdown
        s, v = b.sender, b.receiver
        extra = s.phases.copy + s.phases.digest + v.phases.digest + v.phases.copy
        gap = b.path_s - b.raw_s
        ms = 1e3
        print(f"{r.case.tokens:>6} {r.mode:<18} {ms * b.raw_s:>7.3f} {ms * b.path_s:>7.3f} {ms * gap:>7.3f} | "
              f"{ms * s.phases.copy:>7.3f} {ms * s.phases.digest:>6.3f} {ms * s.phases.wire:>7.3f} "
              f"{ms * s.phases.layers:>6.3f} {ms * s.other:>6.3f} | {ms * v.phases.wire:>7.3f} "
              f"{ms * v.phases.digest:>6.3f} {ms * v.phases.copy:>7.3f} {ms * v.other:>6.3f} | "
              f"{ms * extra:>6.3f} {ms * (gap - extra):>9.3f}")
    print("\nCPU per transfer (ms, kernel time in syscalls included) against wall time: each side's channel "
          "worker W and all its other threads O (gloo's I/O thread, main)")
    print(f"{'tokens':>6} {'mode':<18} {'raw S':>6} {'raw R':>6} {'raw wall':>8} | {'path SW':>7} {'SO':>6} "
          f"{'RW':>6} {'RO':>6} {'path wall':>9} | {'extra CPU':>9} {'path CPU/cores':>14}")
    cores = os.cpu_count() or 1
    for r in rows:
        b = r.breakdown
        raw_total = sum(map(sum, b.raw_cpu))
        path_total = sum(map(sum, b.path_cpu))
        (sw, so), (rw, ro) = b.path_cpu
        ms = 1e3
        print(f"{r.case.tokens:>6} {r.mode:<18} {ms * sum(b.raw_cpu[0]):>6.2f} {ms * sum(b.raw_cpu[1]):>6.2f} "
              f"{ms * b.raw_s:>8.3f} | {ms * sw:>7.2f} {ms * so:>6.2f} {ms * rw:>6.2f} {ms * ro:>6.2f} "
              f"{ms * b.path_s:>9.3f} | {ms * (path_total - raw_total):>9.3f} {ms * path_total / cores:>14.3f}")


def sweep(case: Case, iters: int, repeats: int) -> None:
    """Whole-request path/raw for several message sizes (how the default was chosen)."""
    print(f"\nmessage-size sweep, {case.geometry.name}, {case.tokens} tokens, whole-request")
    for mib in (0.25, 0.5, 1.0, 2.0, 4.0, 0.0):
        bench = Bench(int(mib * (1 << 20)) or None)
        try:
            kv, src, dst = bench.setup(case)
            n = max(iters, min(200, (64 << 20) // case.nbytes))
            sizes = bench.message_sizes(case, layerwise=False)
            bench.path(kv, src, dst, 2, layerwise=False)
            bench.raw(sizes, 2)
            raws, paths = [], []
            for _ in range(repeats):
                raws.append(bench.raw(sizes, n)[0])
                paths.append(bench.path(kv, src, dst, n, layerwise=False)[0])
            raw, path = statistics.median(raws), statistics.median(paths)
            label = f"{mib} MiB" if mib else "one message"
            print(f"  {label:>12}: path {n * case.nbytes / path / GiB:5.2f} GiB/s, raw {n * case.nbytes / raw / GiB:5.2f} "
                  f"GiB/s, path/raw {100 * raw / path:4.0f}%")
        finally:
            bench.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=8, help="transfers per timed batch (more for small prompts)")
    ap.add_argument("--repeats", type=int, default=7, help="batches per measurement; the median is kept")
    ap.add_argument("--message-mib", type=float, default=1.0,
                    help="whole-request message size; 0 sends a request as one message")
    ap.add_argument("--quick", action="store_true", help="skip the big geometry")
    ap.add_argument("--geometry", choices=["smollm2", "all"], default="smollm2",
                    help="smollm2: the default model's sizes (128 to 4,096-token prompts); all: the tiny "
                         "and big synthetic geometries too")
    ap.add_argument("--sweep", action="store_true", help="only sweep the whole-request message size")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096], help="prompt lengths to measure")
    ap.add_argument("--window", type=int, nargs="+", default=[StagingBuffers.NUM_SLOTS],
                    help="messages in flight per side (staging slots), for both the path and raw; several "
                         "values are measured interleaved")
    ap.add_argument("--no-exposed", action="store_true", help="skip the exposed-time table")
    args = ap.parse_args()
    StagingBuffers.NUM_SLOTS = max(args.window)  # sizes the slot lists; set_window picks each depth
    if args.sweep:
        for case in (Case(TINY, 1024), Case(TINY, 8192)):
            sweep(case, args.iters, args.repeats)
        return
    message_bytes = int(args.message_mib * (1 << 20)) or None
    # A full collection over the torch-sized heap takes ~100 ms here and stalls every thread; move
    # the startup objects out of the collector's reach (what a serving process should do too).
    gc.freeze()
    cases = [Case(SMOLLM2, t) for t in args.tokens]
    if args.geometry == "all":
        cases += [Case(TINY, 128), Case(TINY, 1024), Case(TINY, 8192)]
        if not args.quick:
            cases.append(Case(BIG, 1024))
    bench = Bench(message_bytes)
    try:
        rows: list[Row] = []
        for case in cases:
            rows.extend(measure(bench, case, args.iters, args.repeats, args.window))
        print(f"\nKV transfer, 2 processes over loopback gloo, torch {torch.__version__}, "
              f"{torch.get_num_threads()} torch threads, message size {args.message_mib} MiB, "
              f"{'/'.join(map(str, args.window))} messages in flight per side")
        print("medians of interleaved batches; raw uses the mode's own message sizes; 'layer-by-layer' is "
              "what prefill_node/sends.py sends by default")
        print(f"{'geometry':<16} {'tokens':>6} {'MiB':>8} {'mode':<18} {'path GiB/s':>10} {'raw GiB/s':>10} "
              f"{'memcpy GiB/s':>12} {'path/raw':>8} {'per-batch path/raw min..max':>28}")
        for r in rows:
            spread = f"{100 * min(r.ratios):.0f}%..{100 * max(r.ratios):.0f}%"
            print(f"{r.case.geometry.name:<16} {r.case.tokens:>6} {r.case.nbytes / (1 << 20):>8.2f} {r.mode:<18} "
                  f"{r.path_gib_s:>10.2f} {r.raw_gib_s:>10.2f} {r.memcpy_gib_s:>12.2f} "
                  f"{100 * r.path_gib_s / r.raw_gib_s:>7.0f}% {spread:>28}")
        print_breakdown(rows)

        if args.no_exposed:
            return
        print("\nExposed transfer time after a simulated prefill (per-layer compute = per-layer wire time)")
        print(f"{'geometry':<16} {'tokens':>6} {'layer ms':>8} {'whole ms':>9} {'layer-by-layer ms':>18}")
        bench.set_window(args.window[0])
        for case in [c for c in cases if c.tokens >= 1024]:
            kv, src, dst = bench.setup(case)
            raw_row = next(r for r in rows if r.case == case and r.mode.startswith("layer-by-layer"))
            layer_s = case.nbytes / (raw_row.raw_gib_s * GiB) / case.geometry.layers
            whole = statistics.median(bench.exposed(kv, src, dst, layer_s, False) for _ in range(args.repeats))
            lbl = statistics.median(bench.exposed(kv, src, dst, layer_s, True) for _ in range(args.repeats))
            print(f"{case.geometry.name:<16} {case.tokens:>6} {1e3 * layer_s:>8.2f} {1e3 * whole:>9.2f} {1e3 * lbl:>18.2f}")
    finally:
        bench.close()


if __name__ == "__main__":
    main()
