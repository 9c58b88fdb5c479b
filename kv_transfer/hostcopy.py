"""Block gather/scatter between a CPU KV cache and a wire-format v1 staging buffer, on the calling
thread only.

Why not the kernel ops' `pack_blocks`/`unpack_blocks` for CPU pools: their `index_select` /
`index_copy_` over dim 2 of the 6-D KV cache go through TensorIterator, which splits anything above
32k elements across torch's OpenMP pool. On a small, shared machine the second OpenMP thread is
often descheduled, and the region then waits for it: a 0.5 MiB copy measured ~8 ms instead of
~20 us, which dominated the whole transfer. Both copies here move whole blocks as contiguous
byte rows and never enter a parallel region:
  gather   `torch.index_select(dim=1, out=)` on a contiguous [S, NB, X] byte view takes ATen's
           serial memcpy-per-row path (~50 GB/s here);
  scatter  torch has no serial scatter, so it is numpy fancy assignment on the same byte view
           (a memcpy per row, ~50 GB/s, GIL released while it copies).
The result is byte-identical to the kernel ops' wire format v1 for every dtype, since whole
[BS, Hkv, D] blocks are moved as raw bytes.
"""

from __future__ import annotations

import numpy as np
import torch


def supported(kv_cache: torch.Tensor) -> bool:
    """Whether `kv_cache` ([L, 2, NB, BS, Hkv, D]) can use these copies: a contiguous CPU KV cache."""
    return kv_cache.device.type == "cpu" and kv_cache.is_contiguous() and kv_cache.numel() > 0


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[L', 2, N, BS, Hkv, D] contiguous -> [L'*2, N, BS*Hkv*D*itemsize] uint8, same memory."""
    layers, two, n = t.shape[:3]
    return t.view(torch.uint8).view(layers * two, n, -1)


def gather(kv_layers: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[l, kv, j] = kv_layers[l, kv, ids[j]]. kv_layers: [L', 2, NB, BS, Hkv, D] contiguous CPU;
    ids: [n] int64 CPU, in range; out: [L', 2, n, BS, Hkv, D] contiguous, same dtype. Writes only out."""
    torch.index_select(_rows(kv_layers), 1, ids, out=_rows(out))


def scatter(buf: torch.Tensor, kv_layers: torch.Tensor, ids_np: np.ndarray) -> None:
    """kv_layers[l, kv, ids[j]] = buf[l, kv, j]. buf: [L', 2, n, BS, Hkv, D] contiguous CPU;
    kv_layers: [L', 2, NB, BS, Hkv, D] contiguous CPU, same dtype; ids_np: [n] int64, distinct and in
    range. Writes only the ids' blocks of kv_layers."""
    _rows(kv_layers).numpy()[:, ids_np] = _rows(buf).numpy()
