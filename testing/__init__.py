"""Test and benchmark tools for the frontend: OpenAPI conformance checks, recording HTTP transports for
the openai SDK, and helpers that run the frontend and scripted nodes as real processes."""
