"""`python -m pdserve.frontend`: builds the FrontendConfig from flags and serves the app with uvicorn."""

from __future__ import annotations

import importlib.util
import logging
import signal
import sys

import uvicorn

from pdserve.frontend.app import create_app
from pdserve.frontend.config import ConfigError, build_parser, config_from_args
from pdserve.frontend.pipeline import Frontend
from pdserve.frontend.tenants import hash_key

log = logging.getLogger("frontend")

_OPEN_ACCESS_BANNER = """
==============================================================================================
  pdserve frontend: NO TENANTS FILE -- every request is accepted, with any API key or none,
  and no limits apply. This is for local development only; pass --tenants FILE in production.
==============================================================================================
"""


def main(argv: list[str] | None = None) -> int:
    """Runs the frontend until SIGINT/SIGTERM. Returns the process exit code (2 for a bad config)."""
    args = build_parser().parse_args(argv)
    if args.hash_key is not None:
        print(hash_key(args.hash_key))
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        frontend = Frontend(config)
    except (ConfigError, OSError) as err:
        print(f"frontend: error: {err}", file=sys.stderr)
        return 2
    if frontend.tenants.open_access:
        log.warning(_OPEN_ACCESS_BANNER)
    server_config = uvicorn.Config(
        create_app(frontend),
        host=config.host,
        port=config.port,
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http="httptools" if importlib.util.find_spec("httptools") else "h11",
        log_level=config.log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_keep_alive=30,
        # The last bound, behind the frontend's own (max_inflight, the prepare queue), which answer in the
        # OpenAI error shape first: uvicorn answers a plain 503 beyond this many connections and tasks.
        limit_concurrency=2 * config.max_inflight + config.prepare_queue + 64,
        # h11 buffers a request head up to this size (httptools has no such bound; HeaderLimit answers 431
        # in the OpenAI shape either way).
        h11_max_incomplete_event_size=config.max_header_bytes + 8192,
        ssl_certfile=config.tls_cert or None,
        ssl_keyfile=config.tls_key or None,
    )
    if config.tls_cert:
        server_config.load()  # makes the server's SSLContext, which a renewed certificate is loaded into
        frontend.tls_context = server_config.ssl
    log.info("pdserve frontend %s on %s://%s:%d (cluster %r, etcd %s)", config.frontend_id,
             "https" if config.tls_cert else "http", config.host, config.port, config.cluster,
             ",".join(config.etcd_endpoints))
    # uvicorn re-raises the stop signal once it has shut down, under the handler that was installed
    # before it: with the default one the process would die by SIGTERM after a clean drain. A no-op
    # handler lets a graceful stop exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(server_config).run()
    return 0
