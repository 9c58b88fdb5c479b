"""The one interface the engine and the KV data plane call for attention, cache writes and KV packing.

KV cache layout (shared by every node of a cluster, and by the wire format):

    kv_cache: [L, 2, NB, BS, Hkv, D]   L layers, 2 = (key, value), NB blocks of BS slots
    k_cache = kv_cache[l, 0]:  [NB, BS, Hkv, D]   (a contiguous view per layer)

A *slot* is ``block_id * BS + offset``. Block tables are int32 ``[B, MB]`` rows of physical block ids;
entries past a sequence's last block are ignored (pad them with 0).

Wire format, layout version 1 (``pack_blocks``): the gathered blocks as one contiguous tensor in the
KV cache dtype, ordered ``[L, 2, n, BS, Hkv, D]`` for all layers or ``[2, n, BS, Hkv, D]`` for one layer,
``n`` = number of blocks in the order given. The receiver scatters it into its own block ids, so pools
of different sizes interoperate as long as L, BS, Hkv, D and dtype agree.

Pool dtypes: float32, bfloat16, float16, and float8_e5m2 / float8_e4m3fn (the `cpu` and `torch` backends
only; values are rounded to fp8 by `store_kv`, e4m3 saturating at +-448, and widened exactly to float32 by
every reader). An fp8 KV cache's wire buffer is
the same bytes; transports that lack float8 types send it as a uint8 view.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

KV_LAYOUT_VERSION = 1


def fp8_as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view (same memory) of a float8 tensor, else the tensor itself. Copies and transports that
    lack float8 kernels or types (torch's index_copy_, gloo) move an fp8 KV cache's elements as bytes, which
    are exactly the same bits."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype.is_floating_point else t


class KernelOps(ABC):
    """Attention and KV-movement operations over a paged KV cache. Implementations never allocate
    KV cache memory; they only read it, or write the slots/blocks they are given."""

    name: str = "abstract"

    @abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,  # [N, Hkv, D]
        value: torch.Tensor,  # [N, Hkv, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        slot_mapping: torch.Tensor,  # [N] int64; -1 means "do not store"
    ) -> None:
        """Writes key[i]/value[i] into slot slot_mapping[i] of k_cache/v_cache. Changes only those slots."""

    @abstractmethod
    def decode_attention(
        self,
        q: torch.Tensor,  # [B, Hq, D], one query token per sequence (the last position)
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        block_tables: torch.Tensor,  # [B, MB] int32
        context_lens: torch.Tensor,  # [B] int32, number of KV tokens (includes the query's own token)
        scale: float,
    ) -> torch.Tensor:  # [B, Hq, D]
        """Attention of each query over its first context_lens[b] cached tokens. Changes nothing."""

    @abstractmethod
    def prefill_attention(
        self,
        q: torch.Tensor,  # [T, Hq, D], queries of B sequences packed back to back
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        block_tables: torch.Tensor,  # [B, MB] int32
        cu_seqlens_q: torch.Tensor,  # [B + 1] int32, query offsets into q
        context_lens: torch.Tensor,  # [B] int32, KV tokens per sequence including the new ones
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Causal attention for new tokens whose K/V are already stored in the cache. Query i of
        sequence b sits at position context_lens[b] - q_len_b + i and sees positions <= its own
        (earlier positions may come from a prefix-cache hit or an earlier chunk). Changes nothing."""

    @abstractmethod
    def pack_blocks(
        self,
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        block_ids: torch.Tensor,  # [n] int64
        layer: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [L, 2, n, BS, Hkv, D] or [2, n, BS, Hkv, D] when layer is given
        """Gathers the blocks into one contiguous buffer (wire format v1). Writes only `out` if given."""

    @abstractmethod
    def unpack_blocks(
        self,
        buffer: torch.Tensor,  # [L, 2, n, BS, Hkv, D] or [2, n, BS, Hkv, D]
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        block_ids: torch.Tensor,  # [n] int64
        layer: int | None = None,
    ) -> None:
        """Scatters a wire-format buffer into the given blocks of kv_cache. Changes only those blocks."""

    def plan(
        self,
        q: torch.Tensor,  # [T, Hq, D]; only its shape is read
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]; only its geometry is read
        block_tables: torch.Tensor,  # [B, MB] int32
        context_lens: torch.Tensor,  # [B] int32
        cu_seqlens_q: torch.Tensor | None = None,  # [B + 1]; None: a decode batch (query row b = sequence b)
    ) -> object | None:
        """Work that every layer of a step would repeat (sorting, chunking, gather indices), done once.
        The caller hands the result to `attend_planned` for each layer while the inputs stay unchanged.
        None (the default) means this implementation has nothing to share: call decode_attention /
        prefill_attention instead. Changes nothing."""
        return None

    def attend_planned(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        plan: object,  # a non-None result of this implementation's `plan`
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """The attention `plan` was made for, over this layer's cache. Changes nothing."""
        raise NotImplementedError(f"kernel backend {self.name!r} makes no attention plans")

    # Small per-step ops of the model and the sampler. The torch versions below define the results;
    # a backend may replace them with a faster version giving the same bits (same indices for argmax,
    # same values for topk; silu_mul says where half-precision results may differ).

    def rotary(
        self,
        x: torch.Tensor,  # [T, H, D]
        cos: torch.Tensor,  # [T, 1, D] in x's dtype
        sin: torch.Tensor,  # [T, 1, D] in x's dtype, its first half negated (rotate-half's sign)
    ) -> torch.Tensor:  # [T, H, D], a new tensor
        """Rotate-half RoPE: x * cos + cat(x2, x1) * sin, each op rounded to x's dtype. With the sign in the
        table, (-a) * b == a * (-b) exactly, so this is the Hugging Face rotation with one op fewer. Changes
        nothing."""
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return (x * cos).add_(swapped.mul_(sin))  # summing into the fresh products

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, H]; float32 for `add`, changed in place then
        weight: torch.Tensor,  # [H]
        eps: float,
        add: torch.Tensor | None = None,  # [T, H]: added into x first (x is the residual stream)
    ) -> torch.Tensor:  # [T, H] in weight's dtype, a new tensor
        """RMSNorm as transformers computes it: x in float32 times rsqrt(mean(x^2) + eps), rounded to the
        weight's dtype, times the weight. With `add`, x += add first (changes x)."""
        if add is not None:
            x.add_(add)
        return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(weight.dtype).mul_(weight)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I], a new tensor
        """silu(gate) * up of a fused gate|up projection's rows, each op rounded to their dtype. A backend
        may compute e^-x differently for half-precision rows (a rounded silu then differs by one ulp of the
        dtype, rarely); float32 rows get these bits. Changes nothing."""
        inter = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :inter]).mul_(gate_up[..., inter:])

    def argmax(self, x: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N] int64
        """Index of each row's largest value (the first of equal ones; the first NaN if any). Changes
        nothing."""
        return x.argmax(dim=-1)

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # [N, k] values, indices
        """The k largest values of each row of x [N, V], descending, and their indices (which of equal
        values is taken is up to the backend). Changes nothing."""
        top = x.topk(k, dim=-1)
        return top.values, top.indices
