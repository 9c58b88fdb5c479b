"""decode_node."""
