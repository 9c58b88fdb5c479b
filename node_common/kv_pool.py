"""The KV pool a node's transfers read and write: the engine's pool, or every tensor-parallel rank's."""

from __future__ import annotations

from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer.sharded import HeadShardedKV, KVPool


def transfer_pool(engine: LLMEngine) -> KVPool:
    """engine.kv_cache at TP = 1; at TP = N the N rank pools as one pool of all KV heads."""
    shards = engine.kv_shards
    if len(shards) == 1:
        return engine.kv_cache
    return HeadShardedKV(shards, engine.model_config.num_kv_heads)
