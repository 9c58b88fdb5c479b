"""The node runtime both node kinds share, and the two kinds themselves (`prefill_node`, `decode_node`).

Nodes know the engine, the KV data plane and the registry; they know nothing of HTTP.
"""
