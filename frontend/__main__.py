"""`python -m pdserve.frontend --etcd HOST:PORT --models FILE [--tenants FILE] [--host H] [--port P]`."""

from __future__ import annotations

from pdserve.frontend.main import main

raise SystemExit(main())
