"""The decode node: admits requests (reserving their KV blocks first), prefills short ones itself,
has the rest prefilled on a prefill node whose KV it receives, and streams generated tokens
(see `node.decode.server`)."""
