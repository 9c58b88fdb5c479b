"""kv_transfer."""
