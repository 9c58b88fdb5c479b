"""Checksums of transferred KV bytes, so corrupted blocks are never served (fail closed).

Both sides digest a transfer's messages in order, as the bytes sit in their staging slots: the sender
after packing a message (before it goes on the wire), the receiver after the message arrived (before it
is unpacked into the KV cache). The sender's digest travels to the decode node in TransferDone
(`kv_checksum`, with its algorithm's name), which compares it with its own before the blocks count as
landed. xxh3_64 (the `xxhash` package) when installed, else zlib's crc32; the algorithm's name travels
with the value, so two nodes that disagree on it fail the comparison rather than skip it.
"""

from __future__ import annotations

import zlib

import torch

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a declared dependency; crc32 keeps the check without it
    xxhash = None

CHECKSUM_ALGO = "xxh3_64" if xxhash is not None else "crc32"


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (a device tensor is copied to the host first)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


class KVDigest:
    """A running digest over the messages of one transfer, in message order. Not thread-safe (each
    transfer's job owns one, on its channel worker)."""

    def __init__(self) -> None:
        self._xxh = xxhash.xxh3_64() if xxhash is not None else None
        self._crc = 0

    def update(self, t: torch.Tensor) -> None:
        """Adds the bytes of a staged message (any dtype, contiguous)."""
        data = _bytes_of(t)
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> int:
        """The digest so far, an unsigned 64-bit value."""
        return self._xxh.intdigest() if self._xxh is not None else self._crc

