"""Embeddings: a prompt's pooled final hidden states (after the final norm), prefill-only work.

The forward runs over a scratch paged KV cache of its own, sized to the batch and dropped afterwards, so
the engine's KV cache, block manager and scheduler never see an embedding: no block is taken from the
pool, nothing is cached, and the integrity checks have nothing to account for. The numerics are those of
a prefill step (same kernels, same KV dtype); the hidden states are float32 whatever the weights' dtype.

Pooling: `last` (the last prompt token's state: what a causal decoder's "sentence" state is, and vLLM's
default when it serves a generative model as an embedding model) or `mean` (over every prompt token);
`normalize` divides each vector by its L2 norm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pdserve.engine.attention import AttentionMetadata

POOLINGS: tuple[str, ...] = ("last", "mean")


def check_pooling(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")


def token_batches(lengths: Sequence[int], budget: int) -> list[range]:
    """Consecutive index ranges of the prompts whose token counts sum to at most `budget` each (a prompt
    longer than the budget runs alone)."""
    out: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > budget:
            out.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


@torch.inference_mode()
def pooled_hidden(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], block_size: int, kv_dtype: torch.dtype,
    device: torch.device | str, pooling: str, normalize: bool,
) -> torch.Tensor:  # [N, hidden] float32 (on the CPU)
    """Runs the prompts as one prefill step over a scratch KV cache and pools each one's final hidden
    states. Changes nothing of the caller's (the model's RoPE table may grow, as in any step)."""
    check_pooling(pooling)
    lens = [len(p) for p in prompts]
    nblocks = [-(-n // block_size) for n in lens]
    cfg = model.cfg  # type: ignore[attr-defined]
    scratch = torch.empty(cfg.kv_cache_shape(max(1, sum(nblocks)), block_size), dtype=kv_dtype, device=device)
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    width = max(nblocks)
    first = 0
    for p, n, nb in zip(prompts, lens, nblocks, strict=True):
        ids.extend(p)
        pos.extend(range(n))
        slots.extend(range(first * block_size, first * block_size + n))  # the prompt's blocks are contiguous
        tables.append(list(range(first, first + nb)) + [0] * (width - nb))
        first += nb
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)

    def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64), num_decode_tokens=0, decode_block_tables=None,
        decode_context_lens=None, prefill_block_tables=tensor(tables, torch.int32),
        prefill_cu_seqlens_q=tensor(cu, torch.int32), prefill_context_lens=tensor(lens, torch.int32),
    )
    hidden = model(tensor(ids, torch.int64), tensor(pos, torch.int64), meta, scratch)  # [T, H] float32
    ends = tensor(cu[1:], torch.int64)
    if pooling == "last":
        pooled = hidden.index_select(0, ends - 1)
    else:
        seg = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), tensor(lens, torch.int64))
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        pooled = sums.index_add_(0, seg, hidden.float()) / tensor(lens, torch.float32)[:, None]
    pooled = pooled.float()
    if normalize:
        pooled = F.normalize(pooled, p=2.0, dim=-1)
    return pooled.cpu()
