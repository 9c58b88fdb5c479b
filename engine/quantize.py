"""`pdserve model quantize DIR OUT --type Q8_0|Q4_K`: a float checkpoint turned into a served quantized one.

OUT is a quantized model directory (engine.gguf_weights): DIR's config, generation config, tokenizer and
chat template files, and `model.gguf` holding every projection and the embedding (and an untied LM head)
in the asked block type, the norms and biases in F32. Tensors take llama.cpp's names and layout (llama
Q/K rows interleaved for its RoPE), so the file reads like one llama.cpp's converter would write. A matrix
whose rows are not a whole number of blocks of the type falls back to Q8_0 (32-value blocks), else F32,
as llama.cpp's quantizer does. Tensors are read and quantized one at a time, so memory stays near the
size of the output.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pdserve.engine.gguf_config import ARCHITECTURES
from pdserve.engine.gguf_plan import GLOBAL_TENSORS, LAYER_TENSORS
from pdserve.engine.loader import CheckpointReader
from pdserve.engine.model_config import GGUF_WEIGHTS, ModelLoadError, load_model_config, weight_files
from pdserve.kernels.quant_format import QUANT_TYPES, block_layout, quantize

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
# What `quantize` copies from DIR besides the weights.
SKIP_SUFFIXES = (".safetensors", ".safetensors.index.json", ".gguf")


def gguf_tensor_name(hf: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name (the inverse of gguf_plan.hf_tensor_name)."""
    for gguf_name, hf_name in GLOBAL_TENSORS.items():
        if hf == hf_name:
            return gguf_name
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    for gguf_name, hf_name in LAYER_TENSORS.items():
        if rest == hf_name:
            return f"blk.{layer}.{gguf_name}"
    raise ModelLoadError(f"tensor '{hf}' has no GGUF name")


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `permute` of a Q or K projection: within each head the rotary pairs interleaved (the
    inverse of gguf_plan.unpermute_rows)."""
    rows, rest = weight.shape[0], weight.shape[1:]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def _type_for(shape: tuple[int, ...], requested: str) -> str:
    if len(shape) != 2:
        return "F32"
    for candidate in (requested, "Q8_0"):
        if shape[1] % block_layout(candidate)[0] == 0:
            return candidate
    return "F32"


def quantize_model(src: str | Path, out: str | Path, type_name: str, log: bool = True) -> Path:
    """Writes OUT (which must not exist, or be empty) from the float checkpoint SRC; returns OUT. The
    directory is built beside OUT and renamed into place, so it appears complete or not at all."""
    import gguf
    import torch

    if type_name not in TYPES or type_name not in QUANT_TYPES:
        raise ValueError(f"--type must be one of {', '.join(TYPES)}, got {type_name!r}")
    src, out = Path(src), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: already exists and is not an empty directory")
    cfg = load_model_config(src)
    if cfg.weight_format:
        raise ModelLoadError(f"{src}: already quantized ({cfg.weight_format}); quantize a float checkpoint")
    arch = next(a for a, hf in ARCHITECTURES.items() if hf == cfg.arch.replace("Mistral", "Llama"))
    files = weight_files(src)
    started = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    reader = CheckpointReader(src, files)
    try:
        writer = gguf.GGUFWriter(str(tmp / GGUF_WEIGHTS), arch)
        writer.add_name(src.name)
        writer.add_file_type(int(getattr(gguf.LlamaFileType, f"MOSTLY_{type_name}", gguf.LlamaFileType.ALL_F32)))
        counts: dict[str, int] = {}
        for hf in sorted(files, key=_file_order):
            with torch.no_grad():
                t = reader.tensor(hf).float()
            w = t.numpy()
            if arch == "llama" and hf.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
                heads = cfg.num_heads if ".q_proj." in hf else cfg.num_kv_heads
                w = permute_rows(w, heads)
            kind = _type_for(tuple(w.shape), type_name)
            name = gguf_tensor_name(hf)
            if kind == "F32":
                writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
            else:
                q = quantize(torch.from_numpy(np.ascontiguousarray(w)), kind, name=name)
                writer.add_tensor(name, q.data.numpy(), raw_dtype=gguf.GGMLQuantizationType[kind])
            counts[kind] = counts.get(kind, 0) + 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith(SKIP_SUFFIXES):
                shutil.copyfile(f, tmp / f.name)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        reader.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if log:
        mix = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        size = (out / GGUF_WEIGHTS).stat().st_size
        print(f"[pdserve] quantized {src} -> {out}: {mix}; {size / 2**20:.1f} MiB in "
              f"{time.perf_counter() - started:.1f}s", file=sys.stderr)
    return out


def _file_order(hf: str) -> tuple[int, str]:
    """Global tensors first, then layer by layer (llama.cpp's order)."""
    if hf.startswith("model.layers."):
        return int(hf.split(".")[2]) + 1, hf
    return 0, hf
