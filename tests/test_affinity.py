"""`node_common.pinning`: CPU lists, the even split `pdserve up --pin` uses, and pinning every thread of a
process (a real child process with a thread started before the pin)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pdserve.node_common.pinning import format_cpus, parse_cpus, split_cpus
from testing.up_cluster import REPO_ROOT


def test_parse_and_format() -> None:
    assert parse_cpus("0") == (0,)
    assert parse_cpus("3,0-1, 1") == (0, 1, 3)
    assert format_cpus((0, 2)) == "0,2"
    for bad in ("", ",", "2-1", "-1", "a"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_split_is_even_disjoint_and_covers_the_cpus() -> None:
    assert split_cpus((0, 1), 2) == [(0,), (1,)]
    assert split_cpus((0, 1), 1) == [(0, 1)]
    assert split_cpus((0, 1, 2, 3, 4), 2) == [(0, 1), (2, 3, 4)]  # the remainder goes to the later sets
    assert split_cpus((4, 5, 6, 7), 3) == [(4,), (5,), (6, 7)]
    assert split_cpus((0, 1), 3) == [(0,), (1,), (0,)]  # more nodes than CPUs: they share, round-robin


def test_pin_process_moves_threads_started_before_it() -> None:
    cpu = min(os.sched_getaffinity(0))
    script = textwrap.dedent(f"""
        import os, threading
        from pdserve.node_common.pinning import pin_process
        started, stop = threading.Event(), threading.Event()
        seen = {{}}
        def early():
            seen["tid"] = threading.get_native_id()
            started.set()
            stop.wait()
        t = threading.Thread(target=early); t.start(); started.wait()
        pin_process(({cpu},))
        masks = {{tuple(sorted(os.sched_getaffinity(int(tid)))) for tid in os.listdir("/proc/self/task")}}
        late = []
        t2 = threading.Thread(target=lambda: late.append(tuple(sorted(os.sched_getaffinity(0))))); t2.start(); t2.join()
        stop.set(); t.join()
        print(sorted(masks), late)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[({cpu},)] [({cpu},)]"


def test_pinning_outside_the_usable_cpus_is_refused() -> None:
    from pdserve.node_common.pinning import pin_process
    with pytest.raises(ValueError, match="not within"):
        pin_process((max(os.sched_getaffinity(0)) + 1000,))


def test_launcher_splits_its_cpus_over_the_nodes(tmp_path) -> None:
    from pdserve.deploy.launcher.config import LauncherConfig

    cpu = min(os.sched_getaffinity(0))
    one = LauncherConfig(model=str(tmp_path), num_prefill=0, num_decode=1, pin=True, cpus=(cpu,))
    assert one.node_cpus() == {"decode-0": (cpu,)} and one.node_threads("decode-0") == 1
    pd = LauncherConfig(model=str(tmp_path), num_prefill=1, num_decode=1, pin=True, cpus=(cpu,))
    assert pd.node_cpus() == {"prefill-0": (cpu,), "decode-0": (cpu,)}  # one CPU: both share it
    free = LauncherConfig(model=str(tmp_path), num_prefill=1, num_decode=2)
    usable = len(os.sched_getaffinity(0))  # unpinned: the usable CPUs divided among a pool's nodes
    assert free.node_cpus() == {} and free.node_threads("decode-1") == max(1, usable // 2)
    assert free.node_threads("prefill-0") == usable
    assert LauncherConfig(model=str(tmp_path), num_threads=3, pin=True).node_threads("prefill-0") == 3
    with pytest.raises(ValueError, match="--cpus needs --pin"):
        LauncherConfig(model=str(tmp_path), cpus=(cpu,))
    with pytest.raises(ValueError, match="not all usable"):
        LauncherConfig(model=str(tmp_path), pin=True, cpus=(max(os.sched_getaffinity(0)) + 1000,))


def test_decode_nodes_prefill_when_the_prefill_queue_is_full_unless_pinned(tmp_path) -> None:
    """`pdserve up` gives decode nodes --max-prefill-queue-tokens: the default when the nodes share the
    cores (unpinned), 0 when pinned or colocated, else what was asked; prefill nodes never get it."""
    from pdserve.decode_node.config import DecodeNodeConfig
    from pdserve.deploy.cli import build_parser
    from pdserve.deploy.launcher.config import DEFAULT_LOCAL_MAX_PREFILL_QUEUE_TOKENS, LauncherConfig
    from pdserve.deploy.launcher.process import Slot, command

    def flag(cfg: LauncherConfig, pool: str) -> list[str]:
        argv = command(cfg, Slot(f"{pool}-0", pool, tmp_path / "log"), ["127.0.0.1:2379"], tmp_path)
        return argv[argv.index("--max-prefill-queue-tokens"):][:2] if "--max-prefill-queue-tokens" in argv else []

    shared = LauncherConfig(model=str(tmp_path))
    assert flag(shared, "decode") == ["--max-prefill-queue-tokens", str(DEFAULT_LOCAL_MAX_PREFILL_QUEUE_TOKENS)]
    assert flag(shared, "prefill") == []
    assert LauncherConfig(model=str(tmp_path), pin=True).decode_max_prefill_queue_tokens == 0
    assert LauncherConfig(model=str(tmp_path), num_prefill=0).decode_max_prefill_queue_tokens == 0
    assert flag(LauncherConfig(model=str(tmp_path), max_prefill_queue_tokens=512), "decode")[1] == "512"
    with pytest.raises(ValueError, match="max-prefill-queue-tokens"):
        LauncherConfig(model=str(tmp_path), max_prefill_queue_tokens=-1)
    assert str(DEFAULT_LOCAL_MAX_PREFILL_QUEUE_TOKENS) in build_parser().format_help() + "".join(
        a.format_help() for a in build_parser()._subparsers._group_actions[0].choices.values())
    node_argv = ["--node-id", "d", "--etcd", "x:1", "--model", str(tmp_path), "--max-prefill-queue-tokens", "300"]
    assert DecodeNodeConfig.from_argv(node_argv)[0].max_prefill_queue_tokens == 300
