"""registry."""
