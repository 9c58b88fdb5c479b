"""The KV sends of a prefill node's calls (`Sends`): the one place a send is queued, from the event loop
after the call's first token or, layer-wise, from the engine thread in the step that computes the call's
last prompt chunk (the engine's prefill watcher, `engine.step_hook`; `LayerSends` then releases each
layer to the pair channel as the forward finishes it). One lock orders every move of a call's send state
(handle, channel, stage, aborted) between the two threads."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping

import torch

from pdserve.engine.sequence import Sequence
from pdserve.engine.step_hook import LayerHook
from pdserve.kv_transfer import ChannelError, ChannelManager, KVSender, SendHandle
from pdserve.prefill_node.call import PrefillCall, Stage
from pdserve.prefill_node.metrics import PrefillMetrics


class Sends:
    """Queues the calls' sends (any thread) and moves their send state under one lock."""

    def __init__(
        self, sender: KVSender, kv_cache: torch.Tensor, channels: ChannelManager, calls: Mapping[str, PrefillCall],
        metrics: PrefillMetrics, timeout_s: float,
    ) -> None:
        self._sender = sender
        self._kv_cache = kv_cache  # [L, 2, NB, BS, Hkv, D], the engine's KV cache (the sends read it)
        self._channels = channels
        self._calls = calls  # the service's calls, by request id (read only)
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._loop = asyncio.get_running_loop()

    def queue(self, call: PrefillCall, src_blocks: list[int], num_tokens: int, layerwise: bool) -> str | None:
        """Unless the call was aborted or ended, queues the send of `src_blocks` and moves the call to
        SENDING (its blocks are held until the send resolves). Returns why nothing was queued, or None."""
        with self._lock:
            if call.aborted or call.stage != Stage.IN_ENGINE:
                return call.aborted or "the Prefill call ended"
            try:
                channel = self._channels.channel_to(call.decode_id)
                handle = self._sender.send(
                    channel, self._kv_cache, src_blocks, request_id=call.key,
                    num_tokens=num_tokens, timeout_s=self._timeout_s, layerwise=layerwise,
                )
            except (ChannelError, ValueError) as err:
                return f"send not queued: {err}"
            call.channel, call.handle = channel, handle
            call.send_queued_at = time.monotonic()
            call.advance(Stage.SENDING)
        return None

    def abort(self, call: PrefillCall, reason: str) -> bool:
        """Marks the call aborted (keeping the first reason); no send is queued for it from here on.
        Returns whether its send was queued already."""
        with self._lock:
            if call.aborted is None:
                call.aborted = reason
            return call.handle is not None

    def end(self, call: PrefillCall) -> None:
        """The call is over (ENDING): from here on the engine thread queues no send for it."""
        with self._lock:
            call.advance(Stage.ENDING)

    def prefills_completing(self, seqs: list[Sequence]) -> LayerHook | None:
        """The engine's prefill watcher (engine thread, before the forward of the step that computes the
        last prompt chunk of `seqs`): queues the layer-wise send of every such call that wants one and
        tells the loop to announce it. A send that cannot be queued is left to the path after the first
        token, which tries again and reports why."""
        handles: list[SendHandle] = []
        for seq in seqs:
            call = self._calls.get(seq.seq_id)
            send = call.layerwise if call is not None else None
            if call is None or send is None:
                continue
            src = seq.block_table[send.skip : send.skip + send.count]
            if self.queue(call, src, send.num_tokens, layerwise=True) is None:
                assert call.handle is not None
                handles.append(call.handle)
                self._loop.call_soon_threadsafe(call.layerwise_queued.set)
        if not handles:
            return None
        self._metrics.layerwise_queued(len(handles))
        return LayerSends(handles)


class LayerSends:
    """One engine step's layer-wise sends (`LayerHook`, engine thread): each layer goes to the channel
    as the forward finishes it; on CUDA `layer_ready` records an event on the engine thread's stream,
    which the channel's stream waits for. At the end every layer is marked, also when the forward
    failed: the send then ships whatever the blocks hold and the Prefill call reports it failed
    (TransferDone ok false), so the decode node drains the bytes and never uses them."""

    def __init__(self, handles: list[SendHandle]) -> None:
        self._handles = handles

    def layer_done(self, layer: int) -> None:
        for handle in self._handles:
            handle.layer_ready(layer)

    def step_done(self, ok: bool) -> None:
        for handle in self._handles:
            handle.all_layers_ready()
