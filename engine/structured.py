"""Constrained decoding with llguidance (why llguidance: `engine.structured_spec`).

- `GrammarCompiler` (one per engine) builds the llguidance tokenizer from the model's `tokenizer.json`
  and keeps a bounded LRU cache of compiled grammars per `StructuredSpec`; each request gets a copy.
  `engine.async_engine` compiles a request's grammar on a worker thread before the request reaches the
  engine thread, so a slow grammar never delays the steps of the requests already running.
- `GrammarState` (one per request, owned by its `Sequence`) is the matcher: advanced with every token
  the sequence gets (sampled here, the prefill node's first token, resumed tokens replayed), and
  rebuildable from those tokens alone (`GrammarCompiler.new_state(spec, tokens)`).
- `apply_grammar_masks` computes the token bitmask of every constrained row of a step's batch at once
  (llguidance's thread pool, outside the GIL) and sets the disallowed logits to -inf before sampling.

When the grammar is complete the mask allows only EOS; the request ends as soon as the matcher has
stopped (nothing but EOS could follow) without spending a step on that EOS (`GrammarState.finish`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from functools import lru_cache

import llguidance
import torch

from pdserve.engine.structured_spec import GrammarError, StructuredSpec, grammar_of
from pdserve.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_CACHED_GRAMMARS = 64


class GrammarState:
    """One request's grammar matcher. Not thread-safe: used on the engine thread only."""

    def __init__(self, matcher: llguidance.LLMatcher, spec: StructuredSpec) -> None:
        self.matcher = matcher
        self.spec = spec
        self.num_tokens = 0  # tokens consumed (accepted or not)

    def advance(self, token_id: int) -> bool:
        """Feeds one token to the matcher; returns whether the grammar allowed it. A rejected token puts
        the state in error for good (`finish` says "abort")."""
        self.num_tokens += 1
        return bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()

    def rollback(self, num_tokens: int) -> None:
        """Takes back the last ``num_tokens`` tokens fed by ``advance`` (draft tokens a verification fed)."""
        assert 0 <= num_tokens <= self.num_tokens
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_tokens -= num_tokens

    @property
    def finish(self) -> str | None:
        """How the grammar ends the request now: "stop" once it is complete and nothing but EOS could
        follow, "abort" after a rejected token (or an internal matcher error), None while it goes on."""
        if self.matcher.is_error():
            return "abort"
        return "stop" if self.matcher.is_stopped() else None

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def bitmask(self, num_words: int) -> torch.Tensor:  # [num_words] int32
        """The allowed-token bitmask of the next token (bit t%32 of word t//32). Changes nothing."""
        out = torch.empty((1, num_words), dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), num_words * 4)
        return out[0]


class GrammarCompiler:
    """Builds grammar states for one model. Thread-safe: `prepare` compiles on the caller's thread
    (llguidance builds matchers outside the GIL), so the engine thread, which calls `new_state`, finds
    the grammar compiled; the cache is guarded by a lock that is never held while compiling."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_cached: int = DEFAULT_CACHED_GRAMMARS) -> None:
        assert max_cached >= 1
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's ids)
        # Every EOS id of the model ends a complete output (generation_config may list several).
        self.ll_tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_token_ids) or None
        )
        self.max_cached = max_cached
        self._cache: OrderedDict[StructuredSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and metrics

    def prepare(self, spec: StructuredSpec) -> None:
        """Compiles `spec` into the cache unless it is there. Raises GrammarError."""
        self._template(spec)

    def new_state(self, spec: StructuredSpec, tokens: Iterable[int] = ()) -> GrammarState:
        """A fresh state for `spec`, advanced through `tokens` (tokens generated before: a resumed
        request). Raises GrammarError if the grammar does not compile or a token is not allowed."""
        state = GrammarState(self._template(spec).deep_copy(), spec)
        for i, token in enumerate(tokens):
            if not state.advance(token):
                raise GrammarError(f"token {i} ({token}) is not allowed by the response format: {state.error}")
        return state

    def _template(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        """The compiled, never-advanced matcher of `spec` (cached, least recently used evicted)."""
        with self._lock:
            matcher = self._cache.get(spec)
            if matcher is not None:
                self._cache.move_to_end(spec)
                return matcher
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_of(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the JSON schema is not supported: {matcher.get_error()}")
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = matcher
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return matcher


@lru_cache(maxsize=1)
def _executor() -> llguidance.LLExecutor:
    # Mask computation of a batch runs on llguidance's threads; a few suffice (each mask is cheap) and
    # more would only compete with the model's own threads.
    return llguidance.LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 2) // 2)))


def batch_bitmask(states: Sequence[GrammarState], vocab_size: int) -> torch.Tensor:  # [R, W] int32, CPU
    """The next-token bitmasks of `states` (row i for states[i]), W = ceil(vocab_size / 32), computed
    in parallel. Changes no state."""
    num_words = (vocab_size + 31) // 32
    out = torch.empty((len(states), num_words), dtype=torch.int32)
    if len(states) == 1:
        out[0] = states[0].bitmask(num_words)
    else:
        _executor().unsafe_compute_mask_ptr(
            [(s.matcher, i) for i, s in enumerate(states)], out.data_ptr(), num_words * 4, len(states))
    return out


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [R, vocab_size] bool
    """Expands int32 bitmask words [R, W] to one bool per token, True where allowed (bit k of word w is
    token 32w + k). The per-token reference of `_additive_mask`, which the sampler uses."""
    assert sys.byteorder == "little", "the bitmask's byte view assumes little-endian words"
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [R, 4W]; byte j of word w at 4w + j
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)  # [8]
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1  # [R, 4W, 8]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def allow_tokens(bitmask: torch.Tensor, row: int, token_ids: Iterable[int]) -> None:
    """Sets the bits of `token_ids` in row `row` of int32 bitmask words [R, W] (in place)."""
    as_bytes = bitmask[row].view(torch.uint8)  # [4W], little-endian words
    for t in token_ids:
        as_bytes[t // 8] |= 1 << (t % 8)


def apply_grammar_masks(scores: torch.Tensor, states: Sequence[GrammarState | None],
                        eos_token_ids: Sequence[frozenset[int]]) -> torch.Tensor:
    """Returns a copy of `scores` [N, V] with the tokens each row's grammar forbids set to -inf (rows
    whose state is None unchanged). A row whose grammar allows nothing (a matcher in error) gets its EOS
    ids allowed, so it ends instead of sampling from nothing. Changes no state."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return scores
    vocab_size = scores.shape[1]
    words = batch_bitmask([states[i] for i in rows], vocab_size)  # [R, W] int32, CPU
    for r in (words == 0).all(dim=1).nonzero().flatten().tolist():  # checked on the packed words: cheap
        log.error("grammar of row %d allows no token (%s); ending it", rows[r], states[rows[r]].error)
        allow_tokens(words, r, (t for t in eos_token_ids[rows[r]] if t < vocab_size))
    # the packed words travel to the logits' device (32x fewer bytes than one bool per token)
    penalty = _additive_mask(words.to(scores.device, non_blocking=True), vocab_size, scores.dtype)  # [R, V]
    if len(rows) == scores.shape[0]:  # every row constrained: one pass, no gather
        return scores + penalty
    idx = torch.tensor(rows, dtype=torch.long, device=scores.device)
    return scores.index_copy(0, idx, scores.index_select(0, idx) + penalty)


@lru_cache(maxsize=8)
def _byte_penalties(dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # [256, 8]
    """Row b: for each bit k of byte value b, 0.0 if set (allowed) else -inf."""
    bits = (torch.arange(256, dtype=torch.int32).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1
    return torch.where(bits == 1, 0.0, float("-inf")).to(dtype=dtype, device=device)


def _additive_mask(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:  # [R, V]
    """0.0 where a token is allowed, -inf where forbidden, from int32 bitmask words [R, W]: one table
    lookup per byte (a quarter of the passes of shifting bits out), then one add to the logits."""
    assert sys.byteorder == "little", "the bitmask's byte view assumes little-endian words"
    as_bytes = bitmask.contiguous().view(torch.uint8).flatten().int()  # [R * 4W]
    table = _byte_penalties(dtype, bitmask.device)
    return table.index_select(0, as_bytes).reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_logit_bias(scores: torch.Tensor, biases: Sequence[dict[int, float] | None]) -> torch.Tensor:
    """Returns `scores` [N, V] plus each row's bias on its token ids (OpenAI `logit_bias`; ids outside
    [0, V) ignored). Rows with None or {} are unchanged. Changes nothing."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    vocab_size = scores.shape[1]
    for i, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            if 0 <= token < vocab_size:
                rows.append(i)
                cols.append(token)
                vals.append(value)
    if not rows:
        return scores
    device = scores.device
    return scores.index_put(
        (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
        torch.tensor(vals, dtype=scores.dtype, device=device), accumulate=True)
