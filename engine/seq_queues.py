"""Where each of a scheduler's sequences is (`SequenceQueues`, the `Scheduler`'s base class), and the
read-only views of it:

    waiting    new or preempted sequences; they hold no blocks and the front is started first
    landed     sequences whose prompt K/V arrived by transfer; they hold those blocks and wait only for
               a running slot
    running    sequences holding blocks, in start order (the last is the newest)
    reserved   RESERVED sequences: blocks set aside for prompt K/V on their way; never scheduled
    held       finished sequences keeping their blocks until ``release`` (a transfer reads them, or a
               reserved one finished at its first token, which a transfer may still write)

The waiting and landed queues are kept in priority order (`SamplingParams.priority`, lower first), FIFO
within a priority. This class only keeps the places and their id maps in step; the `Scheduler` decides
every move and sets every status and block."""

from __future__ import annotations

from collections import deque

from pdserve.engine.sequence import Sequence, SequenceStatus


class SequenceQueues:
    def __init__(self) -> None:
        self._waiting: deque[Sequence] = deque()
        self._landed: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._seqs: dict[str, Sequence] = {}  # every sequence to schedule (waiting, landed, running), by id
        self._reserved: dict[str, Sequence] = {}
        self._held: dict[str, Sequence] = {}

    # ----------------------------------------------------------------------------------- views

    @property
    def num_waiting(self) -> int:
        """Sequences not running yet: waiting (or preempted) ones plus landed ones awaiting a slot."""
        return len(self._waiting) + len(self._landed)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def running_seqs(self) -> tuple[Sequence, ...]:
        """Running sequences in start order: the last one is preempted first."""
        return tuple(self._running)

    @property
    def waiting_seqs(self) -> tuple[Sequence, ...]:
        """Waiting sequences in queue order (preempted ones at the front), then landed ones."""
        return tuple(self._waiting) + tuple(self._landed)

    @property
    def reserved_seqs(self) -> tuple[Sequence, ...]:
        """RESERVED sequences: holding blocks, their prompt K/V still on the way."""
        return tuple(self._reserved.values())

    @property
    def held_seqs(self) -> tuple[Sequence, ...]:
        """Finished sequences still holding their blocks (see ``release``)."""
        return tuple(self._held.values())

    def prefill_backlog_tokens(self) -> int:
        """Tokens still to prefill over waiting, landed and running sequences: each one's tokens past its
        computed ones where that is more than the single token a decode step computes. Changes nothing."""
        return sum(n for s in (*self._waiting, *self._landed, *self._running)
                   if (n := s.num_tokens - s.num_computed_tokens) > 1)

    def has_unfinished(self) -> bool:
        """Whether any sequence is left to schedule. RESERVED ones are not: they wait for ``land``."""
        return bool(self._seqs)

    def knows(self, seq_id: str) -> bool:
        """Whether ``seq_id`` is taken here: queued, running, reserved or held."""
        return seq_id in self._seqs or seq_id in self._reserved or seq_id in self._held

    def get(self, seq_id: str) -> Sequence | None:
        """The unfinished sequence under ``seq_id`` (queued, running or reserved), or None."""
        return self._seqs.get(seq_id) or self._reserved.get(seq_id)

    # ----------------------------------------------------------------------------------- places

    def _queue(self, queue: deque[Sequence], seq: Sequence, front: bool) -> None:
        """Puts an unqueued sequence into ``queue`` (waiting or landed): ahead of the sequences of its
        priority (``front``: a preempted one resumes first) or behind them (a new one waits its turn)."""
        self._seqs[seq.seq_id] = seq
        p = seq.params.priority
        if front:
            if not queue or queue[0].params.priority >= p:
                queue.appendleft(seq)
                return
            at = next((i for i, s in enumerate(queue) if s.params.priority >= p), len(queue))
        else:
            if not queue or queue[-1].params.priority <= p:
                queue.append(seq)
                return
            at = next((i for i, s in enumerate(queue) if s.params.priority > p), len(queue))
        queue.insert(at, seq)

    def _unqueue(self, seq: Sequence) -> None:
        """Takes a scheduled sequence out of its queue (running, landed or waiting) and the id map."""
        if seq.status == SequenceStatus.RUNNING:
            self._running.remove(seq)
        elif seq in self._landed:
            self._landed.remove(seq)
        else:
            self._waiting.remove(seq)
        del self._seqs[seq.seq_id]

    def _check_places(self) -> list[Sequence]:
        """Asserts every sequence is in one place, the id maps agree with the queues and the queues are
        in priority order; returns every sequence that may hold blocks (queued, reserved, held)."""
        queued = [*self._waiting, *self._landed, *self._running]
        assert len({id(s) for s in queued}) == len(queued), "a sequence is queued twice"
        assert {s.seq_id: s for s in queued} == self._seqs, "queues and the id map disagree"
        assert not (self._seqs.keys() & self._reserved.keys()) and not (self._seqs.keys() & self._held.keys())
        assert not (self._reserved.keys() & self._held.keys()), "a sequence is reserved and held"
        for queue in (self._waiting, self._landed):
            priorities = [s.params.priority for s in queue]
            assert priorities == sorted(priorities), "a waiting queue is out of priority order"
        return queued + list(self._reserved.values()) + list(self._held.values())
