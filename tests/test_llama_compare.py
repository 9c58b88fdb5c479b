"""`bench/llama_compare.py --smoke`: the pdserve-against-llama.cpp bench runs end to end in seconds on the
tiny model (a real `pdserve up`, a GGUF written for the tiny model), so its report cannot break unnoticed.
llama-server takes part only where a build for this CPU is cached (bench/llama_build.py); otherwise the
report must say that it was skipped and why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testing.procs import REPO_ROOT

pytestmark = [pytest.mark.timeout(300), pytest.mark.quick]


def test_smoke_reports_both_servers_or_why_not(tmp_path: Path, tiny_llama_dir: Path) -> None:
    out = tmp_path / "compare.json"
    argv = [sys.executable, "bench/llama_compare.py", "--smoke", "--no-progress", "--json", str(out),
            "--keep", str(tmp_path / "work")]
    run = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    plan = res["plan"]
    assert f"CPU ISA {res['isa']}" in run.stdout, run.stdout

    # pdserve served every request of every level, each exactly the asked-for tokens by its usage.
    pd = res["pdserve"]
    assert [lv["concurrency"] for lv in pd["levels"]] == plan["concurrency"]
    for lv in pd["levels"]:
        assert lv["ok"] == lv["requests"] > 0, lv
        assert lv["usage_reported"] and lv["output_tokens"] == [plan["output_tokens"]] * lv["ok"], lv
        assert lv["tpot_p50_s"] > 0 and lv["ttft_p50_s"] > 0 and lv["output_tok_s"] > 0, lv
    assert [g["prompt"] for g in pd["greedy"]] == plan["greedy_prompts"]
    kinds = {name.rsplit(" ", 1)[0] for name in pd["memory"]}
    assert {"prefill node", "decode node", "frontend"} <= kinds, pd["memory"]
    assert all(m["peak"] >= m["anon"] > 0 for m in pd["memory"].values()), pd["memory"]
    assert "memory of pdserve" in run.stdout
    assert all(g["text"] and 0 < g["completion_tokens"] <= plan["greedy_tokens"] for g in pd["greedy"]), pd["greedy"]

    # The GGUF facts and the roofline: a decode step reads every tensor but the (untied) token embedding.
    import gguf

    facts = res["gguf"]
    reader = gguf.GGUFReader(facts["path"])
    assert sum(facts["type_counts"].values()) == facts["tensors"] == len(reader.tensors) > 0
    assert not facts["tied_embeddings"]  # the tiny model has its own LM head
    embd = next(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
    assert facts["step_bytes"] == sum(int(t.n_bytes) for t in reader.tensors) - embd, facts
    roof, rates = res["roofline"], res["memory_rates"]
    assert rates["copy_gbps"] > 0 and rates["read_gbps"] > 0, rates
    assert roof["copy_s"] == pytest.approx(facts["step_bytes"] / (rates["copy_gbps"] * 1e9))
    assert "roofline, one stream" in run.stdout

    ll = res["llama"]
    if res["llama_skipped"]:
        assert ll["levels"] == [] and res["greedy"] is None
        assert "skipped: " in res["llama_skipped"] and res["llama_skipped"] in run.stdout
        assert all(row["llama"] is None for row in res["comparisons"])
    else:  # a cached llama-server took part: the same figures, token counts and an agreement summary
        for lv in ll["levels"]:
            assert lv["ok"] == lv["requests"] and lv["output_tokens"] == [plan["output_tokens"]] * lv["ok"], lv
        for row in res["comparisons"]:
            assert row["tpot_llama_over_pdserve"] == pytest.approx(row["llama"]["tpot_p50_s"]
                                                                   / row["pdserve"]["tpot_p50_s"])
        g = res["greedy"]
        assert g["compared"] == len(plan["greedy_prompts"]) and 0 <= g["identical"] <= g["compared"], g
        assert "greedy agreement" in run.stdout


def test_without_a_cached_build_the_smoke_skips_llama_and_says_why(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import llama_build
    from bench.llama_compare import find_llama, parse_args

    monkeypatch.setenv("PDSERVE_LLAMA_CPP_DIR", str(tmp_path / "none"))
    exe, version, why = find_llama(parse_args(["--smoke"]))
    assert exe is None and version is None
    assert why.startswith("skipped: no llama.cpp build for this CPU") and str(tmp_path / "none") in why
    assert not (tmp_path / "none").exists()  # the smoke never builds

    # A finished build for this CPU is found; one for another CPU, or one without its marker, is not.
    def fake(name: str, marker: bool) -> Path:
        root = tmp_path / "none" / name
        (root / "bin").mkdir(parents=True)
        (root / "bin" / "llama-server").write_bytes(b"")
        if marker:
            (root / llama_build.DONE_MARKER).write_text(json.dumps({"version": name.split("-")[0]}))
        return root

    fake("9.0.0-0000000000", marker=True)
    fake(f"11.0.0-{llama_build.cpu_key()}", marker=False)
    assert llama_build.find_cached() is None
    built = fake(f"10.0.0-{llama_build.cpu_key()}", marker=True)
    found = llama_build.find_cached()
    assert found is not None and found.root == built and found.version == "10.0.0"
    assert find_llama(parse_args(["--smoke"]))[0] == built / "bin" / "llama-server"


def test_a_tied_lm_head_counts_the_token_embedding_once(tmp_path: Path, tiny_llama_dir: Path) -> None:
    import gguf

    from bench.llama_compare import gguf_facts
    from tests.gguf_fixtures import write_gguf

    untied, tied = tmp_path / "untied.gguf", tmp_path / "tied.gguf"
    write_gguf(tiny_llama_dir, untied, "Q8_0")
    write_gguf(tiny_llama_dir, tied, "Q8_0", drop=frozenset({"lm_head.weight"}))
    a, b = gguf_facts(untied), gguf_facts(tied)
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(untied)).tensors}
    assert not a.tied_embeddings and b.tied_embeddings
    assert a.step_bytes == sum(sizes.values()) - sizes["token_embd.weight"]
    assert b.step_bytes == a.step_bytes - sizes["output.weight"] + sizes["token_embd.weight"]
    assert a.type_counts == {"Q8_0": 30, "F32": 10} and b.type_counts == {"Q8_0": 29, "F32": 10}
