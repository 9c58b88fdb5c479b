"""`python -m node.prefill ...`: run one prefill node (see `node.prefill.server.main`)."""

from __future__ import annotations

import sys

from node.prefill.server import main

if __name__ == "__main__":
    sys.exit(main())
