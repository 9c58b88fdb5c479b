"""Tensor parallelism inside one engine: the model split Megatron-style over N rank processes.

Rank 0 is the engine process: it owns the scheduler, the block manager and the sampler. Ranks 1..N-1 are
worker processes (`rank_main`) that own only their shard of the weights and a KV pool of their KV heads,
indexed by the SAME block tables. Each step rank 0 broadcasts the step's plan (`StepPlan`: token ids,
positions, slots, block tables, context lengths, rows to sample) as two int64 tensors; every rank runs the
forward, the row-parallel projections (o_proj, down_proj) all-reduce their partial sums, and the LM head's
vocabulary shards are gathered on rank 0, which samples once (so seeded sampling equals TP = 1).

Devices: on a CPU every rank runs on the host (gloo); on CUDA rank r runs on the r-th device from the
engine's (`rank_device`: "cuda" -> cuda:0, cuda:1, ...; NCCL, which needs one device per rank). Rank 0
allocates every worker's KV pool where that worker computes (host shared memory, or the worker's device
shared by CUDA IPC), so rank 0's KV transfers read and write every rank's heads without a collective.

Sharding (`shard_model`): q/k/v and gate/up split by output rows (heads, intermediate features), o and
down by input columns, the LM head by vocabulary rows (padded to equal shards). With fewer KV heads than
ranks each KV head is replicated on the ranks whose query heads read it. Float weights only: a GGUF
model refuses TP > 1 (its row groups would need re-blocking).
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import multiprocessing.process
import os
import pickle
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.linear import Linear
from pdserve.engine.model_config import ModelConfig

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig

# Collective timeout: a rank that died or hangs turns into an error on the others within this time.
TP_TIMEOUT_S = 30.0
# Rendezvous timeout: a worker rank imports torch and loads its weights before it joins.
TP_START_TIMEOUT_S = 300.0
_HOST = "127.0.0.1"
# StepPlan header fields (int64): op, T, decode rows, decode table width, prefill seqs, prefill table width, rows
_HEADER = 7
_OP_STOP, _OP_STEP, _OP_CHECK = 0, 1, 2
# Where a worker finds its KV pool (sent in place of a memfd number): allocated by itself, or on its CUDA
# device by rank 0 and shared through CUDA IPC (the handle is in the TCP store under f"pool{rank}").
_POOL_OWN, _POOL_CUDA_IPC = -1, -2


class RankLost(RuntimeError):
    """A worker rank exited or a collective with it failed: the engine cannot step again. Its requests
    keep their state (nothing is aborted) for the node to hand over."""


class HeadShard(NamedTuple):
    q_start: int  # first query head of this rank
    num_heads: int  # query heads per rank
    kv_start: int  # first KV head of this rank
    num_kv_heads: int  # KV heads this rank holds (1 when replicated)


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShard:
    """Which query and KV heads rank `rank` of `world` computes. Raises ValueError where the heads don't split."""
    if num_heads % world:
        raise ValueError(f"tensor parallelism: {num_heads} attention heads do not split over {world} ranks")
    hq = num_heads // world
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise ValueError(f"tensor parallelism: {num_kv_heads} KV heads do not split over {world} ranks")
        hkv = num_kv_heads // world
        return HeadShard(rank * hq, hq, rank * hkv, hkv)
    if world % num_kv_heads:
        raise ValueError(f"tensor parallelism: {world} ranks do not replicate {num_kv_heads} KV heads evenly")
    # fewer KV heads than ranks: this rank's query heads all read KV head q_start // group
    return HeadShard(rank * hq, hq, rank * num_kv_heads // world, 1)


def rank_device(device: str, rank: int) -> torch.device:
    """The device rank `rank` computes on: the host for "cpu", else the engine's CUDA device + rank."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def check_devices(device: str, world: int) -> None:
    """Raises ValueError where `world` ranks from `device` need more CUDA devices than are visible."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    visible = torch.cuda.device_count()
    first = dev.index or 0
    if first + world > visible:
        raise ValueError(f"tensor_parallel_size {world} needs CUDA devices {first}..{first + world - 1} "
                         f"(one a rank); {visible} visible")


def init_group(store_port: int, rank: int, world: int, device: str, master: dist.TCPStore | None = None) -> None:
    """Joins the node's one process group (gloo on a CPU, NCCL on CUDA) through the TCP store on loopback."""
    start = datetime.timedelta(seconds=TP_START_TIMEOUT_S)
    store = master or dist.TCPStore(_HOST, store_port, world, False, timeout=start)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank_device(device, rank))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TP_TIMEOUT_S))


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype, name: str) -> tuple[torch.Tensor, int]:
    """A zeroed CPU tensor in anonymous shared memory (a memfd, freed once every process that mapped it
    exits) and its descriptor, which a child process maps with `open_shared(os.getpid(), fd, ...)`."""
    numel = 1
    for s in shape:
        numel *= s
    fd = os.memfd_create(name)
    os.ftruncate(fd, max(1, numel * dtype.itemsize))
    return open_shared(os.getpid(), fd, shape, dtype), fd


def open_shared(pid: int, fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Maps process `pid`'s shared-memory descriptor `fd` (see shared_zeros) as a tensor of `shape`."""
    numel = 1
    for s in shape:
        numel *= s
    return torch.from_file(f"/proc/{pid}/fd/{fd}", shared=True, size=numel, dtype=dtype).view(shape)


class RowParallelLinear(Linear):
    """A projection whose input features are split over the ranks: each computes a partial sum, one
    all-reduce adds them (the bias, kept on rank 0 only, is added once)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/N] -> [T, out]
        y = super().forward(x)
        dist.all_reduce(y)
        return y


def _linear(cls: type[Linear], weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    lin = cls(weight.shape[0], weight.shape[1], bias is not None, weight.dtype)
    lin.weight.data = weight.contiguous()
    if bias is not None and lin.bias is not None:
        lin.bias.data = bias.contiguous()
    return lin


def _rows(lin: Linear, index: torch.Tensor) -> Linear:
    return _linear(Linear, lin.weight.detach()[index], None if lin.bias is None else lin.bias.detach()[index])


def _cols(lin: Linear, index: torch.Tensor, keep_bias: bool) -> Linear:
    bias = lin.bias.detach() if lin.bias is not None and keep_bias else None
    return _linear(RowParallelLinear, lin.weight.detach()[:, index], bias)


def _span(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count)


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Raises ValueError where a model can't be split over `world` ranks (before any rank is spawned)."""
    if cfg.weight_format:
        raise ValueError(f"tensor parallelism serves float weights only; this {cfg.weight_format} (GGUF) model "
                         "runs with tensor_parallel_size 1")
    head_shard(cfg.num_heads, cfg.num_kv_heads, 0, world)
    if cfg.intermediate_size % world:
        raise ValueError(f"tensor parallelism: intermediate size {cfg.intermediate_size} does not split over {world}")


@torch.no_grad()
def shard_model(model: torch.nn.Module, rank: int, world: int) -> HeadShard:
    """Cuts a loaded CausalLM (engine.model) down to rank `rank`'s shard, in place; returns its heads.
    Call before `pack_cpu_weights`. Raises ValueError for quantized weights or sizes that don't split."""
    cfg = model.cfg
    check_shardable(cfg, world)
    if model.embed_quant is not None or any(lin.groups is not None or lin.packed is not None for lin in model.linears()):
        raise ValueError("tensor parallelism shards plain float weights (load with pack_weights=False)")
    shard = head_shard(cfg.num_heads, cfg.num_kv_heads, rank, world)
    d, inter = cfg.head_dim, cfg.intermediate_size // world
    q_cols = _span(shard.q_start * d, shard.num_heads * d)
    kv = _span(shard.kv_start * d, shard.num_kv_heads * d)
    qkv_rows = torch.cat((q_cols, cfg.q_size + kv, cfg.q_size + cfg.kv_size + kv))
    mlp_cols = _span(rank * inter, inter)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv = _rows(attn.qkv, qkv_rows)
        attn.o = _cols(attn.o, q_cols, keep_bias=rank == 0)
        attn.num_heads, attn.num_kv_heads, attn.q_size = shard.num_heads, shard.num_kv_heads, shard.num_heads * d
        mlp.gate_up = _rows(mlp.gate_up, torch.cat((mlp_cols, cfg.intermediate_size + mlp_cols)))
        mlp.down = _cols(mlp.down, mlp_cols, keep_bias=rank == 0)
    vocab = cfg.vocab_size
    per = -(-vocab // world)  # vocabulary rows per rank, the last shard padded with zero rows
    head = model.lm_head.weight.detach()[rank * per : (rank + 1) * per]
    if head.shape[0] < per:
        head = torch.cat((head, head.new_zeros(per - head.shape[0], head.shape[1])))
    model.lm_head = _linear(Linear, head, None)
    return shard


@dataclass
class StepPlan:
    """What every rank needs to run one step: the model's inputs and the rows whose logits rank 0 samples."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    rows: list[int]

    def send(self, device: torch.device) -> None:
        """Rank 0: broadcasts the plan (a 7-int header, then one int64 payload) from `device` (the
        group's: the host for gloo, rank 0's GPU for NCCL)."""
        m = self.meta
        dt, pt = m.decode_block_tables, m.prefill_block_tables
        header = [_OP_STEP, self.input_ids.shape[0], m.num_decode_tokens, 0 if dt is None else dt.shape[1],
                  0 if pt is None else pt.shape[0], 0 if pt is None else pt.shape[1], len(self.rows)]
        parts = [self.input_ids, self.positions, m.slot_mapping]
        parts += [t.reshape(-1).long() for t in (dt, m.decode_context_lens, pt, m.prefill_cu_seqlens_q,
                                                 m.prefill_context_lens) if t is not None]
        parts.append(torch.tensor(self.rows, dtype=torch.int64))
        dist.broadcast(torch.tensor(header, dtype=torch.int64, device=device), 0)
        dist.broadcast(torch.cat([p.to(device) for p in parts]), 0)

    @staticmethod
    def receive(device: torch.device) -> StepPlan | int:
        """Ranks > 0: the next plan (its tensors on `device`), or the op code of a control message (stop, check)."""
        header = torch.empty(_HEADER, dtype=torch.int64, device=device)
        dist.broadcast(header, 0)
        op, t, nd, dw, bp, pw, nrows = header.tolist()
        if op != _OP_STEP:
            return op
        n = 3 * t + (nd * dw + nd if nd else 0) + (bp * pw + 2 * bp + 1 if bp else 0) + nrows
        payload = torch.empty(n, dtype=torch.int64, device=device)
        dist.broadcast(payload, 0)
        sizes = [t, t, t] + ([nd * dw, nd] if nd else []) + ([bp * pw, bp + 1, bp] if bp else []) + [nrows]
        it = iter(payload.split(sizes))
        ids, pos, slots = next(it), next(it), next(it)
        dtab, dctx = (next(it).view(nd, dw).int(), next(it).int()) if nd else (None, None)
        ptab, cu, pctx = (next(it).view(bp, pw).int(), next(it).int(), next(it).int()) if bp else (None, None, None)
        meta = AttentionMetadata(slots, nd, dtab, dctx, ptab, cu, pctx)
        return StepPlan(ids, pos, meta, next(it).tolist())


def gather_logits(local: torch.Tensor, world: int, vocab: int) -> torch.Tensor | None:
    """[N, V/N] per rank -> [N, V] on rank 0 (None elsewhere)."""
    rank = dist.get_rank()
    parts = [torch.empty_like(local) for _ in range(world)] if rank == 0 else None
    dist.gather(local.contiguous(), parts, dst=0)
    return None if parts is None else torch.cat(parts, dim=1)[:, :vocab]


def _step(model: torch.nn.Module, plan: StepPlan, kv_cache: torch.Tensor, world: int) -> torch.Tensor | None:
    """Every rank's part of one step; rank 0 gets the [N, V] logits of plan.rows (None without rows)."""
    hidden = model(plan.input_ids, plan.positions, plan.meta, kv_cache)  # [T, hidden]
    if not plan.rows:
        return None
    if len(plan.rows) < hidden.shape[0]:
        hidden = hidden.index_select(0, torch.tensor(plan.rows, device=hidden.device))
    return gather_logits(model.compute_logits(hidden), world, model.cfg.vocab_size)


def _die_with_parent() -> None:
    """Linux: this worker gets SIGKILL when rank 0 exits, however it exits (even stopped or hung)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # rank 0 is already gone
        os._exit(1)


def rank_main(cfg: EngineConfig, rank: int, world: int, store_port: int) -> None:
    """A worker rank's whole life: join the group, load and shard the model, map its KV pool, then
    run the plans rank 0 broadcasts until it says stop."""
    from pdserve.engine.config import kv_cache_torch_dtype
    from pdserve.engine.loader import load_model
    from pdserve.kernels import get_kernel_ops

    _die_with_parent()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    dev = rank_device(cfg.device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # load first, then join: the collectives' short timeout never waits on a rank still loading
    ops = get_kernel_ops(cfg.kernel_backend, cfg.device)
    model = load_model(cfg.model, dtype=cfg.dtype, device=str(dev), ops=ops, pack_weights=False).model
    shard = shard_model(model, rank, world)
    model.pack_cpu_weights()
    store = dist.TCPStore(_HOST, store_port, world, False, timeout=datetime.timedelta(seconds=TP_START_TIMEOUT_S))
    store.set(f"loaded{rank}", "1")
    init_group(store_port, rank, world, cfg.device, master=store)
    try:
        pools = torch.empty(2 + world, dtype=torch.int64, device=dev)
        dist.broadcast(pools, 0)  # the KV pool's block count, chosen by rank 0, and where each rank's pool lives
        num_blocks, pid, fd = (int(x) for x in pools[[0, 1, 2 + rank]].tolist())
        mc = dataclasses.replace(model.cfg, num_kv_heads=shard.num_kv_heads)
        dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, next(model.parameters()).dtype)
        shape = mc.kv_cache_shape(num_blocks, cfg.block_size)
        if fd >= 0:
            kv_cache = open_shared(pid, fd, shape, dtype)
        elif fd == _POOL_CUDA_IPC:
            rebuild, args = pickle.loads(store.get(f"pool{rank}"))
            kv_cache = rebuild(*args)
            assert kv_cache.shape == shape and kv_cache.device == dev, (kv_cache.shape, kv_cache.device)
        else:
            kv_cache = torch.zeros(shape, dtype=dtype, device=dev)
        steps = 0
        with torch.inference_mode():
            while True:
                plan = StepPlan.receive(dev)
                if plan == _OP_STOP:
                    break
                if plan == _OP_CHECK:
                    dist.gather(torch.tensor([steps, kv_cache.shape[2]], device=dev), None, dst=0)
                    continue
                assert isinstance(plan, StepPlan)
                _step(model, plan, kv_cache, world)
                steps += 1
    finally:
        dist.destroy_process_group()


class RankGroup:
    """Rank 0's handle on the worker ranks: spawns them, checks they live, stops them."""

    def __init__(self, cfg: EngineConfig, world: int) -> None:
        check_devices(cfg.device, world)
        self.world = world
        self.device = rank_device(cfg.device, 0)  # where this rank's collectives' tensors live
        timeout = datetime.timedelta(seconds=TP_START_TIMEOUT_S)
        store = dist.TCPStore(_HOST, 0, world, True, timeout=timeout, wait_for_workers=False)  # port 0: any free one
        ctx = mp.get_context("spawn")
        self.procs: list[multiprocessing.process.BaseProcess] = [
            ctx.Process(target=rank_main, args=(cfg, r, world, store.port), daemon=True, name=f"pdserve-rank{r}")
            for r in range(1, world)
        ]
        for p in self.procs:
            p.start()
        self._store = store
        self.cfg = cfg
        self.steps = 0
        self.joined = False
        self.closed = False
        self._fds: list[int] = []  # the memfds of the workers' shared KV pools (CPU)
        self._pools: list[torch.Tensor] = []  # the workers' KV pools, kept alive here (CUDA IPC needs the owner)
        self.lost: str | None = None  # why a collective failed; no collective is tried after that

    def join(self) -> None:
        """Rank 0, its own shard loaded: waits (up to TP_START_TIMEOUT_S) for every worker to load, then
        forms the group. Raises RuntimeError if a worker exits first."""
        deadline = time.monotonic() + TP_START_TIMEOUT_S
        keys = [f"loaded{r}" for r in range(1, self.world)]
        while not self._store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks did not load within {TP_START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        init_group(self._store.port, 0, self.world, self.cfg.device, master=self._store)
        self.joined = True

    def check_alive(self) -> None:
        """Raises RuntimeError naming a worker rank that exited (before a collective would wait on it)."""
        for r, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise RankLost(f"tensor-parallel rank {r} exited (code {p.exitcode}); the engine cannot run")

    def share_pools(self, num_blocks: int, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Allocates each worker's KV pool (shape `shapes[r]`, r = 1..N-1) where that worker computes and
        shares it with the worker: host shared memory on a CPU, the worker's own GPU through CUDA IPC.
        Returns them (rank 1 first): rank 0 can then read and write every rank's heads (KV transfer,
        no collective)."""
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            pools = [torch.zeros(shapes[r], dtype=dtype, device=rank_device(self.cfg.device, r))
                     for r in range(1, self.world)]
            for r, pool in enumerate(pools, start=1):
                self._store.set(f"pool{r}", pickle.dumps(reduce_tensor(pool)))
            where = [_POOL_CUDA_IPC] * (self.world - 1)
        else:
            shared = [shared_zeros(shapes[r], dtype, f"pdserve-kv-rank{r}") for r in range(1, self.world)]
            pools = [t for t, _ in shared]
            self._fds = where = [fd for _, fd in shared]
        self._pools = pools
        dist.broadcast(torch.tensor([num_blocks, os.getpid(), _POOL_OWN, *where], dtype=torch.int64,
                                    device=self.device), 0)
        return pools

    def step(self, model: torch.nn.Module, plan: StepPlan, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """One step on every rank. Raises RankLost where a rank is gone or a collective with it failed
        (a rank that hangs turns into that error after TP_TIMEOUT_S)."""
        self.check_alive()
        try:
            plan.send(self.device)
            logits = _step(model, plan, kv_cache, self.world)
        except RuntimeError as err:  # gloo/NCCL: a peer closed, reset or timed out
            self.lost = str(err)
            raise RankLost(f"a tensor-parallel collective failed: {err}") from err
        self.steps += 1
        return logits

    def check(self, num_blocks: int) -> None:
        """Asserts every rank ran the same steps and holds a KV pool of the same blocks as rank 0."""
        self.check_alive()
        dist.broadcast(torch.tensor([_OP_CHECK] + [0] * (_HEADER - 1), dtype=torch.int64, device=self.device), 0)
        got = [torch.empty(2, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        dist.gather(torch.tensor([self.steps, num_blocks], device=self.device), got, dst=0)
        states = [tuple(g.tolist()) for g in got]
        assert all(s == (self.steps, num_blocks) for s in states), f"ranks disagree (steps, KV blocks): {states}"

    def close(self) -> None:
        """Tells the workers to stop, waits for them, leaves the group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.joined and self.lost is None and all(p.is_alive() for p in self.procs):
                dist.broadcast(torch.tensor([_OP_STOP] + [0] * (_HEADER - 1), dtype=torch.int64, device=self.device), 0)
        finally:
            for p in self.procs:
                p.join(TP_TIMEOUT_S)
                if p.is_alive():
                    p.kill()
                    p.join()
            if self.joined:
                dist.destroy_process_group()
            for fd in self._fds:
                os.close(fd)
            self._fds = []
            self._pools = []
