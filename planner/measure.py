"""`pdserve profile`: times the real engine on this machine and fits the planner's cost model.

In-process, no cluster: an `LLMEngine` with the nodes' settings runs
- prefill steps of n prompts of L tokens (max_tokens 1), and prompts whose first blocks are prefix hits;
- decode steps of a batch of B sequences of context L each (timed once every prompt is in the cache);
- KV transfers of T tokens' K/V between this process and a child over a loopback gloo pair channel
  (`kv_transfer`'s sender and receiver, as a prefill node ships to a decode node);
- the KV capacity: the pool's blocks at the configured memory.
With `--tp-widths 1,2` all of it is measured once per width, the engine running with
`tensor_parallel_size` W (its W-1 worker ranks spawned, float weights only; `engine.parallel`), and each
width's fits are kept (`Profile.by_tp`). The KV transfer is timed once, at the first width, and its fit
shared by every width: a node's whole K/V a token crosses the pair either way (a resharded transfer
between widths moves the same bytes, split over rank pairs), so it is an upper bound for wider pairs.
Each point is the median of a few repeats (the machine may be shared). The fits are least squares
(`planner.profile_model.fit_linear`); the profile keeps the raw points next to them.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdserve.engine.config import EngineConfig
from pdserve.engine.default_model import resolve_model
from pdserve.engine.gguf_import import StderrProgress
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels import get_kernel_ops
from pdserve.kv_transfer import ChannelConfig, ChannelManager, KVReceiver, KVSender, TransferMeta
from pdserve.planner.machine import PROFILE_KEY, this_machine
from pdserve.planner.profile_model import EngineFacts, Profile, fit_linear


@dataclass(frozen=True)
class Grid:
    """What to measure."""

    prefill: tuple[tuple[int, int], ...]  # (prompts, tokens each)
    prefix: tuple[int, ...]  # prompt lengths measured again with their first blocks cached
    decode: tuple[tuple[int, int], ...]  # (batch, context tokens each)
    transfer: tuple[int, ...]  # tokens whose K/V are shipped
    repeats: int
    decode_steps: int


QUICK = Grid(prefill=((1, 16), (1, 128), (4, 64), (1, 384)), prefix=(128,),
             decode=((1, 16), (1, 256), (4, 64), (8, 16), (8, 128)), transfer=(16, 256, 1024), repeats=2, decode_steps=3)
FULL = Grid(prefill=((1, 32), (1, 128), (1, 512), (1, 1024), (1, 2048), (4, 128), (8, 256), (16, 64), (4, 512)),
            prefix=(256, 1024), decode=((1, 64), (1, 1024), (4, 256), (8, 512), (16, 128), (16, 1024), (32, 256),
                                        (64, 128), (64, 512)),
            transfer=(16, 256, 2048, 8192), repeats=5, decode_steps=8)


class EngineTimer:
    """Times steps of one engine. Changes only the engine's queues (every request it adds runs to its
    end, so the pool is empty again after each measurement)."""

    def __init__(self, engine: LLMEngine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self._n = 0

    def _prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab - 8) for _ in range(n)]

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        self._n += 1
        rid = f"profile-{self._n}"
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return rid

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def _timed_step(self) -> float:
        t0 = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - t0

    def prefill(self, count: int, tokens: int, cached_prefix: list[int] | None = None) -> dict[str, float]:
        """One step prefilling `count` prompts of `tokens` tokens (starting with `cached_prefix`, which an
        earlier request left in the prefix cache)."""
        prompts = [(cached_prefix or []) + self._prompt(tokens - len(cached_prefix or [])) for _ in range(count)]
        hits = [self.engine.prefix_hit_tokens(p) for p in prompts]
        for p in prompts:
            self._add(p, 1)
        seconds = self._timed_step()
        stats = self.engine.last_step
        self._drain()
        new = [tokens - h for h in hits]
        assert stats.num_prefill_tokens == sum(new), "the prompts did not fit one step: raise the token budget"
        return {"seqs": count, "tokens": sum(new), "cached": sum(hits),
                "attn": float(sum(n * (h + n) for n, h in zip(new, hits, strict=True))), "seconds": seconds}

    def cache_prompt(self, tokens: int) -> list[int]:
        """Runs a prompt of `tokens` tokens so that its full blocks are prefix-cached; returns it."""
        prompt = self._prompt(tokens)
        self._add(prompt, 1)
        self._drain()
        return prompt

    def decode(self, batch: int, context: int, steps: int) -> list[dict[str, float]]:
        """`steps` decode steps of `batch` sequences of about `context` tokens each."""
        for _ in range(batch):
            self._add(self._prompt(context), steps + 2)
        sched = self.engine.scheduler
        while any(s.is_prefilling for s in sched.running_seqs) or sched.num_waiting:
            self.engine.step()
        out = []
        for _ in range(steps):
            ctx = sum(s.num_tokens for s in sched.running_seqs)
            seconds = self._timed_step()
            st = self.engine.last_step
            if st.num_decode_tokens == batch and st.num_prefill_tokens == 0:
                out.append({"batch": batch, "context": ctx, "seconds": seconds})
        self._drain()
        return out


# --------------------------------------------------------------------------- KV transfer


def _receiver_main(conn: Connection, pool_shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """The decode side of the pair: receives each announced transfer into its pool, reports when done."""
    gc.freeze()
    receiver = KVReceiver(get_kernel_ops("torch"))
    mgr = ChannelManager(ChannelConfig("profile-d", "decode", "127.0.0.1:0", idle_timeout_s=600.0))
    conn.send(mgr.kv_address)
    pool = torch.zeros(pool_shape, dtype=dtype)  # [L, 2, NB, BS, Hkv, D]
    while True:
        msg = conn.recv()
        if msg is None:
            break
        meta_dict, dst, addr = msg
        meta = TransferMeta.from_dict(meta_dict)
        ch = mgr.channel_from(meta.prefill_id, addr, meta.epoch)
        result = receiver.recv(ch, pool, dst, meta, timeout_s=120.0).result(180)
        conn.send((time.perf_counter(), result.error if not result.ok else None))
    mgr.close()


class TransferTimer:
    """A loopback gloo pair: this process sends, a spawned child receives (as prefill -> decode)."""

    def __init__(self, engine: LLMEngine, max_tokens: int) -> None:
        mc, bs = engine.model_config, engine.cfg.block_size
        self.block_size = bs
        blocks = -(-max_tokens // bs) + 2
        shape = tuple(mc.kv_cache_shape(blocks, bs))
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_main, args=(child, shape, engine.dtype), daemon=True)
        self.proc.start()
        self.conn.recv()
        self.mgr = ChannelManager(ChannelConfig("profile-p", "prefill", "127.0.0.1:0", idle_timeout_s=600.0))
        self.sender = KVSender(get_kernel_ops("torch"))
        self.kv = torch.randn(shape, dtype=engine.dtype) if engine.dtype.is_floating_point else torch.zeros(shape)

    def send(self, tokens: int) -> float:
        """Seconds from the send's submission to the receiver's completion of `tokens` tokens' K/V."""
        blocks = list(range(-(-tokens // self.block_size)))
        ch = self.mgr.channel_to("profile-d")
        t0 = time.perf_counter()
        h = self.sender.send(ch, self.kv, blocks, request_id=f"t{tokens}-{t0}", num_tokens=tokens, timeout_s=120.0)
        self.conn.send((h.meta.to_dict(), blocks, self.mgr.kv_address))
        end, error = self.conn.recv()
        assert error is None and h.result(60).ok, error
        return end - t0

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
        self.mgr.close()


# --------------------------------------------------------------------------- the command


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and, for each weight file, its name, size and first MiB."""
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def kernel_isa(engine: LLMEngine) -> str:
    """The kernels this engine runs its weights on: the quantized path's ISA ("avx2", "avx512_vnni",
    "portable"), else the float weights' dtype on the kernel backend (e.g. "bfloat16 CpuOps")."""
    weights = engine.weights
    if weights.kernels:
        return weights.kernels
    return f"{weights.format} {type(engine.ops).__name__}"


def machine_facts(engine: LLMEngine) -> dict[str, Any]:
    return {PROFILE_KEY: this_machine(kernel_isa(engine)).to_dict(),
            "platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "device": engine.cfg.device,
            "kernel_backend": type(engine.ops).__name__, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                       time.gmtime())}


def _median_point(points: list[dict[str, float]]) -> dict[str, float]:
    best = dict(points[0])
    best["seconds"] = statistics.median(p["seconds"] for p in points)
    return best


def measure(engine: LLMEngine, grid: Grid, tick: Callable[[str], None],
            transfer: bool = True) -> dict[str, list[dict[str, float]]]:
    """Every point of `grid`; `tick(label)` after each. `transfer=False` leaves the KV transfer out (its
    points empty)."""
    timer = EngineTimer(engine)
    timer.prefill(1, 16)  # warm-up: first calls pay one-off allocations
    budget, capacity = engine.cfg.max_num_batched_tokens, engine.num_blocks * engine.cfg.block_size
    points: dict[str, list[dict[str, float]]] = {"prefill": [], "decode": [], "transfer": []}
    for count, tokens in grid.prefill:
        if count * tokens <= budget and count * tokens < capacity:
            points["prefill"].append(_median_point([timer.prefill(count, tokens) for _ in range(grid.repeats)]))
        tick(f"prefill {count}x{tokens}")
    bs = engine.cfg.block_size
    for tokens in grid.prefix:
        if tokens <= budget:
            runs = []
            for _ in range(grid.repeats):
                prefix = timer.cache_prompt(tokens)[: (tokens * 3 // 4) // bs * bs]
                runs.append(timer.prefill(1, tokens, prefix))
            points["prefill"].append(_median_point(runs))
        tick(f"prefill {tokens} with prefix hits")
    for batch, context in grid.decode:
        if batch <= engine.cfg.max_num_seqs and batch * (context + grid.decode_steps + 2) < capacity:
            runs = [p for _ in range(max(1, grid.repeats // 2)) for p in timer.decode(batch, context, grid.decode_steps)]
            if runs:
                points["decode"].append(_median_point(runs))
        tick(f"decode {batch}x{context}")
    if not transfer:
        return points
    tt = TransferTimer(engine, max(grid.transfer))
    try:
        tt.send(16)  # warm-up: the pair connects
        for tokens in grid.transfer:
            kv_bytes = tokens * kv_bytes_per_token(engine)
            secs = statistics.median(tt.send(tokens) for _ in range(grid.repeats))
            points["transfer"].append({"tokens": tokens, "bytes": kv_bytes, "seconds": secs})
            tick(f"transfer {tokens} tokens")
    finally:
        tt.close()
    return points


def kv_bytes_per_token(engine: LLMEngine) -> int:
    mc = engine.model_config
    return mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * engine.kv_cache.element_size()


def fit_profile(engine: LLMEngine, points: dict[str, list[dict[str, float]]], facts: EngineFacts,
                model: dict[str, Any]) -> Profile:
    """The least-squares fits of `points` (see planner.profile_model for the model), at the engine's TP width."""
    pre, dec, tr = points["prefill"], points["decode"], points["transfer"]
    prefill = fit_linear([(p["tokens"], p["attn"]) for p in pre], [p["seconds"] for p in pre])
    decode = fit_linear([(p["batch"], p["context"]) for p in dec], [p["seconds"] for p in dec])
    transfer = fit_linear([(p["bytes"], 0.0) for p in tr], [p["seconds"] for p in tr])
    return Profile(prefill, decode, transfer, facts, machine_facts(engine), model, points,
                   tp=engine.cfg.tensor_parallel_size)


def main(args: argparse.Namespace) -> int:
    """Runs `pdserve profile`: measures (at each of --tp-widths), fits, writes --out, prints the fitted
    coefficients."""
    resolved = resolve_model(args.model, StderrProgress())
    widths: tuple[int, ...] = tuple(getattr(args, "tp_widths", None) or (1,))
    grid = QUICK if args.quick else FULL
    console = Console(stderr=True)
    per_width = len(grid.prefill) + len(grid.prefix) + len(grid.decode)
    total = per_width * len(widths) + len(grid.transfer)
    model: dict[str, Any] = {}
    profiles: list[Profile] = []
    with Progress(TextColumn("profiling {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, disable=args.no_progress) as bar:
        task = bar.add_task("engine load", total=total)
        for i, width in enumerate(widths):
            cfg = EngineConfig(model=str(resolved.path), dtype=args.dtype, kv_cache_memory_bytes=args.kv_memory << 20,
                               max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                               num_threads=args.num_threads, tensor_parallel_size=width)
            tag = f"TP {width}: " if len(widths) > 1 else ""
            bar.update(task, description=f"{tag}engine load")
            try:
                engine = LLMEngine(cfg)
            except ValueError as err:  # e.g. a GGUF model at TP > 1, or heads that do not split
                print(f"pdserve profile: TP {width}: {err}", file=sys.stderr)
                return 2
            try:
                gc.freeze()  # a full collection over torch's heap would land inside some timed step
                points = measure(engine, grid, lambda label, tag=tag: bar.update(task, advance=1, description=tag + label),
                                 transfer=i == 0)
                if i:
                    points["transfer"] = profiles[0].points["transfer"]
                facts = EngineFacts(cfg.block_size, engine.num_blocks, kv_bytes_per_token(engine),
                                    cfg.max_num_batched_tokens, cfg.max_num_seqs, args.local_prefill_threshold)
                model = model or {"name": resolved.name, "path": str(resolved.path),
                                  "fingerprint": model_fingerprint(Path(resolved.path)),
                                  "dtype": str(engine.dtype).removeprefix("torch."), "arch": engine.model_config.arch,
                                  "layers": engine.model_config.num_layers, "quick": bool(args.quick)}
                prof = fit_profile(engine, points, facts, model)
                if i:  # one transfer fit for every width, the machine as the first width recorded it
                    prof.transfer, prof.machine = profiles[0].transfer, profiles[0].machine
                profiles.append(prof)
            finally:
                gc.unfreeze()
                engine.close()
    profile = profiles[0].with_widths(profiles[1:])
    profile.save(args.out)
    for prof in profiles:
        p, d, t, facts = prof.prefill, prof.decode, prof.transfer, prof.engine
        if len(profiles) > 1:
            print(f"TP {prof.tp}:")
        print(f"prefill_s = {p.a * 1e3:.3f} ms + {p.b * 1e6:.3f} us/token + {p.c * 1e9:.4f} ns/attn-token^2 "
              f"(rmse {p.rmse * 1e3:.3f} ms)\n"
              f"decode_step_s = {d.a * 1e3:.3f} ms + {d.b * 1e6:.3f} us/seq + {d.c * 1e9:.3f} ns/context-token "
              f"(rmse {d.rmse * 1e3:.3f} ms)\n"
              f"transfer_s = {t.a * 1e3:.3f} ms + {t.b * 1e9:.4f} s/GB (rmse {t.rmse * 1e3:.3f} ms)\n"
              f"KV capacity: {facts.num_kv_blocks} blocks of {facts.block_size} tokens "
              f"({facts.kv_bytes_per_token} bytes/token)")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
