"""`python -m prefill_node ...`: run one prefill node (see `prefill_node.server.main`)."""

from __future__ import annotations

import sys

from prefill_node.server import main

if __name__ == "__main__":
    sys.exit(main())
