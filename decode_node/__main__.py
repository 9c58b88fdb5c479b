"""`python -m pdserve.decode_node ...`: run one decode node (see `decode_node.service.main`)."""

from __future__ import annotations

import sys

from pdserve.decode_node.service import main

if __name__ == "__main__":
    sys.exit(main())
