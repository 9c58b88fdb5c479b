"""Continuous-batching scheduler: picks each step's decodes and prefill chunks under a token budget.

Per step, in this order: running decodes (one token each, oldest first), landed sequences (whose prompt
K/V arrived by transfer: straight to decoding), draft tokens for the decoding sequences whose proposer
has some (speculative decoding, `engine.speculative`: from what budget and free blocks are left, never
preempting for them), running partial prefills (chunked), then waiting requests
in priority order, first-come-first-served within a priority (prefix-cache hits applied, chunked to what
is left of the budget). `SamplingParams.priority`: lower is more urgent; with one priority everywhere the
order is plain FCFS.

The scheduler owns every sequence state and is the only code that sets one (`SequenceStatus`):

    add ──> WAITING ──schedule──> RUNNING ──update/finish──> FINISHED
                 ^                   │ preempt                  ^   (held: blocks kept until release)
                 └───────────────────┘                          │
    reserve ──> RESERVED ──land──> WAITING (landed queue) ──────┘
                 │ append_first_token ends it / finish ──> FINISHED, held until release
                 │ prefill_here (its K/V will not arrive) ──> WAITING, blocks freed, computed here
                 └ abort ──> FINISHED, blocks freed

A RESERVED sequence holds blocks for a prompt whose K/V are written from outside (a KV transfer); it is
never scheduled. ``land`` commits them once the transfer landed; ``prefill_here`` frees them and queues
the sequence to be computed here if it failed.

When the KV cache runs out of blocks for a running sequence, the least urgent running sequence (the newest
among equals) is preempted (blocks freed, progress dropped, put back at the front of its priority in the
waiting queue) and the allocation is retried; a waiting sequence that finds no blocks or no slot
preempts running ones only when they are strictly less urgent; a preempted sequence is later recomputed
from prompt + tokens generated so far, usually mostly from the prefix cache. A sequence that can never
fit the whole KV cache is finished instead of spinning: finish_reason "abort" if its prompt alone does not
fit, "length" if it outgrew the KV cache while generating. Such sequences appear in
``SchedulerOutput.rejected`` and in the list ``update`` returns.

Where each sequence is (its queue, or reserved, or held) and the read-only views of that are the base
class's, `engine.seq_queues.SequenceQueues`; every decision and every state change is made here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from pdserve.engine.batch import SchedulerConfig, SchedulerOutput, StepPlan
from pdserve.engine.block_manager import BlockManager, Reservation
from pdserve.engine.seq_queues import SequenceQueues
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.speculative import (
    DraftState,
    Proposer,
    SpeculativeConfig,
    SpeculativeStats,
    StepCosts,
    draft_length,
)
from pdserve.engine.stopping import FINISH_REASONS, FinishReason, StopDecision, stop_decision


class Scheduler(SequenceQueues):
    """Schedules the sequences of one engine. Changes the ``Sequence`` objects it is given (status,
    ``num_computed_tokens``, ``token_ids``, finish fields) and their blocks in ``block_manager``."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_prefill_chunk: int = 0,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_prefill_chunk)
        self.block_manager = block_manager
        self.speculative = speculative or SpeculativeConfig()
        self.spec_stats = SpeculativeStats()
        self.step_costs = StepCosts(max_rows=max_num_batched_tokens)  # the engine records decode-only steps
        # Builds a drafting sequence's proposer (None: the configured method's); tests plant their own.
        self.proposer_factory: Callable[[Sequence], Proposer] | None = None
        self._num_preemptions = 0

    @property
    def num_preemptions(self) -> int:
        """Preemptions since this scheduler was built."""
        return self._num_preemptions

    # ----------------------------------------------------------------------------------- requests

    def release(self, seq_id: str) -> Sequence | None:
        """Frees the blocks of a finished sequence that still holds them (a ``hold_blocks`` one after its
        transfer, or a reserved one finished at its first token). Returns it, or None if none is held."""
        seq = self._held.pop(seq_id, None)
        if seq is not None:
            self.block_manager.free(seq)
        return seq

    def add(self, seq: Sequence) -> None:
        """Queues a new request behind the waiting requests of its priority and more urgent ones."""
        self._check_new(seq)
        self._enqueue(seq, front=False)

    def reserve(self, seq: Sequence) -> Reservation | None:
        """Sets aside blocks for the tokens of a new sequence whose K/V will be written from outside (a
        transfer), sharing prefix-cache hits (``BlockManager.reserve``). Returns None, changing nothing,
        when the KV cache cannot fit it now; else it is RESERVED until ``land``, ``prefill_here``, ``finish``,
        ``abort``."""
        self._check_new(seq)
        reservation = self.block_manager.reserve(seq, seq.num_tokens)
        if reservation is None:
            return None
        seq.status = SequenceStatus.RESERVED
        self._reserved[seq.seq_id] = seq
        return reservation

    def append_first_token(self, seq_id: str, token_id: int) -> StopDecision | None:
        """Appends the token the prefill node sampled to a RESERVED sequence and applies the stop decision;
        one it ends is FINISHED but keeps its blocks until ``release`` (a transfer may still write them).
        Raises KeyError if none is reserved under ``seq_id``, ValueError if it has its first token."""
        seq = self._reserved[seq_id]
        if seq.num_new_tokens:
            raise ValueError(f"sequence {seq_id} already has its first token")
        seq.append_token(token_id)
        decision = self._stop_decision(seq)
        if decision is not None:
            self.finish(seq, decision.finish_reason, decision.stop_reason)
        return decision

    def land(self, seq_id: str) -> Sequence:
        """The transfer into a RESERVED sequence's blocks completed: marks its K/V computed, commits its full
        blocks to the prefix cache and queues it for a running slot (straight to decoding). Raises
        KeyError if none is reserved under ``seq_id``, ValueError if it has no first token yet."""
        seq = self._reserved[seq_id]
        if not seq.num_new_tokens:
            raise ValueError(f"sequence {seq_id} has no first token")
        self.block_manager.commit_filled(seq, seq.num_tokens - 1)
        del self._reserved[seq_id]
        seq.status = SequenceStatus.WAITING
        self._queue(self._landed, seq, front=False)
        return seq

    def prefill_here(self, seq_id: str) -> Sequence:
        """A RESERVED sequence whose K/V will not arrive is freed (prefix-cache hits stay cached) and
        queued at the back, to be recomputed like a preempted one from every token it has (resumed ones
        and a first token included). No transfer may still write its blocks. KeyError if not reserved."""
        seq = self._reserved.pop(seq_id)
        self._enqueue(seq, front=False)
        return seq

    def abort(self, seq_id: str) -> Sequence | None:
        """Finishes an unfinished sequence in whatever state with finish_reason "abort", freeing its
        blocks (a held sequence's too). Returns it, or None if no sequence with that id is here."""
        held = self.release(seq_id)
        seq = held or self.get(seq_id)
        if held is None and seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq

    def finish(
        self, seq: Sequence, finish_reason: FinishReason, stop_reason: str | int | None = None,
        num_dropped_tokens: int = 0,
    ) -> None:
        """Marks ``seq`` finished with ``finish_reason`` and ``stop_reason``, dropping it from the queues and
        freeing its blocks. On an already finished sequence only the two reason fields change (e.g. a
        stop string matched by the last token of a sequence that also hit max_tokens). Finished other than
        by abort, a ``hold_blocks`` or RESERVED sequence keeps its blocks until ``release``. The last
        ``num_dropped_tokens`` generated tokens are removed (drafts accepted past a stop string)."""
        if finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {sorted(FINISH_REASONS)}, got {finish_reason!r}")
        if not 0 <= num_dropped_tokens <= seq.num_new_tokens:
            raise ValueError(f"cannot drop {num_dropped_tokens} of {seq.num_new_tokens} generated tokens")
        if not seq.is_finished:
            if self.get(seq.seq_id) is not seq:
                raise ValueError(f"sequence {seq.seq_id} is not scheduled here")
            keep = (seq.hold_blocks or seq.status == SequenceStatus.RESERVED) and finish_reason != FinishReason.ABORT
            self._forget(seq, keep_blocks=keep)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason
        seq.stop_reason = stop_reason
        if num_dropped_tokens:
            del seq.token_ids[-num_dropped_tokens:]
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)

    # ----------------------------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        """Decides this step's batch, allocating blocks (and preempting) as needed."""
        step = StepPlan(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step, decoding=True)
        # Landed sequences only decode, so they join the decodes ahead of any prefill work.
        self._start_landed(step)
        self._add_drafts(step)
        self._schedule_running(step, decoding=False)
        # Blocks just ran short: starting more work now would only be preempted again.
        if not step.preempted:
            self._start_waiting(step)
        decode_seqs = [s for s in self._running if s in step.decoding]
        prefill_seqs = [s for s in self._running if s in step.tokens and s not in step.decoding]
        out = SchedulerOutput(
            decode_seqs=decode_seqs,
            prefill_seqs=prefill_seqs,
            prefill_chunk_lens=[step.tokens[s] for s in prefill_seqs],
            preempted=step.preempted,
            rejected=step.rejected,
            num_batched_tokens=self.config.max_num_batched_tokens - step.budget,
            decode_drafts=[step.drafts.get(s, []) for s in decode_seqs],
        )
        assert out.num_batched_tokens == len(decode_seqs) + out.num_draft_tokens + sum(out.prefill_chunk_lens)
        assert len(decode_seqs) + len(prefill_seqs) <= self.config.max_running
        return out

    def update(
        self, out: SchedulerOutput, sampled: dict[str, int], accepted: dict[str, list[int]] | None = None
    ) -> list[Sequence]:
        """Applies a computed step: advances ``num_computed_tokens`` by what was computed, commits newly
        full blocks to the prefix cache, appends each sequence's accepted draft tokens (``accepted``,
        a prefix of its draft) and then its sampled token, finishing it at the first of them that is EOS
        (unless ``ignore_eos``), a stop token id, a complete grammar or ``max_tokens`` (the rest are
        dropped), and frees its blocks; a drafting sequence that goes on gives back the blocks its
        rejected drafts left empty. Sequences finished or aborted since ``schedule`` are skipped.
        Returns the sequences that finished this step, ``out.rejected`` included."""
        accepted = accepted or {}
        drafts = {s: d for s, d in zip(out.decode_seqs, out.decode_drafts, strict=True) if d}
        decoding = set(out.decode_seqs)
        work = [(s, 1) for s in out.decode_seqs]
        work += zip(out.prefill_seqs, out.prefill_chunk_lens, strict=True)
        live = [(s, n) for s, n in work if s.status == SequenceStatus.RUNNING]
        missing = [
            s.seq_id for s, n in live if s.num_computed_tokens + n == s.num_tokens and s.seq_id not in sampled
        ]
        if missing:
            raise ValueError(f"no sampled token for {missing}")
        finished = list(out.rejected)
        stats = self.spec_stats
        for seq, num_tokens in live:
            seq.num_computed_tokens += num_tokens
            assert seq.num_computed_tokens <= seq.num_tokens, f"{seq.seq_id} computed past its tokens"
            if seq.num_computed_tokens < seq.num_tokens:
                self.block_manager.commit(seq)
                continue
            draft = drafts.get(seq, [])
            kept = accepted.get(seq.seq_id, [])
            assert kept == draft[: len(kept)], f"{seq.seq_id}: accepted tokens are not a prefix of its draft"
            decision = None
            for i, token in enumerate([*kept, sampled[seq.seq_id]]):
                seq.append_token(token)
                if i < len(kept):  # an accepted draft: its K/V were computed this step
                    seq.num_computed_tokens += 1
                decision = self._stop_decision(seq)
                if decision is not None:
                    break
            self.block_manager.commit(seq)
            if seq in decoding:
                stats.decode_steps += 1
                stats.decode_tokens += len(kept) + 1
            if draft:
                stats.drafted_tokens += len(draft)
                stats.accepted_tokens += len(kept)
                stats.emitted_tokens += len(kept) + 1
                stats.draft_steps += 1
                assert seq.draft is not None
                seq.draft.record(len(draft), len(kept), seq.num_tokens)
            if decision is not None:
                self.finish(seq, decision.finish_reason, decision.stop_reason)
                finished.append(seq)
            elif draft:
                self.block_manager.trim(seq)
        return finished

    def check_integrity(self) -> None:
        """Asserts the queue invariants and the block manager's; changes nothing."""
        bm = self.block_manager
        holders = self._check_places()
        assert len(self._running) <= self.config.max_running
        for seq in self._waiting:
            assert seq.status == SequenceStatus.WAITING and not bm.holds(seq) and not seq.block_table
            assert seq.num_computed_tokens == 0
        for seq_id, seq in self._reserved.items():
            assert seq.seq_id == seq_id and seq.status == SequenceStatus.RESERVED and bm.holds(seq)
            assert seq.num_new_tokens <= 1 and seq.num_computed_tokens < seq.num_tokens
        for seq in self._landed:
            assert seq.status == SequenceStatus.WAITING and bm.holds(seq)
            assert seq.num_computed_tokens == seq.num_tokens - 1
        for seq in self._running:
            assert seq.status == SequenceStatus.RUNNING and bm.holds(seq)
            assert seq.num_computed_tokens < seq.num_tokens
            # no block beyond the sequence's tokens (rejected drafts gave theirs back)
            assert len(seq.block_table) <= bm.blocks_needed(seq.num_tokens), f"{seq.seq_id} holds empty blocks"
        for seq_id, seq in self._held.items():
            assert seq.seq_id == seq_id and seq.is_finished and bm.holds(seq)
        assert bm.num_holders == sum(1 for s in holders if bm.holds(s)), "a block holder is unknown here"
        bm.check_integrity()

    # ----------------------------------------------------------------------------------- internals

    def _check_new(self, seq: Sequence) -> None:
        if seq.is_finished:
            raise ValueError(f"sequence {seq.seq_id} is already finished")
        if self.knows(seq.seq_id):
            raise ValueError(f"a sequence with id {seq.seq_id} is already scheduled")
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} must arrive with no blocks and nothing computed")

    def _chunk_len(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        if self.config.max_prefill_chunk:
            n = min(n, self.config.max_prefill_chunk)
        return n

    def _schedule_running(self, step: StepPlan, decoding: bool) -> None:
        for seq in list(self._running):  # a copy: preemption removes sequences on the way
            if step.budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING or seq in step.tokens or seq.is_prefilling == decoding:
                continue
            if decoding:
                n = 1
            else:
                n = self._chunk_len(seq.num_tokens - seq.num_computed_tokens, step.budget)
            if self._allocate_or_preempt(seq, n, step):
                step.add(seq, n, decode=decoding)

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int, step: StepPlan) -> bool:
        """Allocates blocks for ``num_tokens`` more tokens of running ``seq``, preempting the least urgent
        running sequences until it fits; False if ``seq`` itself had to be preempted."""
        while not self.block_manager.allocate(seq, num_tokens):
            victim = self._victim()
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _victim(self) -> Sequence:
        """The running sequence to preempt first: the least urgent, the newest among equals."""
        running = self._running
        return running[max(range(len(running)), key=lambda i: (running[i].params.priority, i))]

    def _make_room(self, seq: Sequence, step: StepPlan) -> bool:
        """Preempts the least urgent running sequence if it is strictly less urgent than waiting ``seq``;
        whether it did."""
        if not self._running:
            return False
        victim = self._victim()
        if victim.params.priority <= seq.params.priority:
            return False
        self._preempt(victim, step)
        return True

    def _preempt(self, seq: Sequence, step: StepPlan) -> None:
        step.drop(seq)
        self._running.remove(seq)
        seq.num_preemptions += 1
        self._num_preemptions += 1
        self._enqueue(seq, front=True)
        step.preempted.append(seq)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Frees an unqueued sequence's blocks and progress (if any) and queues it to be computed."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._queue(self._waiting, seq, front)

    def _start_landed(self, step: StepPlan) -> None:
        while self._landed and len(self._running) < self.config.max_running and step.budget > 0:
            seq = self._landed[0]
            if not self.block_manager.allocate(seq, 1):
                break
            self._landed.popleft()
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            step.add(seq, 1, decode=True)

    def _add_drafts(self, step: StepPlan) -> None:
        """Gives decoding sequences the draft tokens their proposers find, as far as the budget and free
        blocks allow (drafts never preempt anything), each cut to the length that pays for its rows
        (``draft_length``). A request's own method (``SamplingParams.speculative``) overrides the engine's."""
        rows = len(step.decoding)
        tokens = float(rows)  # tokens the step's decode rows are expected to yield
        for seq in [s for s in self._running if s in step.decoding]:
            if step.budget <= 0:
                break
            if seq.draft is None:
                method = seq.params.speculative or self.speculative.method
                if method == "off":
                    continue
                cfg = self.speculative if method == self.speculative.method else replace(self.speculative, method=method)
                factory = self.proposer_factory
                seq.draft = DraftState(cfg, factory(seq) if factory is not None else None)
            # the sampled token after the drafts must still fit max_tokens
            limit = min(step.budget, seq.params.max_tokens - seq.num_completion_tokens - 1)
            draft = seq.draft.draft(seq.token_ids, limit)
            if draft and self.speculative.cost_aware:
                draft = draft[: draft_length(self.step_costs, rows, tokens, len(draft), seq.draft.rate)]
                if not draft:
                    seq.draft.skipped()
            if draft and self.block_manager.allocate(seq, 1 + len(draft)):
                step.add_draft(seq, draft)
                rows += len(draft)
                tokens += sum(seq.draft.rate ** (i + 1) for i in range(len(draft)))

    def _start_waiting(self, step: StepPlan) -> None:
        bm = self.block_manager
        while self._waiting and step.budget > 0:
            seq = self._waiting[0]
            if len(self._running) >= self.config.max_running and not self._make_room(seq, step):
                break
            if bm.blocks_needed(seq.num_tokens) > bm.num_blocks:
                self._waiting.popleft()
                self._reject(seq, step)
                continue
            while True:
                hit_tokens = bm.num_prefix_hit_tokens(seq)
                n = self._chunk_len(seq.num_tokens - hit_tokens, step.budget)
                if bm.allocate(seq, n):
                    break
                # FCFS within a priority: a head that does not fit blocks everything behind it, so it
                # cannot starve; only strictly less urgent running work makes room for it.
                if not self._make_room(seq, step):
                    return
            # Fewer only when the KV tier could not read back a block it listed (then computed here).
            assert seq.num_computed_tokens <= hit_tokens, "prefix hits grew between lookup and allocation"
            self._waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            step.add(seq, n, decode=False)

    def _reject(self, seq: Sequence, step: StepPlan) -> None:
        # Removed from its queue by the caller; only the bookkeeping of a finished sequence is left.
        del self._seqs[seq.seq_id]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = FinishReason.LENGTH if seq.num_completion_tokens else FinishReason.ABORT
        seq.stop_reason = None
        step.rejected.append(seq)

    def _forget(self, seq: Sequence, keep_blocks: bool = False) -> None:
        if seq.status == SequenceStatus.RESERVED:
            del self._reserved[seq.seq_id]
        else:
            self._unqueue(seq)
        if keep_blocks and self.block_manager.holds(seq):
            self._held[seq.seq_id] = seq
        else:
            self.block_manager.free(seq)

    @staticmethod
    def _stop_decision(seq: Sequence) -> StopDecision | None:
        return stop_decision(seq.params, seq.eos_token_ids, seq.last_token, seq.num_completion_tokens,
                             seq.grammar_finish)

