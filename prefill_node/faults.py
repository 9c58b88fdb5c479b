"""The prefill node's fault hook: the named points where tests inject faults into a node process, those
every node has (`NodeFaults`) and its own (see `node_common.faults` for how a test picks the
implementation). `PrefillFaults` itself injects none: it is what every production prefill node runs, and
each of its methods is a pass-through."""

from __future__ import annotations

from pdserve.kernels.interface import KernelOps
from pdserve.kv_transfer import KVSender
from pdserve.node_common.faults import NodeFaults
from pdserve.prefill_node.call import PrefillCall


class PrefillFaults(NodeFaults):
    """Where a prefill node lets a test change what it does; this class changes nothing."""

    def new_sender(self, ops: KernelOps) -> KVSender:
        """Called once, as the service starts: the KV sender every send of the node goes through. A fault
        may return a sender of its own that changes what a send ships, when its layers go or the outcome
        its handle reports."""
        return KVSender(ops)

    async def after_first_token(self, call: PrefillCall) -> None:
        """Called on the event loop once a call's FirstToken went out and its send is to be queued now
        (a send not queued layer-wise during the prefill), just before it is. May wait, which queues the
        send that much later (the call may be aborted meanwhile); changes nothing."""
