"""Disaggregated serving between nodes of different tensor-parallel widths: real node processes (a TP = 2
node is rank 0 plus one worker rank process), KV shipped over the nodes' channels with heads resharded
(kv_transfer.sharded). Greedy tokens must equal TP = 1's single-process engine, and every block must be
back on every node after the requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.sampling_params import SamplingParams
from testing.cluster import LocalCluster, random_prompt, reference_engine

pytestmark = pytest.mark.timeout(600)

NODE_ARGS = ["--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16"]


def test_prefill_tp2_to_decode_tp1_and_tp1_to_tp2(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shared = random_prompt(70, 99)  # a prefix-cache hit on each node after the first request
    prompts = [random_prompt(n, seed) for seed, n in enumerate((40, 75, 130))]
    prompts += [shared + random_prompt(n, 10 + seed) for seed, n in enumerate((9, 20, 33))]
    params = SamplingParams(max_tokens=24, temperature=0)
    ref = reference_engine(tiny_llama_dir)
    try:
        want = [r.token_ids for r in ref.generate(prompts, params)]
    finally:
        ref.close()
    with LocalCluster(tmp_path / "cluster", tiny_llama_dir, node_args=NODE_ARGS) as cluster:
        cluster.start_etcd()
        tp2 = ["--tensor-parallel-size", "2"]
        remote = ["--local-prefill-threshold", "0"]
        nodes = [cluster.spawn_node("prefill", "p1", []), cluster.spawn_node("prefill", "p2", tp2),
                 cluster.spawn_node("decode", "d1", remote), cluster.spawn_node("decode", "d2", [*remote, *tp2])]
        cluster.wait_ready(nodes)
        cluster.wait_registry(lambda m: {"p1", "p2", "d1", "d2"} <= m.keys(), timeout_s=30, what="all nodes")
        for decode, prefill in (("d1", "p2"), ("d2", "p1"), ("d2", "p2")):  # 2 -> 1, 1 -> 2, 2 -> 2
            for prompt, tokens in zip(prompts, want, strict=True):
                got = cluster.generate(decode, prompt, params, prefill_node_id=prefill)
                assert not got.error, got.error
                assert got.prefill_node_id == prefill
                assert got.token_ids == tokens, f"{prefill} -> {decode}: tokens differ from TP 1"
        loads = cluster.wait_clean()
        assert all(load.kv_blocks_used == 0 for load in loads.values()), loads
        cluster.check_integrity()


def worker_ranks(pid: int) -> list[int]:
    """The tensor-parallel worker rank processes of node process `pid` (its spawned children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and "multiprocessing.spawn" in cmdline and "resource_tracker" not in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_a_lost_rank_takes_the_node_out_and_its_streams_finish_elsewhere(
        tiny_llama_dir: Path, tmp_path: Path, sig: str) -> None:
    import os
    import signal
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.node_common.ready import EXIT_UNHEALTHY
    from pdserve.registry.etcd_server import free_port
    from testing.procs import start_frontend
    from tests.test_nodes_health import MODEL, serving_node, stream

    decode_args = ["--local-prefill-threshold", "0", "--max-step-failures", "1", "--step-stall-timeout", "2",
                   "--tensor-parallel-size", "2"]
    with LocalCluster(tmp_path / "cluster", tiny_llama_dir, node_args=[*NODE_ARGS, "--model-name", MODEL],
                      lease_ttl_s=10) as cluster:
        cluster.start(1, 2, decode_args=decode_args)
        fe = start_frontend("frontend", tmp_path, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--model", f"{MODEL}={tiny_llama_dir}", "--max-migrations", "2", "--log-level", "warning")
        try:
            prompts = [f"The {sig} report of lighthouse number {i} says" for i in range(3)]
            expected = [stream(fe, p, 60) for p in prompts]
            injected: list[tuple[str, int]] = []
            lock = threading.Lock()

            def on_chunk(n: int) -> None:
                with lock:
                    if n == 8 and not injected:
                        node_id = serving_node(cluster)
                        ranks = worker_ranks(cluster.nodes[node_id].proc.pid)
                        assert len(ranks) == 1, ranks
                        os.kill(ranks[0], getattr(signal, sig))
                        injected.append((node_id, ranks[0]))

            with ThreadPoolExecutor(3) as pool:
                futures = [pool.submit(stream, fe, p, 60, on_chunk if i == 0 else None) for i, p in enumerate(prompts)]
                got = [f.result(timeout=300) for f in futures]
            assert injected, "the stream ended before the rank was signalled"
            bad, rank_pid = injected[0]
            assert got == expected, "a stream moved off the node that lost a rank differs from its uninterrupted run"
            cluster.wait_registry(lambda m: bad not in m, 30, f"{bad} out of the registry")
            assert cluster.nodes[bad].proc.wait(timeout=60) == EXIT_UNHEALTHY
            deadline = time.monotonic() + 10
            while Path(f"/proc/{rank_pid}").exists() and time.monotonic() < deadline:  # reaped or a zombie
                if "Z" in Path(f"/proc/{rank_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]:
                    break
                time.sleep(0.1)
            assert not Path(f"/proc/{rank_pid}").exists() or "Z" in Path(
                f"/proc/{rank_pid}/stat").read_text().rsplit(")", 1)[1].split()[0], "the worker rank outlived its node"
            cluster.kill(bad)
            log = cluster.nodes[bad].log_path.read_text()
            assert "is unhealthy" in log, log[-3000:]
            others = [n for n in ("d0", "d1") if n != bad]
            cluster.wait_clean(["p0", *others])
        finally:
            assert fe.stop() == 0, fe.proc.tail()


def test_pdserve_up_with_pools_of_different_widths_matches_tp1(tmp_path: Path) -> None:
    """`pdserve up --prefill-tp 2 --decode-tp 1` and `--prefill-tp 1 --decode-tp 2` (the tiny model, every
    prompt prefilled remotely) against colocated TP = 1: the same greedy text through the openai SDK, and
    every block back on every node (and rank: CheckIntegrity compares the ranks) afterwards. float32: in
    bfloat16 (`--dtype auto` on a machine with AVX512-BF16) a rank's partial sums round differently from
    the whole sum, so TP 2 decode may pick another token at a near tie, as any TP implementation does."""
    import httpx
    import openai

    from testing.up_cluster import UpCluster

    story = "The old lighthouse keeper kept a logbook of every ship, storm and visitor for forty years. "
    prompts = [f"{story * 3}Tell me about the {w} he kept there." for w in ("boat", "lamp", "dog")]  # > 64 tokens:
    common = ["--model", "tiny", "--dtype", "float32", "--lease-ttl", "2", "--kv-memory", "64",
              "--max-prefill-queue-tokens", "0"]  # remote
    texts = {}
    for name, flags in (("colocated tp1", ["--prefill", "0"]), ("prefill tp2 -> decode tp1", ["--prefill-tp", "2"]),
                        ("prefill tp1 -> decode tp2", ["--decode-tp", "2"])):
        workdir = tmp_path / name.replace(" -> ", "-").replace(" ", "-")
        workdir.mkdir()
        up = UpCluster.start(workdir, [*common, *flags])
        try:
            client = openai.OpenAI(base_url=f"{up.base_url}/v1", api_key="none", max_retries=0)
            model = client.models.list().data[0].id
            texts[name] = [client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0,
            ).choices[0].message.content for p in prompts]
            up.wait_clean()
            up.check_integrity()
            if "prefill-0" in up.nodes():  # every prompt was prefilled there and its KV shipped
                metrics = httpx.get(f"http://{up.nodes()['prefill-0']['metrics']}/metrics", timeout=10).text
                computed = sum(float(line.split()[-1]) for line in metrics.splitlines()
                               if line.startswith("pdserve_prefill_tokens_total"))
                assert computed > 64, computed  # (the shared story is a prefix-cache hit after the first)
            assert up.interrupt() == 0, up.stderr()[-3000:]
        finally:
            up.close()
    assert texts["prefill tp2 -> decode tp1"] == texts["colocated tp1"]
    assert texts["prefill tp1 -> decode tp2"] == texts["colocated tp1"], texts
