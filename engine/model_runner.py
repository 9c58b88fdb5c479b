"""Turns a scheduled step into tensors, runs the model over the paged KV cache, and samples."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.batch import SchedulerOutput
from pdserve.engine.parallel import RankGroup, StepPlan
from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import Sequence, TokenLogprob


@dataclass
class StepResult:
    sampled: dict[str, int]  # seq_id -> new token, for sequences whose step ended at their last token
    logprobs: dict[str, list[TokenLogprob]]  # seq_id -> one record per new token, where the request asked
    num_tokens: int  # tokens run through the model this step
    logits: dict[str, list[torch.Tensor]] | None = None  # seq_id -> [V] float32 per new token (capture_logits)
    # seq_id -> the draft tokens verification accepted (they come before ``sampled``); drafting sequences only
    accepted: dict[str, list[int]] = field(default_factory=dict)


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    """Owns the KV cache tensor and the model. `run` writes the step's K/V into the cache slots the
    scheduler assigned and returns sampled tokens; it changes no scheduling state."""

    def __init__(
        self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, sampler: Sampler,
        capture_logits: bool = False,
    ):
        self.model = model
        self.capture_logits = capture_logits  # tests compare logits with a reference implementation
        self.kv_cache = kv_cache  # [L, 2, NB, BS, Hkv, D]
        self.block_size = block_size
        self.sampler = sampler
        self.device = kv_cache.device

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Sequence]]:
        """Builds (input_ids [T], positions [T], metadata, rows to sample, their sequences). A decoding
        sequence with d draft tokens takes d + 1 decode rows (its last token, then the drafts), row j
        attending over its first num_tokens + j tokens; every row of it is sampled."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        decode_tables: list[list[int]] = []
        decode_ctx: list[int] = []
        for seq, draft in zip(out.decode_seqs, out.decode_drafts, strict=True):
            last = seq.num_tokens - 1
            for j, token in enumerate([seq.token_ids[last], *draft]):
                p = last + j
                ids.append(token)
                pos.append(p)
                slots.append(seq.block_table[p // self.block_size] * self.block_size + p % self.block_size)
                decode_tables.append(seq.block_table)
                decode_ctx.append(p + 1)
                sample_rows.append(len(ids) - 1)
            sample_seqs.append(seq)
        cu = [0]
        ctx: list[int] = []
        for seq, n in zip(out.prefill_seqs, out.prefill_chunk_lens, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(self._slots(seq, start, end))
            cu.append(cu[-1] + n)
            ctx.append(end)
            if end == seq.num_tokens:  # the chunk completes the sequence: its last row yields a token
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        nd = len(decode_ctx)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            num_decode_tokens=nd,
            decode_block_tables=self._block_tables(decode_tables) if nd else None,
            decode_context_lens=self._tensor(decode_ctx, torch.int32) if nd else None,
            prefill_block_tables=self._block_tables([s.block_table for s in out.prefill_seqs]) if out.prefill_seqs else None,
            prefill_cu_seqlens_q=self._tensor(cu, torch.int32) if out.prefill_seqs else None,
            prefill_context_lens=self._tensor(ctx, torch.int32) if out.prefill_seqs else None,
        )
        return self._tensor(ids, torch.int64), self._tensor(pos, torch.int64), meta, sample_rows, sample_seqs

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rows: list[int],
                on_layer: Callable[[int], None] | None) -> torch.Tensor | None:  # [N, V] float32; None: no rows
        """Runs the model over the step and returns the logits of `rows` (a tensor-parallel runner overrides it)."""
        hidden = self.model(input_ids, positions, meta, self.kv_cache, on_layer)  # [T, hidden]
        if not rows:
            return None
        if len(rows) < hidden.shape[0]:  # rows ascend, so all of them means every row in order
            hidden = hidden.index_select(0, torch.tensor(rows, device=hidden.device))  # [N, hidden]
        return self.model.compute_logits(hidden)  # [N, V] float32

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, on_layer: Callable[[int], None] | None = None) -> StepResult:
        """Runs the step; `on_layer(i)` is called after layer i's ops were issued (engine.step_hook)."""
        input_ids, positions, meta, rows, seqs = self.prepare(out)
        logits = self._logits(input_ids, positions, meta, rows, on_layer)  # [N, V] float32
        if logits is None:
            return StepResult({}, {}, int(input_ids.shape[0]))
        drafts = out.decode_drafts + [[] for _ in range(len(seqs) - len(out.decode_seqs))]
        res = self.sampler.verify(logits, seqs, drafts)
        sampled = {s.seq_id: t[-1] for s, t in zip(seqs, res.token_ids, strict=True)}
        accepted = {s.seq_id: t[:-1] for s, t, d in zip(seqs, res.token_ids, drafts, strict=True) if d}
        lps = {s.seq_id: lp for s, lp in zip(seqs, res.logprobs, strict=True) if lp}
        captured = None
        if self.capture_logits:
            starts = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))[:-1]  # each seq's first row
            captured = {s.seq_id: [logits[r + j].clone() for j in range(len(t))]
                        for s, t, r in zip(seqs, res.token_ids, starts, strict=True)}
        return StepResult(sampled, lps, int(input_ids.shape[0]), captured, accepted)


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner at TP > 1: the same step, its plan broadcast to the worker ranks, the model (this
    rank's shard) run by all of them together, the vocabulary shards gathered here for the sampler."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, sampler: Sampler,
                 ranks: RankGroup, capture_logits: bool = False):
        super().__init__(model, kv_cache, block_size, sampler, capture_logits)
        self.ranks = ranks

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rows: list[int],
                on_layer: Callable[[int], None] | None) -> torch.Tensor | None:
        logits = self.ranks.step(self.model, StepPlan(input_ids, positions, meta, rows), self.kv_cache)
        if on_layer is not None:  # the layers ran inside the collective step: report them done together
            for i in range(self.model.cfg.num_layers):
                on_layer(i)
        return logits
