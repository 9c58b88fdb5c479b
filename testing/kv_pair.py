"""Two ChannelManagers in this process, one prefill and one decode, and an open channel between them on
loopback: the smallest real KV data plane, for tests and benches."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pdserve.kv_transfer import Channel, ChannelConfig, ChannelManager


@contextmanager
def loopback_pair(prefill_id: str = "p-pair", decode_id: str = "d-pair", prefill_device: str = "cpu",
                  decode_device: str = "cpu") -> Iterator[tuple[Channel, Channel]]:
    """Yields (prefill-side channel, decode-side channel), connected; closes both managers on exit.
    On CUDA the two sides need two devices (an NCCL pair is one device a rank)."""
    with ChannelManager(ChannelConfig(prefill_id, "prefill", "127.0.0.1:0", device=prefill_device)) as prefill, \
            ChannelManager(ChannelConfig(decode_id, "decode", "127.0.0.1:0", device=decode_device)) as decode:
        ch = prefill.channel_to(decode_id)
        peer = decode.channel_from(prefill_id, prefill.kv_address, ch.key.epoch)
        ch.wait_connected(10)
        peer.wait_connected(10)
        yield ch, peer
