"""The prefill node: batches prefills, samples each request's first token and ships its KV blocks to the
decode node that reserved them (see `prefill_node.service`)."""
