"""Frontend start-up cost: seconds from `python -m pdserve.frontend` to a 200 on /health, and the process's resident
memory then; also the bare `import pdserve.frontend.main` time and whether torch got imported.

    .venv/bin/python bench/frontend_startup.py [--repeat 5] [--repo DIR]

`--repo` measures another checkout (e.g. an older commit in a scratch worktree) with this interpreter.
A loopback etcd is started for the frontends to join (an empty cluster: /health answers, /ready does not).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_once(repo: Path, model_dir: str, etcd: str) -> tuple[float, float]:
    """(seconds to a healthy /health, resident MiB at that point) of one frontend process."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "pdserve.frontend", "--etcd", etcd, "--host", "127.0.0.1", "--port", str(port),
            "--model", f"tiny={model_dir}"]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"frontend exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - start, _rss_mib(proc.pid)
            except OSError:
                time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait(10)


def import_once(repo: Path) -> tuple[float, bool]:
    """(seconds for `import pdserve.frontend.main` in a fresh interpreter, whether torch was imported)."""
    code = ("import sys, time; t = time.perf_counter(); import pdserve.frontend.main; "
            "print(time.perf_counter() - t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo)),
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), out[1] == "True"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--repo", type=Path, default=REPO_ROOT)
    parser.add_argument("--model", default="")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO_ROOT))
    import tempfile

    from pdserve.engine.tiny import default_model_dir
    from pdserve.registry import EtcdServer

    model = args.model or str(default_model_dir("llama"))
    imports = [import_once(args.repo) for _ in range(args.repeat)]
    with tempfile.TemporaryDirectory() as tmp, EtcdServer(Path(tmp) / "etcd", log_level="warn") as etcd:
        starts = [start_once(args.repo, model, etcd.endpoints[0]) for _ in range(args.repeat)]
    print(f"repo {args.repo}")
    print(f"import pdserve.frontend.main: median {statistics.median(t for t, _ in imports):.3f}s, "
          f"torch imported: {imports[0][1]}")
    print(f"start to /health: median {statistics.median(t for t, _ in starts):.3f}s, "
          f"RSS median {statistics.median(r for _, r in starts):.1f} MiB")


if __name__ == "__main__":
    main()
