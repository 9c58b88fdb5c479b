"""Turns one step's logits into next tokens: penalties, logit_bias, the structured-output grammar's mask,
temperature, top-k/top-p, seeded sampling, logprobs (in that order).

Every stage works on the whole batch at once; the only per-row Python loops are over seeded rows (each
owns a generator) and over the rows whose results are turned into Python objects at the end.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence, TokenLogprob
from pdserve.engine.structured import GrammarState, apply_grammar_masks, apply_logit_bias
from pdserve.kernels import KernelOps


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per logits row, in row order
    logprobs: list[TokenLogprob | None]  # None for rows whose request did not ask for logprobs


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per sequence: its accepted draft tokens, then one sampled token
    logprobs: list[list[TokenLogprob]]  # per sequence, one per token (empty if it did not ask)
    num_accepted: list[int]  # per sequence: how many of token_ids are accepted drafts


class _DraftedView:
    """A sequence as the sampler reads it with draft tokens taken as given (penalties count them; the
    generator is the sequence's own)."""

    def __init__(self, seq: Sequence, extra: list[int]) -> None:
        self._seq = seq
        self.seq_id, self.params, self.eos_token_ids, self.grammar = seq.seq_id, seq.params, seq.eos_token_ids, seq.grammar
        self.token_ids = seq.token_ids + extra
        self.num_completion_tokens = seq.num_completion_tokens + len(extra)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self._seq.num_prompt_tokens :]

    @property
    def generator(self):  # noqa: ANN201 - torch.Generator | None, the sequence's
        return self._seq.generator

    @generator.setter
    def generator(self, gen) -> None:  # noqa: ANN001
        self._seq.generator = gen


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    )


def token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Returns how often each vocabulary id occurs in each list, as float32 [len(token_lists), vocab_size].
    Ids outside [0, vocab_size) are ignored; changes nothing."""
    n = len(token_lists)
    lens = [len(t) for t in token_lists]
    max_len = max(lens, default=0)
    # one spare column collects padding (and out-of-vocabulary ids) so a single scatter_add handles ragged rows
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.float32, device=device)  # [n, V + 1]
    if max_len == 0:
        return counts[:, :vocab_size]
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)  # [sum(lens)]
    flat = torch.where((flat >= 0) & (flat < vocab_size), flat, vocab_size)
    valid = torch.arange(max_len) < torch.tensor(lens)[:, None]  # [n, L]
    padded = torch.full((n, max_len), vocab_size, dtype=torch.long)  # [n, L]
    padded[valid] = flat  # boolean-mask assignment is row-major, the same order as the flattened lists
    padded = padded.to(device, non_blocking=True)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Returns a penalized copy of `logits` [N, V] (row i belongs to seqs[i]); `logits` is not changed.

    Repetition penalty first (HF/CTRL semantics, over prompt + generated tokens: a seen token's positive
    logit is divided by the penalty, a negative one multiplied), then the OpenAI presence and frequency
    penalties over generated tokens only: `logit -= presence * (count > 0) + frequency * count`.
    Rows without penalties come back unchanged."""
    out = logits.clone()
    rows = [i for i, s in enumerate(seqs) if _has_penalty(s.params)]
    if not rows:
        return out
    device = logits.device
    vocab_size = logits.shape[1]
    sub_seqs = [seqs[i] for i in rows]
    idx = torch.tensor(rows, dtype=torch.long, device=device)
    sub = out.index_select(0, idx)  # [R, V]

    rep = [s.params.repetition_penalty for s in sub_seqs]
    if any(r != 1.0 for r in rep):
        # rows without a repetition penalty contribute empty lists, so they cost nothing to count
        lists = [s.token_ids if r != 1.0 else [] for s, r in zip(sub_seqs, rep, strict=True)]
        seen = token_counts(lists, vocab_size, device) > 0  # [R, V]
        rp = torch.tensor(rep, dtype=torch.float32, device=device)[:, None]  # [R, 1]
        sub = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)

    presence = [s.params.presence_penalty for s in sub_seqs]
    frequency = [s.params.frequency_penalty for s in sub_seqs]
    if any(p != 0.0 or f != 0.0 for p, f in zip(presence, frequency, strict=True)):
        lists = [
            s.completion_token_ids if (p != 0.0 or f != 0.0) else []
            for s, p, f in zip(sub_seqs, presence, frequency, strict=True)
        ]
        counts = token_counts(lists, vocab_size, device)  # [R, V]
        pres = torch.tensor(presence, dtype=torch.float32, device=device)[:, None]  # [R, 1]
        freq = torch.tensor(frequency, dtype=torch.float32, device=device)[:, None]  # [R, 1]
        sub = sub - (pres * (counts > 0) + freq * counts)

    out.index_copy_(0, idx, sub)
    return out


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Returns a copy of `logits` [N, V] with tokens outside each row's top-k and nucleus set to -inf.

    `top_k` [N] int64 (V disables) keeps every token scoring at least the k-th best, so ties at the
    boundary survive. `top_p` [N] float32 (1 disables) keeps the smallest best-first set whose probability
    reaches p, and always the best token. Ties are ordered by token id, as `torch.argmax` does."""
    vocab_size = logits.shape[1]
    use_k = bool((top_k < vocab_size).any())
    use_p = bool((top_p < 1.0).any())
    if not use_p:
        if not use_k:
            return logits.clone()
        active = top_k < vocab_size  # [N]
        # only rows that limit k decide how far topk has to look, so one unlimited row costs no full sort
        k_max = int(top_k[active].max())
        best = logits.topk(k_max, dim=-1).values  # [N, k_max]
        kth = best.gather(1, (torch.where(active, top_k, 1) - 1)[:, None])  # [N, 1]
        kth = kth.masked_fill(~active[:, None], float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))

    ordered, order = logits.sort(dim=-1, descending=True, stable=True)  # [N, V] each
    if use_k:
        kth = ordered.gather(1, (top_k - 1)[:, None])  # [N, 1]
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(dim=-1)  # [N, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [N, V]; exactly 0 for the best token, so it is always kept
    # rows that disable top-p get a bound cumsum rounding can never reach
    bound = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, 2.0))[:, None]  # [N, 1]
    ordered = ordered.masked_fill(mass_before >= bound, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, ordered)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int | None]
) -> list[TokenLogprob | None]:
    """Returns, per row, the chosen token's logprob and the top-ks[i] alternatives (None where ks[i] is
    None), from log_softmax of `logits` [N, V] at `token_ids` [N]. Changes nothing."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    result: list[TokenLogprob | None] = [None] * len(ks)
    if not rows:
        return result
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, idx), dim=-1)  # [R, V]
    chosen = token_ids.index_select(0, idx)  # [R]
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()  # [R]
    k_max = min(max(ks[i] or 0 for i in rows), logits.shape[1])
    top_lp: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if k_max > 0:
        values, indices = logprobs.topk(k_max, dim=-1)  # [R, k_max] each, best first
        top_lp, top_ids = values.tolist(), indices.tolist()
    chosen_ids = chosen.tolist()
    for r, i in enumerate(rows):
        k = ks[i] or 0
        top = list(zip(top_ids[r][:k], top_lp[r][:k], strict=True))
        result[i] = TokenLogprob(token_id=chosen_ids[r], logprob=chosen_lp[r], top=top)
    return result


class Sampler:
    """Picks the next token for every row of a step's logits.

    Greedy rows (temperature below `min_temperature`) take the argmax of the penalized, biased and
    grammar-masked logits. Sampled
    rows draw with an exponential race, `argmax(probs / E)` with E ~ Exponential(1) per vocabulary entry,
    which is an exact draw from `probs` and consumes exactly V random numbers per row. Rows with a seed
    draw those numbers from their own generator (kept on `seq.generator`), so a seeded request produces
    the same tokens whatever else shares its batch; other rows share one sampler-owned generator.

    Logprobs are reported from log_softmax of the raw model logits, before penalties, logit_bias, the
    grammar mask, temperature and top-k/top-p: they describe the model's distribution, not the one the
    token was drawn from."""

    def __init__(
        self, seed: int | None = None, device: str | torch.device | None = None, min_temperature: float = 1e-5,
        ops: KernelOps | None = None,
    ) -> None:
        self.seed = seed  # seeds the shared generator of unseeded rows; None draws a fresh seed
        self.min_temperature = min_temperature  # below this, dividing by temperature overflows: go greedy
        # Takes the row-wise argmax of greedy rows and of the exponential race (the same indices as
        # torch's argmax, faster on a CPU); None: torch's.
        self.ops = ops
        self._generators: dict[torch.device, torch.Generator] = {}
        if device is not None:  # where logits will arrive; other devices get their generator on first use
            dev = torch.device(device)
            if dev.type == "cuda" and dev.index is None:  # logits report an indexed device
                dev = torch.device("cuda", torch.cuda.current_device())
            self._shared_generator(dev)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Samples one token per row of `logits` [N, V] (row i belongs to seqs[i]). Creates the generator
        of a seeded sequence on first use (`seq.generator`) and advances the generators it draws from;
        the sequences are otherwise untouched."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"expected logits [{len(seqs)}, V], got {tuple(logits.shape)}")
        logits = logits.float()
        params = [s.params for s in seqs]
        sampled = [i for i, p in enumerate(params) if p.temperature >= self.min_temperature]
        needs_penalty = any(_has_penalty(p) for p in params)
        biased = any(p.logit_bias for p in params)
        constrained = any(s.grammar is not None for s in seqs)
        ks = [p.logprobs for p in params]
        if not sampled and not needs_penalty and not biased and not constrained and all(k is None for k in ks):
            return SamplerOutput(token_ids=self._argmax(logits).tolist(), logprobs=[None] * len(seqs))

        scores = apply_penalties(logits, seqs) if needs_penalty else logits  # [N, V]
        if biased:
            scores = apply_logit_bias(scores, [p.logit_bias for p in params])
        if constrained:  # last: no bias or penalty may bring back a token the grammar forbids
            scores = apply_grammar_masks(scores, [s.grammar for s in seqs], [s.eos_token_ids for s in seqs])
        if len(sampled) == len(seqs):
            tokens = self._sample(scores, seqs)  # [N]
        else:
            tokens = self._argmax(scores)  # [N]
            if sampled:
                idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
                tokens.index_copy_(
                    0, idx, self._sample(scores.index_select(0, idx), [seqs[i] for i in sampled])
                )
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=compute_logprobs(logits, tokens, ks))

    def verify(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> VerifyOutput:
        """Samples the tokens of sequences that may carry draft tokens (`engine.speculative`). ``logits``
        [sum(1 + len(d)), V]: the rows of seqs[i] are consecutive, its last token's first, then one per
        draft token. Position j of a sequence is sampled as an ordinary step would sample it with drafts
        [0, j) appended; draft j is accepted while the sampled token equals it (``accepts``), and the first
        token that is not an accepted draft ends the sequence's tokens. Advances generators like ``__call__``
        (once per emitted token); grammar states come back as they were."""
        offsets = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))
        if logits.dim() != 2 or logits.shape[0] != offsets[-1] or len(seqs) != len(drafts):
            raise ValueError(f"expected logits [{offsets[-1]}, V] for {len(seqs)} sequences, got {tuple(logits.shape)}")
        tokens: list[list[int]] = [[] for _ in seqs]
        lps: list[list[TokenLogprob]] = [[] for _ in seqs]
        accepted = [0] * len(seqs)
        active = list(range(len(seqs)))
        advanced: list[GrammarState] = []  # grammars fed draft tokens, rolled back by one each at the end
        try:
            for j in range(1 + max((len(d) for d in drafts), default=0)):
                if j:
                    for i in active:
                        if seqs[i].grammar is not None:
                            seqs[i].grammar.advance(drafts[i][j - 1])
                            advanced.append(seqs[i].grammar)
                rows = torch.tensor([offsets[i] + j for i in active], dtype=torch.long, device=logits.device)
                views = [seqs[i] if j == 0 else _DraftedView(seqs[i], drafts[i][:j]) for i in active]
                out = self(logits if j == 0 and len(active) == logits.shape[0] else logits.index_select(0, rows), views)
                still = []
                for i, token, lp in zip(active, out.token_ids, out.logprobs, strict=True):
                    draft = drafts[i]
                    if j < len(draft) and self.accepts(token, draft[j]):
                        token = draft[j]
                        accepted[i] += 1
                        still.append(i)
                    tokens[i].append(token)
                    if lp is not None:
                        lps[i].append(lp if lp.token_id == token else self._logprob_of(logits[offsets[i] + j], token, lp))
                active = still
                if not active:
                    break
        finally:
            for state in advanced:
                state.rollback(1)
        return VerifyOutput(tokens, lps, accepted)

    @staticmethod
    def accepts(sampled: int, draft: int) -> bool:
        """Whether the draft token stands, given the token sampled at its position (see `engine.speculative`
        for why equality keeps the target distribution)."""
        return sampled == draft

    @staticmethod
    def _logprob_of(row: torch.Tensor, token: int, like: TokenLogprob) -> TokenLogprob:
        """The record of ``token`` in raw logits ``row`` [V] (only when ``accepts`` overrides the sample)."""
        logprob = float(torch.log_softmax(row.float(), dim=-1)[token])
        return TokenLogprob(token_id=token, logprob=logprob, top=like.top)

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N] int64
        return self.ops.argmax(x) if self.ops is not None else x.argmax(dim=-1)

    def _sample(self, scores: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:  # [M]
        """Draws one token per row of `scores` [M, V] after temperature, top-k and top-p."""
        device = scores.device
        vocab_size = scores.shape[1]
        params = [s.params for s in seqs]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        scaled = scores / temperature[:, None]  # [M, V]
        if any(0 < p.top_k < vocab_size for p in params) or any(p.top_p < 1.0 for p in params):
            ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
            top_k = torch.tensor(ks, dtype=torch.long, device=device)  # [M]
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)  # [M]
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)  # [M, V]
        return self._argmax(probs / self._exponential_noise(seqs, probs))

    def _exponential_noise(self, seqs: list[Sequence], like: torch.Tensor) -> torch.Tensor:  # [M, V]
        """Returns Exponential(1) noise shaped like `like` [M, V]: seeded rows from their own generator
        (created on first use), the rest from the shared one."""
        noise = torch.empty_like(like)
        seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None]
        if len(seeded) < len(seqs):
            shared = self._shared_generator(like.device)
            if not seeded:
                noise.exponential_(generator=shared)
            else:
                unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
                idx = torch.tensor(unseeded, dtype=torch.long, device=like.device)
                rows = torch.empty((len(unseeded), like.shape[1]), dtype=like.dtype, device=like.device)
                noise.index_copy_(0, idx, rows.exponential_(generator=shared))
        for i in seeded:
            seq = seqs[i]
            if seq.generator is None:
                seq.generator = self._seeded_generator(seq, like[i])
            noise[i].exponential_(generator=seq.generator)
        # a zero draw would turn a zero probability into 0/0 = nan, which argmax would pick
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    @staticmethod
    def _seeded_generator(seq: Sequence, row: torch.Tensor) -> torch.Generator:
        """Creates the generator of a seeded sequence, advanced past the draws of tokens it already has.
        A sequence whose first token came from elsewhere (the prefill node, in a disaggregated cluster)
        thereby continues the exact stream a single sampler would have drawn."""
        gen = torch.Generator(device=row.device)
        gen.manual_seed(seq.params.seed)
        skipped = torch.empty_like(row)  # [V], drawn like one sampling step's row so consumption matches
        for _ in range(seq.num_completion_tokens):
            skipped.exponential_(generator=gen)
        return gen

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen
