"""What dtype "auto" serves in: bf16 for fp32 checkpoints on CPUs with AVX512-BF16 or AMX, else the
checkpoint's; explicit names win; the launcher reads the checkpoint's dtype without torch."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.engine.dtype import checkpoint_dtype_name, cpu_bf16_flags, resolve_dtype

BF16_CPU = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
AMX_CPU = "flags\t\t: avx512f amx_bf16 amx_tile\n"
OLD_CPU = "flags\t\t: fpu sse2 avx2\n"


def test_flags_are_read_from_cpuinfo() -> None:
    assert cpu_bf16_flags(BF16_CPU) == ("avx512_bf16",)
    assert cpu_bf16_flags(AMX_CPU) == ("amx_bf16",)
    assert cpu_bf16_flags(OLD_CPU) == ()


def test_auto_serves_fp32_checkpoints_in_bf16_where_fast() -> None:
    assert resolve_dtype("auto", "float32", "cpu", BF16_CPU).name == "bfloat16"
    assert "avx512_bf16" in resolve_dtype("auto", "float32", "cpu", BF16_CPU).reason
    assert resolve_dtype("auto", "float32", "cpu", OLD_CPU).name == "float32"
    assert resolve_dtype("auto", "float16", "cpu", BF16_CPU).name == "float16"  # a half checkpoint stays
    assert resolve_dtype("auto", "float32", "cuda:0", BF16_CPU).name == "float32"
    assert resolve_dtype("float32", "float32", "cpu", BF16_CPU).name == "float32"  # asked for explicitly


def test_checkpoint_dtype_name(tmp_path: Path) -> None:
    for raw, want in (({"torch_dtype": "bfloat16"}, "bfloat16"), ({"dtype": "float16"}, "float16"), ({}, "float32")):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        assert checkpoint_dtype_name(tmp_path) == want
