"""`python -m node.decode ...`: run one decode node (see `node.decode.server.main`)."""

from __future__ import annotations

import sys

from node.decode.server import main

if __name__ == "__main__":
    sys.exit(main())
