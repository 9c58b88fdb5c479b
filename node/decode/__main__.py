"""`python -m decode_node ...`: run one decode node (see `decode_node.server.main`)."""

from __future__ import annotations

import sys

from decode_node.server import main

if __name__ == "__main__":
    sys.exit(main())
