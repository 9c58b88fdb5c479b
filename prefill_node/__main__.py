"""`python -m pdserve.prefill_node ...`: run one prefill node (see `prefill_node.service.main`)."""

from __future__ import annotations

import sys

from pdserve.prefill_node.service import main

if __name__ == "__main__":
    sys.exit(main())
