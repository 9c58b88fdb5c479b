"""The engine loop: requests in, token/text deltas out. Used offline (`generate`) and by both node kinds."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from pdserve.engine.block_manager import BlockManager, Reservation
from pdserve.engine.config import EngineConfig, kv_cache_torch_dtype
from pdserve.engine.embedding import check_pooling, pooled_hidden, token_batches
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.kv_tier import KVTier
from pdserve.engine.live_request import LiveRequest, RequestBuilder
from pdserve.engine.loader import load_model
from pdserve.engine.model_config import load_model_config
from pdserve.engine.model_runner import ModelRunner, TensorParallelRunner, kv_block_bytes
from pdserve.engine.parallel import RankGroup, check_shardable, head_shard, shard_model
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Resume, Sequence, SequenceStatus, TokenLogprob
from pdserve.engine.speculative import SpeculativeConfig, SpeculativeStats
from pdserve.engine.step_hook import PrefillWatcher
from pdserve.engine.stopping import FinishReason
from pdserve.engine.structured import GrammarCompiler
from pdserve.engine.tokenizer import Tokenizer
from pdserve.kernels import get_kernel_ops

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one request produced in one step (a delta), plus its running totals."""

    request_id: str
    new_token_ids: list[int]  # tokens generated this step (usually 1)
    new_text: str  # text released this step (held back while it could still become a stop string)
    new_logprobs: list[TokenLogprob]  # one per new token when the request asked for logprobs
    finished: bool
    finish_reason: FinishReason | None  # set once finished
    stop_reason: str | int | None  # the matched stop string or stop token id
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass
class GenerationResult:
    """A finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (a stop token id, if one ended it, is included)
    text: str  # generated text, without any stop string
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # per generated token, only when captured


@dataclass
class StepStats:
    """What the last `step` ran (for metrics and benchmarks)."""

    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_preempted: int = 0


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of what an engine holds, for load reports."""

    waiting: int  # queued in the scheduler (new, preempted, or landed awaiting a slot)
    running: int
    kv_blocks_total: int
    kv_blocks_used: int  # referenced by some sequence (held and reserved blocks included)
    kv_blocks_free: int  # never used, or evictable prefix-cache blocks
    kv_blocks_cached: int  # free blocks still holding reusable prefix K/V
    held_requests: int  # finished requests keeping blocks for a transfer (see `Scheduler.release`)
    held_blocks: int
    reserved_requests: int  # RESERVED: requests whose prompt K/V are expected from a transfer
    reserved_blocks: int


@dataclass(frozen=True)
class EngineRequests:
    """Which request ids an engine holds in which state (from `LLMEngine.check_integrity`)."""

    scheduled: frozenset[str]  # waiting, landed or running
    reserved: frozenset[str]
    held: frozenset[str]  # finished, blocks kept until released

    @property
    def all(self) -> frozenset[str]:
        return self.scheduled | self.reserved | self.held


class LLMEngine:
    """Owns one model, one KV cache and one scheduler. Not thread-safe: drive it from one thread."""

    def __init__(self, cfg: EngineConfig, capture_logits: bool = False):
        self.cfg = cfg
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        self.ops = get_kernel_ops(cfg.kernel_backend, cfg.device)
        # TP > 1: the worker ranks start first and load their copies while this process loads its own.
        tp = cfg.tensor_parallel_size
        if tp > 1:
            check_shardable(load_model_config(Path(cfg.model)), tp)
        self.ranks = RankGroup(cfg, tp) if tp > 1 else None
        try:
            self._build(cfg, capture_logits)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise

    def _build(self, cfg: EngineConfig, capture_logits: bool) -> None:
        # packed weights can't be cut: a shard packs its own after shard_model
        loaded = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, ops=self.ops, pack_weights=self.ranks is None)
        self.model_config = mc = loaded.config
        self.model = loaded.model
        self.tokenizer = Tokenizer(cfg.model)
        self.dtype = next(self.model.parameters()).dtype
        self.weights = self.model.weights_info()
        self.max_model_len = min(cfg.max_model_len or mc.max_model_len, mc.max_model_len)
        # An fp8 KV cache holds twice the blocks of a 16-bit one in the same budget; attention reads it as float32.
        self.kv_dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, self.dtype)
        kv_heads = mc.num_kv_heads
        if self.ranks is not None:  # this process is rank 0 of the model's shards
            kv_heads = shard_model(self.model, 0, cfg.tensor_parallel_size).num_kv_heads
            self.model.pack_cpu_weights()
            self.ranks.join()
        block_bytes = kv_block_bytes(mc.num_layers, cfg.block_size, kv_heads, mc.head_dim, self.kv_dtype)
        num_blocks = cfg.num_kv_blocks or max(2, cfg.kv_cache_memory_bytes // block_bytes)
        self.kv_cache = torch.zeros(
            dataclasses.replace(mc, num_kv_heads=kv_heads).kv_cache_shape(num_blocks, cfg.block_size),
            dtype=self.kv_dtype, device=cfg.device,
        )  # [L, 2, NB, BS, Hkv, D], this rank's KV heads
        # Every rank's pool with its first KV head, rank 0 first: what KV transfer reads and writes (the
        # workers' pools are mapped here: host shared memory, or CUDA IPC from each worker's device).
        self.kv_shards: list[tuple[torch.Tensor, int]] = [(self.kv_cache, 0)]
        if self.ranks is not None:
            world = cfg.tensor_parallel_size
            heads = [head_shard(mc.num_heads, mc.num_kv_heads, r, world) for r in range(world)]
            shapes = [dataclasses.replace(mc, num_kv_heads=h.num_kv_heads).kv_cache_shape(num_blocks, cfg.block_size)
                      for h in heads]
            pools = self.ranks.share_pools(num_blocks, shapes, self.kv_dtype)
            self.kv_shards += [(t, h.kv_start) for t, h in zip(pools, heads[1:], strict=True)]
        # Which blocks this engine holds, per tier, as numbered events (what a node streams to the frontends).
        self.kv_events = KVEventLog()
        # The tier's files are keyed by the model fingerprint (weights, format, dtype): a foreign file is refused.
        self.kv_tier = KVTier(cfg.kv_tier_dir, cfg.kv_tier_bytes, fingerprint=mc.fingerprint(),
                              kv_cache=self.kv_cache, events=self.kv_events.record) if cfg.kv_tier_dir else None
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.prefix_hash_seed, cfg.enable_prefix_caching,
                                          tier=self.kv_tier, events=self.kv_events.record)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            speculative=SpeculativeConfig(
                cfg.speculative, cfg.num_speculative_tokens, min_ngram=cfg.speculative_min_match,
                max_ngram=max(4, cfg.speculative_min_match), min_match=cfg.speculative_min_match,
            ),
        )
        self.sampler = Sampler(seed=cfg.seed, device=cfg.device, ops=self.ops)
        if self.ranks is None:
            self.runner = ModelRunner(self.model, self.kv_cache, cfg.block_size, self.sampler, capture_logits)
        else:
            self.runner = TensorParallelRunner(self.model, self.kv_cache, cfg.block_size, self.sampler, self.ranks,
                                               capture_logits)
        self._requests: dict[str, LiveRequest] = {}  # every request whose finished output is still to come
        self._builder = RequestBuilder(self.tokenizer, mc.vocab_size, self.max_model_len, lambda: self.grammars)
        self.num_blocks = num_blocks
        self.last_step = StepStats()
        self.prefill_watcher: PrefillWatcher | None = None  # see engine.step_hook; set before requests arrive
        log.info("engine ready: %s, weights %s, %d KV blocks of %d tokens (%.1f MiB), speculative %s", mc.arch,
                 self.weights.describe(), num_blocks, cfg.block_size, num_blocks * block_bytes / 2**20,
                 cfg.speculative if cfg.speculative == "off" else f"{cfg.speculative} (k={cfg.num_speculative_tokens})")

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, *, hold_blocks: bool = False,
        resume: Resume | None = None,
    ) -> Sequence:
        """Queues a request. Raises ValueError for an empty prompt, a duplicate id, or one that can't fit.
        With ``hold_blocks`` the request keeps its blocks after finishing until ``release``. With
        ``resume`` it continues after those completion tokens (see ``RequestBuilder.build``)."""
        request = self._new_request(request_id, prompt, params, resume)
        request.seq.hold_blocks = hold_blocks
        self.scheduler.add(request.seq)
        self._requests[request_id] = request
        return request.seq

    def _new_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, resume: Resume | None
    ) -> LiveRequest:
        """Validates a request and builds what the engine keeps for it (`RequestBuilder.build`); registers
        nothing. Raises ValueError (GrammarError for a response format that does not compile or rejects a
        resumed token)."""
        if request_id in self._requests or self.scheduler.knows(request_id):
            raise ValueError(f"request id {request_id!r} is already running")
        return self._builder.build(request_id, prompt, params, resume)

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """The structured-output grammar compiler, thread-safe (built on first use: llguidance's token
        trie takes a fifth of a second for a 49k vocabulary). Python's cached_property locks nothing,
        so two threads may both build one on first use; one of them is kept and either works."""
        return GrammarCompiler(self.tokenizer, self.model_config.vocab_size)

    def abort(self, request_id: str) -> bool:
        """Drops a request wherever it is (queued, running, held, reserved) and frees its blocks at once.
        Returns whether it existed. A reserved request must not have a transfer writing its blocks."""
        request = self._requests.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None or request is not None

    def release(self, request_id: str) -> bool:
        """Frees the blocks a finished request still holds: a ``hold_blocks`` request after its transfer,
        or a reserved request that finished at its first token. Returns whether any were held."""
        return self.scheduler.release(request_id) is not None

    def held_block_table(self, request_id: str) -> list[int]:
        """Block ids of a finished ``hold_blocks`` request, in token order. Raises KeyError if not held."""
        for seq in self.scheduler.held_seqs:
            if seq.seq_id == request_id:
                return list(seq.block_table)
        raise KeyError(request_id)

    # -- transferred prompts (decode side of a disaggregated request) ----------------------------

    def prefix_hit_tokens(self, prompt_ids: list[int]) -> int:
        """Prompt tokens the prefix cache holds right now, in whole blocks and short of the last prompt
        token (a reservation may share one block more when the prompt fills its last block). Changes
        nothing."""
        if len(prompt_ids) < 2:
            return 0
        probe = Sequence("prefix-probe", list(prompt_ids), SamplingParams(max_tokens=1))
        return self.block_manager.num_prefix_hit_tokens(probe)

    def reserve(
        self, request_id: str, prompt: list[int], params: SamplingParams, resume: Resume | None = None
    ) -> Reservation | None:
        """Reserves blocks for a request whose context K/V (prompt, and resumed tokens) will arrive by
        transfer (prefix-cache hits are shared instead; see ``Scheduler.reserve``). Returns None,
        registering nothing, when the KV cache cannot fit it now; raises ValueError like ``add_request``.
        Follow with ``append_first_token`` and ``land``, ``prefill_here``, or ``abort``."""
        request = self._new_request(request_id, prompt, params, resume)
        reservation = self.scheduler.reserve(request.seq)
        if reservation is None:
            return None
        self._requests[request_id] = request
        return reservation

    def append_first_token(self, request_id: str, token_id: int, logprob: TokenLogprob | None) -> RequestOutput:
        """Appends the first token sampled by the prefill node to a reserved request and returns its
        delta (detokenized here). If that token ends the request, the output is finished but the
        reservation stays until ``release``, since a transfer may still be writing it. Raises KeyError
        for a request that is not reserved, ValueError if it has its first token already."""
        seq = self._requests[request_id].seq
        self.scheduler.append_first_token(request_id, token_id)
        if logprob is not None and seq.params.logprobs is not None:
            seq.logprobs.append(logprob)
        return self._emit(seq, [token_id], seq.is_finished)

    def land(self, request_id: str) -> None:
        """The transfer into a reserved request's blocks completed: it decodes from the next step on
        (``Scheduler.land``). Raises KeyError if it is not reserved (e.g. finished), ValueError if it has
        no first token."""
        self.scheduler.land(request_id)

    def prefill_here(self, request_id: str) -> Sequence:
        """Turns a reserved request into an ordinary queued one (its K/V will not arrive by transfer):
        the reservation is freed, shared prefix-cache blocks staying cached for the local prefill to
        find again, and the same sequence (params, seed, detokenizer) is queued to be computed here from
        its prompt plus every token it has, like a preempted sequence (``Scheduler.prefill_here``). Before
        the first token that is the prompt (and resumed tokens); after it, the first token too, so the next
        output continues the stream with neither gap nor repeat. The caller guarantees no transfer
        still writes the reservation. Raises KeyError if it is not reserved."""
        seq = self.scheduler.get(request_id)
        if seq is None or seq.status != SequenceStatus.RESERVED:
            raise KeyError(request_id)
        return self.scheduler.prefill_here(request_id)

    def prefill_backlog_tokens(self) -> int:
        """Context tokens this engine still has to prefill (`Scheduler.prefill_backlog_tokens`: decoding
        and landed sequences count 0). Changes nothing."""
        return self.scheduler.prefill_backlog_tokens()

    def load(self) -> EngineLoad:
        """A snapshot of queues and KV cache occupancy. Changes nothing."""
        bm = self.block_manager
        held = self.scheduler.held_seqs
        reserved = self.scheduler.reserved_seqs
        return EngineLoad(
            waiting=self.scheduler.num_waiting,
            running=self.scheduler.num_running,
            kv_blocks_total=self.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_blocks_cached=bm.num_evictable_blocks,
            held_requests=len(held),
            held_blocks=sum(len(s.block_table) for s in held),
            reserved_requests=len(reserved),
            reserved_blocks=sum(len(s.block_table) for s in reserved),
        )

    @property
    def spec_stats(self) -> SpeculativeStats:
        """Speculative decoding's counters since the engine started (all zero when it is off)."""
        return self.scheduler.spec_stats

    def close(self) -> None:
        """Puts the KV tier's pending blocks on disk (a restarted node finds them). Call once, at the end."""
        if self.kv_tier is not None:
            self.kv_tier.close()
        if self.ranks is not None:
            self.ranks.close()

    def has_unfinished(self) -> bool:
        """Whether a step has anything to schedule (reserved requests wait for their transfer)."""
        return self.scheduler.has_unfinished()

    def check_integrity(self) -> EngineRequests:
        """Asserts the scheduler's and block manager's invariants, that the engine's per-request
        records match the scheduler's unfinished sequences and that each constrained sequence's grammar
        consumed exactly its completion tokens; returns the ids by state. Changes nothing.
        Call between steps (on the engine thread)."""
        sched = self.scheduler
        scheduled = frozenset(s.seq_id for s in (*sched.waiting_seqs, *sched.running_seqs))
        reserved = frozenset(s.seq_id for s in sched.reserved_seqs)
        held = frozenset(s.seq_id for s in sched.held_seqs)
        sched.check_integrity()
        if self.ranks is not None:  # every rank ran the same plans over a pool of the same blocks
            self.ranks.check(self.num_blocks)
        if self.kv_tier is not None:  # its writes done, then its index against its files
            self.kv_tier.flush()
            self.kv_tier.check_integrity()
        assert self._requests.keys() == scheduled | reserved, (
            f"engine records {sorted(self._requests)} != unfinished sequences {sorted(scheduled | reserved)}")
        for rid, request in self._requests.items():
            seq = request.seq
            assert seq.seq_id == rid and not seq.is_finished
            # a constrained sequence's grammar has consumed exactly its completion tokens
            assert (seq.grammar is None) == (seq.params.structured is None), rid
            assert seq.grammar is None or seq.grammar.num_tokens == seq.num_completion_tokens, rid
        return EngineRequests(scheduled, reserved, held)

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled batch and returns a delta for every request that produced something."""
        out = self.scheduler.schedule()
        self.last_step = StepStats(len(out.decode_seqs), sum(out.prefill_chunk_lens), len(out.preempted))
        if not out.decode_seqs and not out.prefill_seqs:
            return [self._emit(seq, [], True) for seq in out.rejected]
        watcher = self.prefill_watcher
        hook = None
        if watcher is not None:
            completing = [s for s, n in zip(out.prefill_seqs, out.prefill_chunk_lens, strict=True)
                          if s.num_computed_tokens + n == s.num_tokens]
            hook = watcher(completing) if completing else None
        started = time.perf_counter()
        if hook is None:
            res = self.runner.run(out)
            if not out.prefill_seqs:  # what a decode step of this many rows costs (speculation's cost model)
                self.scheduler.step_costs.record(len(out.decode_seqs) + out.num_draft_tokens, time.perf_counter() - started)
        else:
            try:
                res = self.runner.run(out, hook.layer_done)
            except BaseException:
                hook.step_done(False)
                raise
            hook.step_done(True)
        before = {sid: self._requests[sid].seq.num_tokens for sid in res.sampled}
        finished = {s.seq_id for s in self.scheduler.update(out, res.sampled, res.accepted)}
        outputs = [self._emit(seq, [], True) for seq in out.rejected]
        for seq_id, num_before in before.items():
            request = self._requests[seq_id]
            seq = request.seq
            new = seq.token_ids[num_before:]  # accepted drafts, then the sampled token (cut at a stop)
            seq.logprobs.extend(res.logprobs.get(seq_id, [])[: len(new)])
            if res.logits is not None:
                request.logits.extend(res.logits[seq_id][: len(new)])
            outputs.append(self._emit(seq, new, seq_id in finished))
        return outputs

    def _emit(self, seq: Sequence, new_tokens: list[int], finished: bool) -> RequestOutput:
        request = self._requests[seq.seq_id]
        detok = request.detok
        text_tokens = new_tokens
        if finished and seq.finish_reason == FinishReason.STOP and isinstance(seq.stop_reason, int):
            text_tokens = text_tokens[:-1]  # a stop token id ends the request without its text
        fed = detok.num_tokens
        delta = detok.add(text_tokens) if text_tokens else None
        text = request.pending_text + (delta.text if delta is not None else "")
        request.pending_text = ""
        if delta is not None and delta.stopped and delta.stop_token_index is not None:
            # tokens after the one completing the stop string (accepted drafts of the same step) are dropped
            drop = len(new_tokens) - (delta.stop_token_index - fed + 1)
            if drop > 0 or not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.STOP, stop_reason=delta.stop_string, num_dropped_tokens=drop)
                if drop > 0:
                    new_tokens = new_tokens[:-drop]
                    del request.logits[-drop:]
                    if seq.params.logprobs is not None:
                        del seq.logprobs[len(seq.logprobs) - drop :]
            finished = True
        if finished and not (delta is not None and delta.stopped):
            text += detok.flush()
        n_lp = len(new_tokens) if seq.params.logprobs is not None else 0
        outp = RequestOutput(
            request_id=seq.seq_id,
            new_token_ids=new_tokens,
            new_text=text,
            new_logprobs=seq.logprobs[len(seq.logprobs) - n_lp :] if n_lp else [],
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            stop_reason=seq.stop_reason if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_completion_tokens=seq.num_completion_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )
        if finished:
            self._requests.pop(seq.seq_id, None)
        return outp

    # -- embeddings (prefill-only, outside the scheduler) -----------------------------------------

    def check_embed_prompts(self, prompts: list[list[int]]) -> None:
        """Raises ValueError for an empty prompt, an id outside the vocabulary or a prompt longer than
        max_model_len."""
        vocab = self.model_config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"input {i} is empty")
            if len(p) > self.max_model_len:
                raise ValueError(f"input {i} has {len(p)} tokens; the context is {self.max_model_len}")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"input {i} has token ids outside [0, {vocab})")

    def embed_tensor(self, prompts: list[list[int]], pooling: str = "last", normalize: bool = True) -> torch.Tensor:
        """The prompts' pooled final hidden states, [N, hidden] float32 on the CPU (`engine.embedding`),
        run in batches of at most max_num_batched_tokens tokens over a scratch KV cache: the engine's KV
        cache, blocks and scheduler are untouched. Raises ValueError as `check_embed_prompts`, or for an
        unknown pooling. Call between steps (on the engine thread)."""
        if self.ranks is not None:
            raise ValueError("embeddings run with tensor_parallel_size 1 only")
        check_pooling(pooling)
        self.check_embed_prompts(prompts)
        if not prompts:
            return torch.empty(0, self.model_config.hidden_size, dtype=torch.float32)
        parts = []
        try:
            for idx in token_batches([len(p) for p in prompts], self.cfg.max_num_batched_tokens):
                parts.append(pooled_hidden(self.model, [prompts[i] for i in idx], self.cfg.block_size,
                                           self.kv_dtype, self.kv_cache.device, pooling, normalize))
        finally:
            self.model._layer_caches(self.kv_cache)  # the model's cached views point at the KV cache again
        return torch.cat(parts)

    def embed(self, prompts: list[list[int]], pooling: str = "last", normalize: bool = True) -> list[list[float]]:
        """`embed_tensor` as lists of floats (offline use and tests)."""
        return self.embed_tensor(prompts, pooling, normalize).tolist()

    # -- offline ----------------------------------------------------------------------------------

    def generate(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Runs all prompts together under continuous batching until every one finishes."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, GenerationResult] = {}
        order = []
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            rid = f"gen-{time.monotonic_ns()}-{i}"
            seq = self.add_request(rid, p, sp)
            order.append(rid)
            results[rid] = GenerationResult(rid, list(seq.token_ids), [], "", None, None)
        requests = {rid: self._requests[rid] for rid in order}
        while self.has_unfinished():
            for o in self.step():
                r = results[o.request_id]
                r.text += o.new_text
                if o.finished:
                    seq = requests[o.request_id].seq
                    r.token_ids = seq.completion_token_ids
                    r.finish_reason, r.stop_reason = o.finish_reason, o.stop_reason
                    r.logprobs = list(seq.logprobs)
                    r.num_cached_tokens = seq.num_cached_tokens
                    r.logits = requests[o.request_id].logits
        return [results[rid] for rid in order]
