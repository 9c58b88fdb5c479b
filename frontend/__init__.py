"""The OpenAI-compatible frontend and gateway of a pdserve cluster.

Entry point: `python -m pdserve.frontend --etcd HOST:PORT --models FILE [--tenants FILE] [--host H] [--port P]`
(`frontend.main.main(argv)`). See frontend/README.md for the configuration files and operations.

Modules, in request order:
  app         FastAPI routes; the ASGI response that runs a generation and watches for disconnects;
              the header limit; /openapi.json (openapi.json, built by scripts/build_frontend_openapi.py)
  pipeline    Frontend: admission, upstream calls, streaming, accounting; main  the process entry
  admission   validate, tokenize, route, TTFT budget, tenant limits: the admitted Job
  prepare     parse and tokenize (pure)      workers  the worker processes admission's CPU work runs in
  protocol    request validation with OpenAI-style errors          errors   the OpenAI error shape
  messages    chat messages    prompts  completion prompts         validation  pydantic errors as OpenAI's
  tenants     tenants file and hashed API keys                     limits   token buckets and quotas
  models      served models, tokenizers, logprob token strings     routing  decode/prefill node choice
  job         the Job, its Choices and their Progress              ttft     TTFT prediction
  upstream    the Generate calls: retries, migrations, progress    connections  gRPC connections to decode nodes
  output      one choice's output, rendered once                   render   response bodies, SSE events
  tools       tool definitions, tool_choice, tool messages         tool_calls  generated text -> tool_calls
  structured  response_format and logit_bias                       accounting  a job's end: metrics, log
  metrics     Prometheus metrics                                   request_log  JSON lines per request
  tracing     a request's spans (when tracing is on)
  config      FrontendConfig (the process's one configuration) and the models file

Test helpers (OpenAPI checks, recording transports, process helpers) live in the top-level `testing/`.
"""
