"""`python -m frontend --etcd HOST:PORT --models FILE [--tenants FILE] [--host H] [--port P]`."""

from __future__ import annotations

from frontend.server import main

raise SystemExit(main())
