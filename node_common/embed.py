"""The Embed RPC, shared by the prefill node and a colocated decode node: each input's pooled final hidden
state (`LLMEngine.embed_tensor`), prefill-only work that never touches the KV cache accounting.

The call is refused as the node's other calls are: UNAVAILABLE once the node drains or is unhealthy
(`NodeService.refuse_if_draining`), RESOURCE_EXHAUSTED beyond `MAX_EMBED_IN_FLIGHT` calls, INVALID_ARGUMENT
for a malformed request (no inputs, an empty input, ids outside the vocabulary, an input past the
context, an unknown pooling, `dimensions` other than the hidden size: no model here truncates). The
cluster token is checked before any handler runs (`rpc.security`).

The inputs run on the engine thread between steps, one engine command per batch of at most
max_num_batched_tokens tokens, so generation steps go on between the batches of a long request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from pdserve.engine.embedding import POOLINGS, token_batches
from pdserve.node_common.metrics import NodeMetrics
from pdserve.node_common.service import NodeService
from pdserve.rpc import pdserve_pb2 as pb

MAX_EMBED_IN_FLIGHT = 64  # Embed calls a node serves at once; beyond it RESOURCE_EXHAUSTED
MAX_EMBED_INPUTS = 2048  # inputs per call (the frontend's bound as well)


class EmbedServer:
    """Serves Embed calls for one node's service (counts its calls in flight)."""

    def __init__(self, service: NodeService, metrics: NodeMetrics) -> None:
        self.service = service
        self.metrics = metrics
        self.in_flight = 0
        engine = service.ctx.engine.engine
        self._vocab = engine.model_config.vocab_size
        self._hidden = engine.model_config.hidden_size
        self._max_len = engine.max_model_len
        self._budget = engine.cfg.max_num_batched_tokens

    def _check(self, request: pb.EmbedRequest, inputs: Sequence[list[int]]) -> str | None:
        if not inputs:
            return "inputs are empty"
        if len(inputs) > MAX_EMBED_INPUTS:
            return f"{len(inputs)} inputs; at most {MAX_EMBED_INPUTS} per call"
        if request.pooling not in POOLINGS:
            return f"pooling must be one of {', '.join(POOLINGS)}, not {request.pooling!r}"
        if request.HasField("dimensions") and request.dimensions != self._hidden:
            return f"dimensions {request.dimensions}: this model's embeddings have {self._hidden} (no truncation)"
        for i, ids in enumerate(inputs):
            if not ids:
                return f"input {i} is empty"
            if len(ids) > self._max_len:
                return f"input {i} has {len(ids)} tokens; the context is {self._max_len}"
            if min(ids) < 0 or max(ids) >= self._vocab:
                return f"input {i} has token ids outside [0, {self._vocab})"
        return None

    async def embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        await self.service.refuse_if_draining(context)
        inputs = [list(t.ids) for t in request.inputs]
        problem = self._check(request, inputs)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if self.in_flight >= MAX_EMBED_IN_FLIGHT:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "embedding queue is full")
        self.in_flight += 1
        try:
            parts: list[bytes] = []
            pooling, normalize = request.pooling, request.normalize
            for idx in token_batches([len(p) for p in inputs], self._budget):
                batch = [inputs[i] for i in idx]
                try:
                    vectors = await self.service.ctx.engine.call(
                        lambda e, b=batch: e.embed_tensor(b, pooling, normalize))  # type: ignore[misc]
                except RuntimeError as err:  # the engine stopped (the node is closing)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
                parts.append(await asyncio.to_thread(_le_bytes, vectors))
        finally:
            self.in_flight -= 1
        self.metrics.embedded(len(inputs), sum(len(p) for p in inputs))
        return pb.EmbedResponse(vectors=b"".join(parts), dimensions=self._hidden,
                                num_tokens=[len(p) for p in inputs], node_id=self.service.ctx.config.node_id)


def _le_bytes(vectors: object) -> bytes:
    """[N, H] float32 tensor -> its values as little-endian float32 bytes, row after row."""
    return vectors.numpy().astype("<f4", copy=False).tobytes()  # type: ignore[attr-defined]
