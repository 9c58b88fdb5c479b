"""prefill_node."""
