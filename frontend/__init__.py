"""The OpenAI-compatible frontend and gateway of a pdserve cluster.

Entry point: `python -m pdserve.frontend --etcd HOST:PORT --models FILE [--tenants FILE] [--host H] [--port P]`
(`frontend.main.main(argv)`). See frontend/README.md for the configuration files and operations.

Modules, in request order:
  app         FastAPI routes; the ASGI response that runs a generation and watches for disconnects;
              the header limit; /openapi.json (openapi.json, built by scripts/build_frontend_openapi.py)
  pipeline    Frontend: admission, tokenization, routing, upstream calls, streaming, accounting
  admission   validate, tokenize, route, TTFT budget, tenant limits: the admitted Job
  workers     the bounded thread pool admission's CPU work runs on    ttft  TTFT prediction
  protocol    request validation with OpenAI-style errors          errors   the OpenAI error shape
  messages    chat messages    prompts  completion prompts         validation  pydantic errors as OpenAI's
  tenants     tenants file and hashed API keys                     limits   token buckets and quotas
  models      served models, tokenizers, logprob token strings     routing  decode/prefill node choice
  upstream    gRPC channels and messages to decode nodes           render   response bodies, SSE events
  metrics     Prometheus metrics                                   request_log  JSON lines per request
  config      FrontendConfig (the process's one configuration) and the models file

Test helpers (OpenAPI checks, recording transports, process helpers) live in the top-level `testing/`.
"""
