"""Sampler: greedy, seeded reproducibility, top-k/top-p, distributions, penalties and logprobs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pdserve.engine.sampler import Sampler, apply_penalties, apply_top_k_top_p, token_counts
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence


def make_seq(name: str, params: SamplingParams, prompt: list[int] | None = None) -> Sequence:
    return Sequence(seq_id=name, token_ids=list(prompt or [1, 2, 3]), params=params)


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:  # [rows, vocab]
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


def test_greedy_is_argmax_including_ties() -> None:
    logits = random_logits(8, 50, seed=0)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1.0  # tie: argmax takes the first index
    logits[5, 11] = logits[5, 4] = logits[5].max() + 1.0
    seqs = [make_seq(f"g{i}", SamplingParams()) for i in range(8)]
    out = Sampler(seed=0)(logits, seqs)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 7 and out.token_ids[5] == 4
    assert out.logprobs == [None] * 8


def test_greedy_rows_unaffected_by_sampled_batch_mates() -> None:
    logits = random_logits(6, 40, seed=1)
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i if i == 3 else None) for i in range(6)]
    seqs = [make_seq(f"m{i}", p) for i, p in enumerate(params)]
    out = Sampler(seed=0)(logits, seqs)
    greedy = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [greedy[i] for i in (0, 2, 4)]
    assert seqs[3].generator is not None  # seeded sampled rows get their own generator
    assert seqs[1].generator is None and seqs[0].generator is None


def _run_seeded(seed: int, steps: int, position: str, sampler_seed: int, mates: int) -> list[int]:
    """Samples `steps` tokens for one seeded request placed among `mates` other requests."""
    vocab = 64
    target_params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed)
    target = make_seq("target", target_params, prompt=[5, 6, 7])
    mate_params = [
        SamplingParams(temperature=1.3, seed=777),
        SamplingParams(temperature=0.7),
        SamplingParams(presence_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, top_p=0.5, logprobs=3),
    ]
    others = [make_seq(f"o{i}", mate_params[i % len(mate_params)]) for i in range(mates)]
    seqs = [target, *others] if position == "first" else [*others, target]
    row = seqs.index(target)
    sampler = Sampler(seed=sampler_seed)
    target_logits = random_logits(steps, vocab, seed=99)  # [steps, vocab]: the same model output every run
    noise = torch.Generator().manual_seed(sampler_seed)
    for step in range(steps):
        logits = torch.randn(len(seqs), vocab, generator=noise) * 2.0  # [N, vocab]
        logits[row] = target_logits[step]
        out = sampler(logits, seqs)
        for seq, token in zip(seqs, out.token_ids, strict=True):
            seq.token_ids.append(token)
    return target.completion_token_ids


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    alone = _run_seeded(seed=1234, steps=30, position="first", sampler_seed=0, mates=0)
    assert len(set(alone)) > 5  # really sampling, not collapsing onto one token
    for position, sampler_seed, mates in [("first", 1, 3), ("last", 2, 7), ("last", 3, 1)]:
        assert _run_seeded(1234, 30, position, sampler_seed, mates) == alone
    other_seed = _run_seeded(seed=1235, steps=30, position="first", sampler_seed=0, mates=2)
    assert other_seed != alone


def test_seeded_stream_continues_on_another_sampler() -> None:
    # a prefill node samples the first tokens, a decode node (fresh sampler, fresh generator) the rest
    logits = random_logits(10, 64, seed=7)  # [steps, V]
    params = SamplingParams(temperature=1.0, seed=42)
    whole = make_seq("whole", params)
    sampler = Sampler(seed=0)
    for step in range(10):
        whole.token_ids += sampler(logits[step : step + 1], [whole]).token_ids

    handed = make_seq("handed", params)
    first = Sampler(seed=1)
    for step in range(3):
        handed.token_ids += first(logits[step : step + 1], [handed]).token_ids
    resumed = make_seq("resumed", params)
    resumed.token_ids += handed.completion_token_ids  # what the decode node receives: no generator state
    second = Sampler(seed=2)
    for step in range(3, 10):
        resumed.token_ids += second(logits[step : step + 1], [resumed]).token_ids
    assert resumed.completion_token_ids == whole.completion_token_ids


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(16, 100, seed=2)
    seqs = [make_seq(f"k{i}", SamplingParams(temperature=1.5, top_k=1)) for i in range(16)]
    sampler = Sampler(seed=0)
    for _ in range(5):
        assert sampler(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy_including_ties() -> None:
    logits = random_logits(16, 100, seed=3)
    logits[4, 50] = logits[4, 20] = logits[4].max() + 2.0
    seqs = [make_seq(f"p{i}", SamplingParams(temperature=1.0, top_p=1e-6, seed=i)) for i in range(16)]
    sampler = Sampler(seed=0)
    for _ in range(5):
        assert sampler(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


def _draw_counts(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """One draw per params entry from the same logits [V]; returns how often each token came out."""
    seqs = [make_seq(f"d{i}", p) for i, p in enumerate(params)]
    tokens = Sampler(seed=11)(logits.expand(len(seqs), -1).clone(), seqs).token_ids
    counts = Counter(tokens)
    return [counts.get(t, 0) for t in range(logits.shape[0])]


def test_temperature_sampling_follows_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    expected = torch.softmax(logits / 0.7, dim=-1).tolist()
    counts = _draw_counts(logits, [SamplingParams(temperature=0.7)] * 20000)
    # chi-square with 5 degrees of freedom: 20.5 is the 0.1% tail
    assert chi_square(counts, expected) < 20.5
    assert all(abs(c / 20000 - p) < 0.015 for c, p in zip(counts, expected, strict=True))

    # seeded rows draw from their own generators and must follow the same law
    seeded = _draw_counts(logits, [SamplingParams(temperature=0.7, seed=s) for s in range(3000)])
    assert chi_square(seeded, expected) < 20.5


def test_top_k_and_top_p_renormalize() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -0.5, -1.0])
    probs = torch.softmax(logits, dim=-1)

    counts = _draw_counts(logits, [SamplingParams(temperature=1.0, top_k=3)] * 12000)
    assert counts[3:] == [0, 0, 0]
    assert chi_square(counts[:3], (probs[:3] / probs[:3].sum()).tolist()) < 13.8  # df=2, 0.1% tail

    # nucleus 0.8: the best-first prefix whose mass first reaches 0.8
    n_keep = int((torch.cumsum(probs, 0) < 0.8).sum()) + 1
    counts = _draw_counts(logits, [SamplingParams(temperature=1.0, top_p=0.8)] * 12000)
    assert all(c == 0 for c in counts[n_keep:]) and all(c > 0 for c in counts[:n_keep])
    kept = probs[:n_keep] / probs[:n_keep].sum()
    assert chi_square(counts[:n_keep], kept.tolist()) < 16.3  # df=3, 0.1% tail


def test_top_k_top_p_masks() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, 2.0, -1.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    # top_k keeps ties at the boundary; V disables
    out = apply_top_k_top_p(logits, torch.tensor([2, 5]), torch.tensor([1.0, 1.0]))
    assert torch.isinf(out[0, [0, 4]]).all() and torch.equal(out[0, 1:4], logits[0, 1:4])
    assert torch.equal(out[1], logits[1])
    out = apply_top_k_top_p(logits, torch.tensor([5, 2]), torch.tensor([1.0, 1.0]))
    assert torch.equal(out[0], logits[0]) and torch.isinf(out[1, :3]).all()
    # top_p combined with top_k: the nucleus is taken over the top-k renormalized distribution
    out = apply_top_k_top_p(logits, torch.tensor([5, 3]), torch.tensor([0.5, 0.7]))
    probs = torch.softmax(logits[1, 2:], dim=-1)  # top-3 of row 1: tokens 2, 3, 4
    assert probs[2] < 0.7 <= probs[1:].sum()  # so token 3 is needed too, token 2 is not
    assert torch.isfinite(out[1]).tolist() == [False, False, False, True, True]
    assert torch.isfinite(out[0]).tolist() == [False, True, False, False, False]


def test_token_counts_match_counter() -> None:
    lists = [[3, 3, 1, 9], [], [0, 0, 0], [9, 2, 12, 3]]  # 12 is outside the vocabulary: ignored
    counts = token_counts(lists, 10, torch.device("cpu"))
    assert counts.shape == (4, 10)
    for row, ids in enumerate(lists):
        ref = Counter(t for t in ids if t < 10)
        assert counts[row].tolist() == [float(ref.get(t, 0)) for t in range(10)]


def naive_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Per-row, per-token reference of the HF repetition and OpenAI presence/frequency formulas."""
    out = logits.clone()
    for row, seq in enumerate(seqs):
        p = seq.params
        for token in set(seq.token_ids):
            value = float(out[row, token])
            out[row, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token, count in Counter(seq.completion_token_ids).items():
            out[row, token] -= p.presence_penalty * 1.0 + p.frequency_penalty * count
    return out


def _penalty_batch() -> tuple[torch.Tensor, list[Sequence]]:
    vocab = 32
    settings = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.8, frequency_penalty=0.3),
        SamplingParams(repetition_penalty=0.7, presence_penalty=-0.5, frequency_penalty=1.1),
        SamplingParams(frequency_penalty=-2.0),
    ]
    seqs = []
    for i, params in enumerate(settings):
        seq = make_seq(f"r{i}", params, prompt=[1, 2, 2, 5 + i, 30])
        seq.token_ids += [2, 7, 7, 7, 9 + i, 1, 31]  # generated: repeats, and tokens also in the prompt
        seqs.append(seq)
    return random_logits(len(seqs), vocab, seed=4), seqs


def test_penalties_follow_the_formulas() -> None:
    logits, seqs = _penalty_batch()
    original = logits.clone()
    penalized = apply_penalties(logits, seqs)
    torch.testing.assert_close(penalized, naive_penalties(logits, seqs), rtol=1e-6, atol=1e-6)
    assert torch.equal(logits, original)  # input untouched
    assert torch.equal(penalized[0], logits[0])  # no penalty, no change
    assert not torch.equal(penalized[1:], logits[1:])


def test_greedy_with_penalties_takes_penalized_argmax() -> None:
    logits, seqs = _penalty_batch()
    out = Sampler(seed=0)(logits, seqs)
    assert out.token_ids == naive_penalties(logits, seqs).argmax(dim=-1).tolist()


def test_logprobs_from_raw_logits() -> None:
    logits = random_logits(4, 50, seed=5)
    params = [
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0),
        SamplingParams(logprobs=5, temperature=0.8, repetition_penalty=1.5),
        SamplingParams(logprobs=20, frequency_penalty=1.0),
    ]
    seqs = [make_seq(f"l{i}", p, prompt=[1, 2, 3, 4]) for i, p in enumerate(params)]
    out = Sampler(seed=0)(logits, seqs)
    ref = torch.log_softmax(logits, dim=-1)  # [4, 50]
    assert out.logprobs[0] is None
    for row, k in [(1, 0), (2, 5), (3, 20)]:
        lp = out.logprobs[row]
        assert lp is not None and lp.token_id == out.token_ids[row]
        assert lp.logprob == pytest.approx(float(ref[row, lp.token_id]), abs=1e-5)
        assert len(lp.top) == k
        values, indices = ref[row].topk(k)
        assert [t for t, _ in lp.top] == indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))


def test_fast_path_agrees_with_general_path() -> None:
    logits = random_logits(10, 80, seed=6)
    fast = Sampler(seed=0)(logits, [make_seq(f"f{i}", SamplingParams()) for i in range(10)])
    general = Sampler(seed=0)(logits, [make_seq(f"f{i}", SamplingParams(logprobs=1)) for i in range(10)])
    assert fast.token_ids == general.token_ids
    assert all(
        lp is not None and lp.top[0][0] == t
        for lp, t in zip(general.logprobs, general.token_ids, strict=True)
    )


def test_shared_generator_seed_is_reproducible() -> None:
    logits = random_logits(32, 50, seed=8)
    seqs = [make_seq(f"u{i}", SamplingParams(temperature=1.0)) for i in range(32)]
    first = Sampler(seed=5, device="cpu")(logits, seqs).token_ids
    assert Sampler(seed=5)(logits, seqs).token_ids == first
    assert Sampler(seed=6)(logits, seqs).token_ids != first


def test_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(3, 10), [make_seq("x", SamplingParams())])
