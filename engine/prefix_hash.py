"""The chained prefix hash of full KV blocks: what a node's prefix cache is keyed on and what routers
hash for prefix affinity. Pure Python (no torch, no engine state), so the frontend can import it.

Every node sharing ``hash_seed`` and ``block_size`` computes the same hashes for the same tokens, on any
machine: ``H(seed, parent_hash, tokens)`` over blake2b, never Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence as SequenceOf

BlockHash = bytes


def hash_block_tokens(seed: int, parent: BlockHash | None, token_ids: SequenceOf[int]) -> BlockHash:
    """Chained hash of one full block: stable across processes and machines (unlike ``hash()``)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(seed.to_bytes(16, "little", signed=True))
    # The flag byte keeps "no parent" distinct from any 16-byte parent digest.
    h.update(b"\x00" if parent is None else b"\x01" + parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def compute_block_hashes(
    token_ids: SequenceOf[int], block_size: int, seed: int, known: SequenceOf[BlockHash] = ()
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block has none).

    ``known`` may hold the hashes of a leading run of those blocks, already computed; they are reused."""
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block_tokens(seed, parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
