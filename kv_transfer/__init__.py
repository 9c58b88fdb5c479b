"""KV data plane: ships KV cache blocks from prefill to decode nodes over pairwise c10d channels.

Typical use (the metadata travels over the gRPC control plane, not over the channel)::

    # prefill node
    mgr = ChannelManager(ChannelConfig(node_id="p0", role="prefill", kv_address="10.0.0.1:7100"))
    sender = KVSender(get_kernel_ops(device="cpu"))
    handle = sender.send(mgr.channel_to("d0"), kv_cache, src_block_ids,
                         request_id="r1", num_tokens=300, timeout_s=10.0, layerwise=True)
    control_plane.forward(handle.meta.to_dict())     # before or while the layers are computed
    for layer in range(num_layers):
        ...compute layer...; handle.layer_ready(layer)
    result = await handle.wait()

    # decode node, for every metadata dict it gets
    meta = TransferMeta.from_dict(d)
    channel = mgr.channel_from(meta.prefill_id, prefill_kv_address, meta.epoch)
    result = await receiver.recv(channel, kv_cache, dst_block_ids, meta, timeout_s=10.0).wait()

See `kv_transfer.transfer` for the wire format and the ordering contract, `kv_transfer.manager`
for which node hosts a pair's rendezvous and how epochs are numbered.
"""

from __future__ import annotations

from pdserve.kv_transfer.backend import PairGroup, PendingOp, TransferTimeout
from pdserve.kv_transfer.channel import Channel
from pdserve.kv_transfer.manager import ChannelManager
from pdserve.kv_transfer.receive import KVReceiver
from pdserve.kv_transfer.send import KVSender, SendHandle
from pdserve.kv_transfer.transfer import TransferHandle, message_ranges
from pdserve.kv_transfer.types import (
    DECODE_RANK,
    PREFILL_RANK,
    ChannelCapacityError,
    ChannelConfig,
    ChannelError,
    ChannelKey,
    ChannelState,
    NodeAddress,
    PhaseSeconds,
    StaleEpochError,
    TransferMeta,
    TransferResult,
)

__all__ = [
    "DECODE_RANK",
    "PREFILL_RANK",
    "Channel",
    "ChannelCapacityError",
    "ChannelConfig",
    "ChannelError",
    "ChannelKey",
    "ChannelManager",
    "ChannelState",
    "KVReceiver",
    "KVSender",
    "NodeAddress",
    "PairGroup",
    "PendingOp",
    "PhaseSeconds",
    "SendHandle",
    "StaleEpochError",
    "TransferHandle",
    "TransferMeta",
    "TransferResult",
    "TransferTimeout",
    "message_ranges",
]
