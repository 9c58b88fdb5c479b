"""The fp8 KV caches (e5m2, e4m3) through the real tiny model (head dim 64: the C++ kernel's AVX-512 rows): greedy
tokens from the C++ decode kernel equal the torch reference path's over the same fp8 pool, with ragged
prompts, chunked prefill over cached prefixes and prefix-cache hits; the KV cache really is one byte per
element (twice the blocks of a 16-bit KV cache in one budget); unsupported choices are refused at start; the
option reaches the nodes from `pdserve up` and works in `pdserve generate`."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiny import default_model_dir

MODEL = str(default_model_dir("llama"))


def _engine(backend: str, kv_cache_dtype: str = "fp8_e5m2", **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=MODEL, dtype="float32", kernel_backend=backend, num_kv_blocks=512,
                                  kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=96, num_threads=1,
                                  **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["fp8_e5m2", "fp8_e4m3"])
def engines(request: pytest.FixtureRequest) -> dict[str, LLMEngine]:
    return {"cpu": _engine("cpu", request.param), "torch": _engine("torch", request.param)}


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    shared = [rng.randrange(5, 4000) for _ in range(40)]  # a prefix-cache hit for the last two prompts
    lens = [1, 7, 16, 33, 150, 250]
    return [[rng.randrange(5, 4000) for _ in range(n)] for n in lens] + [shared + [11, 12], shared + [13] * 30]


def test_cpu_kernel_greedy_equals_the_torch_path_at_fp8(engines: dict[str, LLMEngine]) -> None:
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    out = {}
    for name, engine in engines.items():
        assert engine.kv_cache.dtype in (torch.float8_e5m2, torch.float8_e4m3fn)
        assert engine.kv_cache.element_size() == 1 and engine.ops.name == name
        out[name] = [r.token_ids for r in engine.generate(_prompts(), greedy)]
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_used_blocks == 0
    assert out["cpu"] == out["torch"]
    assert all(len(t) == 24 for t in out["cpu"])


def test_fp8_pool_holds_twice_the_blocks_of_a_16_bit_one() -> None:
    budget = 8 << 20
    fp8 = LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", kv_cache_memory_bytes=budget,
                                 kv_cache_dtype="fp8_e5m2"))
    bf16 = LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", kv_cache_memory_bytes=budget))
    assert bf16.kv_cache.dtype == torch.bfloat16 and fp8.kv_cache.dtype == torch.float8_e5m2
    assert fp8.num_blocks == 2 * bf16.num_blocks
    assert fp8.kv_cache.nbytes <= budget


@pytest.mark.parametrize(("kw", "match"), [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of"),
    ({"kv_cache_dtype": "fp8_e5m2", "kernel_backend": "triton"}, "CPU KV caches and the cpu/torch kernels only"),
    ({"kv_cache_dtype": "fp8_e5m2", "device": "cuda"}, "CPU KV caches and the cpu/torch kernels only"),
])
def test_unsupported_kv_cache_dtypes_are_refused(kw: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=MODEL, **kw)  # type: ignore[arg-type]


def test_pdserve_up_hands_the_kv_cache_dtype_to_every_node(tmp_path: Path) -> None:
    """The launcher's node command lines parse, through the nodes' own CLIs, into engines with that dtype."""
    from pdserve.decode_node.config import DecodeNodeConfig
    from pdserve.deploy.launcher.config import LauncherConfig
    from pdserve.deploy.launcher.process import Slot, command
    from pdserve.prefill_node.config import PrefillNodeConfig

    cfg = LauncherConfig(model=MODEL, kv_cache_dtype="fp8_e4m3", runs_dir=tmp_path)
    for pool, parse in (("prefill", PrefillNodeConfig.from_argv), ("decode", DecodeNodeConfig.from_argv)):
        argv = command(cfg, Slot(f"{pool[0]}0", pool, tmp_path / "log"), ["127.0.0.1:2379"], tmp_path)
        node_config, _ = parse(argv[argv.index(f"pdserve.{pool}_node") + 1 :])
        assert node_config.engine.kv_cache_dtype == "fp8_e4m3"


def test_cli_generate_with_an_fp8_kv_cache() -> None:
    cmd = [sys.executable, "-m", "pdserve.deploy", "generate", "--model", "tiny", "--prompt", "Hello there",
           "--max-tokens", "8", "--kv-cache-dtype", "fp8_e4m3"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert "completion_tokens=8" in p.stderr and p.stdout.strip()
    bad = subprocess.run([*cmd[:-1], "fp8"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "invalid choice: 'fp8'" in bad.stderr
