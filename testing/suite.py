"""`./pdserve test`: the suite in two phases, to shorten it on a 2-core machine.

Most tests wait on processes (nodes, frontends, etcd, servers) far more than they compute, so the
whole suite runs on `PDSERVE_TEST_WORKERS` pytest-xdist workers (default 2; a test file stays on one
worker, so its module fixtures start once), then the tests marked `serial` (timing bounds of a few
tens of milliseconds that another worker's load would break) run alone. Arguments go to pytest in both
phases. A run that selects tests itself (a path, a node id, `-m`, `-n`) or PDSERVE_TEST_WORKERS=0 or 1
is one plain pytest run.

    python -m testing.suite [PYTEST ARGS...]
"""

from __future__ import annotations

import os
import subprocess
import sys

NO_TESTS = 5  # pytest's exit code when a run collected nothing


def _selects_itself(args: list[str]) -> bool:
    """Whether the arguments pick tests or workers (then the caller gets exactly the run it asked for)."""
    for i, a in enumerate(args):
        if a in ("-m", "-n", "--numprocesses") or a.startswith(("-m=", "-n", "--numprocesses=")):
            return True
        after_option = i > 0 and args[i - 1] in ("-k", "-p", "-o", "-c", "--rootdir", "--durations", "--timeout")
        if not a.startswith("-") and not after_option and ("::" in a or a.endswith(".py") or os.path.isdir(a)):
            return True
    return False


def _pytest(args: list[str]) -> int:
    return subprocess.call([sys.executable, "-m", "pytest", *args])


def main(args: list[str]) -> int:
    workers = int(os.environ.get("PDSERVE_TEST_WORKERS", "2"))
    if workers <= 1 or _selects_itself(args):
        return _pytest(args)
    parallel = _pytest(["-n", str(workers), "--dist", "loadfile", "-m", "not serial", *args])
    print("\n[pdserve test] the serial phase: timing-bound tests, alone", flush=True)
    serial = _pytest(["-m", "serial", *args])
    codes = [c for c in (parallel, serial) if c != NO_TESTS]
    if not codes:
        return NO_TESTS
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
