"""The engine loop: requests in, token/text deltas out. Used offline (`generate`) and by both node kinds."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.loader import load_model
from engine.model_runner import ModelRunner, kv_block_bytes
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, TokenLogprob
from engine.tokenizer import Tokenizer
from kernels import get_kernel_ops

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RequestOutput:
    """What one request produced in one step (a delta), plus its running totals."""

    request_id: str
    new_token_ids: list[int]  # tokens generated this step (usually 1)
    new_text: str  # text released this step (held back while it could still become a stop string)
    new_logprobs: list[TokenLogprob]  # one per new token when the request asked for logprobs
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
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
    finish_reason: str | None
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


class LLMEngine:
    """Owns one model, one KV pool and one scheduler. Not thread-safe: drive it from one thread."""

    def __init__(self, cfg: EngineConfig, capture_logits: bool = False):
        self.cfg = cfg
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        dtype = None if cfg.dtype == "auto" else _DTYPES[cfg.dtype]
        self.ops = get_kernel_ops(cfg.kernel_backend, cfg.device)
        loaded = load_model(cfg.model, dtype=dtype, device=cfg.device, ops=self.ops)
        self.model_config = mc = loaded.config
        self.model = loaded.model
        self.tokenizer = Tokenizer(cfg.model)
        self.dtype = next(self.model.parameters()).dtype
        self.max_model_len = min(cfg.max_model_len or mc.max_model_len, mc.max_model_len)
        block_bytes = kv_block_bytes(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, self.dtype)
        num_blocks = cfg.num_kv_blocks or max(2, cfg.kv_cache_memory_bytes // block_bytes)
        self.kv_cache = torch.zeros(
            (mc.num_layers, 2, num_blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim),
            dtype=self.dtype, device=cfg.device,
        )  # [L, 2, NB, BS, Hkv, D]
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.prefix_hash_seed, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens
        )
        self.sampler = Sampler(seed=cfg.seed, device=cfg.device)
        self.runner = ModelRunner(self.model, self.kv_cache, cfg.block_size, self.sampler, capture_logits)
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._logits: dict[str, list[torch.Tensor]] = {}
        self.num_blocks = num_blocks
        self.last_step = StepStats()
        log.info("engine ready: %s, %d KV blocks of %d tokens (%.1f MiB)", mc.arch, num_blocks,
                 cfg.block_size, num_blocks * block_bytes / 2**20)

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Queues a request. Raises ValueError for an empty prompt, a duplicate id, or one that can't fit."""
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"length of {self.max_model_len} tokens"
            )
        seq = Sequence(request_id, ids, params, eos_token_ids=self.tokenizer.eos_token_ids)
        self._seqs[request_id] = seq
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Drops a request wherever it is and frees its blocks at once. Returns whether it existed."""
        seq = self._seqs.pop(request_id, None)
        self._detok.pop(request_id, None)
        self._logits.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled batch and returns a delta for every request that produced something."""
        out = self.scheduler.schedule()
        self.last_step = StepStats(len(out.decode_seqs), sum(out.prefill_chunk_lens), len(out.preempted))
        if not out.decode_seqs and not out.prefill_seqs:
            return [self._emit(seq, [], True) for seq in out.rejected]
        res = self.runner.run(out)
        for seq_id, lp in res.logprobs.items():
            self._seqs[seq_id].logprobs.append(lp)
        if res.logits is not None:
            for seq_id, lg in res.logits.items():
                self._logits.setdefault(seq_id, []).append(lg)
        finished = {s.seq_id for s in self.scheduler.update(out, res.sampled)}
        outputs = [self._emit(seq, [], True) for seq in out.rejected]
        for seq_id, token in res.sampled.items():
            seq = self._seqs[seq_id]
            outputs.append(self._emit(seq, [token], seq_id in finished))
        return outputs

    def _emit(self, seq: Sequence, new_tokens: list[int], finished: bool) -> RequestOutput:
        detok = self._detok[seq.seq_id]
        text_tokens = new_tokens
        if finished and seq.finish_reason == "stop" and isinstance(seq.stop_reason, int):
            text_tokens = []  # a stop token id ends the request without its text
        delta = detok.add(text_tokens) if text_tokens else None
        text = delta.text if delta is not None else ""
        if delta is not None and delta.stopped and not seq.is_finished:
            self.scheduler.finish(seq, "stop", stop_reason=delta.stop_string)
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
            self._seqs.pop(seq.seq_id, None)
            self._detok.pop(seq.seq_id, None)
        return outp

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
        seqs = {rid: self._seqs[rid] for rid in order}
        while self.has_unfinished():
            for o in self.step():
                r = results[o.request_id]
                r.text += o.new_text
                if o.finished:
                    seq = seqs[o.request_id]
                    r.token_ids = seq.completion_token_ids
                    r.finish_reason, r.stop_reason = o.finish_reason, o.stop_reason
                    r.logprobs = list(seq.logprobs)
                    r.num_cached_tokens = seq.num_cached_tokens
                    r.logits = self._logits.pop(o.request_id, [])
        return [results[rid] for rid in order]
