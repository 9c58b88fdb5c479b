"""Compiles every Triton kernel for a Hopper GPU (sm_90) and prints one JSON report on stdout.

Run by tests/test_kernels_compile.py as `python tests/aot_compile.py` in a subprocess whose environment
has no TRITON_INTERPRET and a private, empty TRITON_CACHE_DIR: Triton fixes the interpreter choice when a
kernel module is imported and reuses cached kernels by hash, so only a fresh process with an empty cache
proves that the compiler itself accepts the code. Refuses to run (exit 2) with the interpreter on.

Report: {case: {"error": traceback or null, "kernels": {name: {"mma": bool, "stack": int | null,
"cubin_bytes": int}}}}. `stack` is the per-thread stack frame that cuobjdump reports (non-zero means
register spills), null where this Triton build has no cuobjdump.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make this checkout's packages importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _compile(kernel: Any, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict[str, object],
             num_warps: int = 4) -> Any:
    """Compiles `kernel` for HOPPER; arguments not named as pointers, floats or constexprs are i32."""
    names = kernel.arg_names
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


def _stack_bytes(compiled: Any) -> int | None:
    """Per-thread stack frame of the cubin, or None without cuobjdump (writes and removes a temp file)."""
    tool = NVIDIA_BIN / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True)
    match = re.search(r"STACK:(\d+)", res.stdout)
    return int(match.group(1)) if match else None


def _decode(head_dim: int) -> dict[str, Any]:
    from pdserve.kernels import triton_decode as mod

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
    merge = _compile(
        mod._merge_splits_kernel,
        {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"},
        (),
        dict(SPLITS_PAD=32, HEAD_DIM=80, D_PAD=128),
    )
    return {"decode_split": split, "merge_splits": merge}


def _prefill() -> dict[str, Any]:
    from pdserve.kernels import triton_prefill as mod

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
    return {"prefill": kernel}


def _cache_and_blocks() -> dict[str, Any]:
    from pdserve.kernels import triton_blocks, triton_cache

    out = {
        "store_kv": _compile(
            triton_cache._store_kv_kernel,
            {"key_ptr": "*fp32", "value_ptr": "*fp32", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
             "slot_ptr": "*i64"},
            (),
            dict(HEADS=8, H_PAD=8, HEAD_DIM=128, D_PAD=128, PAGE=16),
        )
    }
    for to_buffer in (True, False):
        out[f"copy_blocks_to_buffer={to_buffer}"] = _compile(
            triton_blocks._copy_blocks_kernel,
            {"pool_ptr": "*bf16", "buffer_ptr": "*bf16", "ids_ptr": "*i64"},
            (),
            dict(TO_BUFFER=to_buffer, CHUNK=4096),
        )
    return out


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "decode_hd128": lambda: _decode(128),
    "decode_hd64": lambda: _decode(64),
    "prefill": _prefill,
    "cache_and_blocks": _cache_and_blocks,
}


def main() -> int:
    """Compiles every case (a failing case is reported, the others still run) and prints the report."""
    if triton.knobs.runtime.interpret:
        print("TRITON_INTERPRET is on: this would test the interpreter, not the compiler", file=sys.stderr)
        return 2
    report: dict[str, Any] = {}
    for case, build in CASES.items():
        try:
            compiled = build()
            kernels = {
                name: {"mma": "mma" in c.asm["ptx"], "stack": _stack_bytes(c), "cubin_bytes": len(c.asm["cubin"])}
                for name, c in compiled.items()
            }
            report[case] = {"error": None, "kernels": kernels}
        except Exception:  # reported, not raised: the test shows the compiler's message for its case
            report[case] = {"error": traceback.format_exc(), "kernels": {}}
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
