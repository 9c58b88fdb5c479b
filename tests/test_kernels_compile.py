"""Ahead-of-time compilation of every Triton kernel for a Hopper GPU (sm_90), on a machine without one.

Triton ships ptxas, so lowering to a cubin needs no driver: this catches code that the CPU interpreter
accepts but the compiler rejects (tile shapes, dot operand layouts, precisions) before the GPU check.
The kernel modules are loaded as private copies with the interpreter switched off, because another test
module may have switched it on for the shared ones.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
HOPPER = GPUTarget("cuda", 90, 32)


def _compiled_copy(stem: str) -> ModuleType:
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        spec = importlib.util.spec_from_file_location(f"_aot_{stem}", KERNELS / f"{stem}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def _compile(kernel: object, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict[str, object],
             num_warps: int = 4) -> object:
    names = kernel.arg_names  # type: ignore[attr-defined]
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=HOPPER, options={"num_warps": num_warps})


NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _has_ptxas() -> bool:
    return (NVIDIA_BIN / "ptxas").exists()


def _stack_bytes(compiled: object) -> int | None:
    """Per-thread stack frame of the cubin (non-zero means register spills), or None without cuobjdump."""
    tool = NVIDIA_BIN / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])  # type: ignore[attr-defined]
        f.flush()
        res = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True)
    match = re.search(r"STACK:(\d+)", res.stdout)
    return int(match.group(1)) if match else None


pytestmark = [
    pytest.mark.skipif(not _has_ptxas(), reason="this Triton build has no bundled ptxas"),
    pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset"),  # Triton's notice of a default
]


@pytest.mark.parametrize("head_dim", [128, 64])
def test_decode_kernels_compile_without_spills(head_dim: int) -> None:
    mod = _compiled_copy("triton_decode")
    block_n, warps = mod._tile_config(torch.bfloat16, head_dim)
    qk, pv = mod.dot_precisions(torch.bfloat16)
    split = _compile(
        mod._decode_split_kernel,
        {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "tables_ptr": "*i32", "ctx_ptr": "*i32",
         "out_ptr": "*fp32", "lse_ptr": "*fp32"},
        ("scale_log2",),
        dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=head_dim, D_PAD=head_dim, PAGE=16, BLOCK_N=block_n, WRITE_LSE=True,
             QK_PRECISION=qk, PV_PRECISION=pv),
        num_warps=warps,
    )
    assert "mma" in split.asm["ptx"]  # the score and value products run on tensor cores
    assert _stack_bytes(split) in (0, None)
    merge = _compile(
        mod._merge_splits_kernel,
        {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"},
        (),
        dict(SPLITS_PAD=32, HEAD_DIM=80, D_PAD=128),
    )
    assert merge.asm["cubin"]


def test_prefill_kernel_compiles_without_spills() -> None:
    mod = _compiled_copy("triton_prefill")
    block_m, block_n, warps = mod._tile_config(torch.float16, 128)
    qk, pv = mod.dot_precisions(torch.float16)
    kernel = _compile(
        mod._prefill_kernel,
        {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "tables_ptr": "*i32", "cu_ptr": "*i32",
         "ctx_ptr": "*i32", "out_ptr": "*fp16"},
        ("scale_log2",),
        dict(GROUP=8, HEAD_DIM=80, D_PAD=128, PAGE=16, BLOCK_M=block_m, BLOCK_N=block_n, QK_PRECISION=qk,
             PV_PRECISION=pv),
        num_warps=warps,
    )
    assert "mma" in kernel.asm["ptx"]
    assert _stack_bytes(kernel) in (0, None)


def test_cache_and_block_kernels_compile() -> None:
    cache = _compiled_copy("triton_cache")
    store = _compile(
        cache._store_kv_kernel,
        {"key_ptr": "*fp32", "value_ptr": "*fp32", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
         "slot_ptr": "*i64"},
        (),
        dict(HEADS=8, H_PAD=8, HEAD_DIM=128, D_PAD=128, PAGE=16),
    )
    assert store.asm["cubin"]
    blocks = _compiled_copy("triton_blocks")
    for to_buffer in (True, False):
        copy = _compile(
            blocks._copy_blocks_kernel,
            {"pool_ptr": "*bf16", "buffer_ptr": "*bf16", "ids_ptr": "*i64"},
            (),
            dict(TO_BUFFER=to_buffer, CHUNK=4096),
        )
        assert copy.asm["cubin"]
