"""`pdserve model quantize DIR OUT --type Q8_0|Q4_K`: a float checkpoint turned into a served quantized one.

OUT is a quantized model directory (engine.gguf_weights): DIR's config, generation config, tokenizer and
chat template files, and `model.gguf` holding every projection and the embedding (and an untied LM head)
in the asked block type, the norms and biases in F32. Tensors take llama.cpp's names and layout (llama
Q/K rows interleaved for its RoPE) and the metadata holds the hyperparameters, tokenizer and chat template
(engine.gguf_write), so llama.cpp's `llama-server` loads the same file. A matrix whose rows are not a
whole number of blocks of the type falls back to Q8_0 (32-value blocks), else F32, as llama.cpp's
quantizer does. Tensors are read, quantized and written one at a time, so memory stays near the size of
the largest one.
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
from pdserve.engine.gguf_write import GGUFModelWriter, PlannedTensor
from pdserve.engine.loader import CheckpointReader
from pdserve.engine.model_config import (
    GGUF_WEIGHTS,
    ModelConfig,
    ModelLoadError,
    load_model_config,
    weight_files,
)
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


def type_for(shape: tuple[int, ...], requested: str) -> str:
    if len(shape) != 2:
        return "F32"
    for candidate in (requested, "Q8_0"):
        if shape[1] % block_layout(candidate)[0] == 0:
            return candidate
    return "F32"


def quantize_model(src: str | Path, out: str | Path, type_name: str, log: bool = True) -> Path:
    """Writes OUT (which must not exist, or be empty) from the float checkpoint SRC; returns OUT. The
    directory is built beside OUT and renamed into place, so it appears complete or not at all."""
    import torch

    if type_name not in TYPES or type_name not in QUANT_TYPES:
        raise ValueError(f"--type must be one of {', '.join(TYPES)}, got {type_name!r}")
    src, out = Path(src), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: already exists and is not an empty directory")
    cfg = load_model_config(src)
    if cfg.weight_format:
        raise ModelLoadError(f"{src}: already quantized ({cfg.weight_format}); quantize a float checkpoint")
    arch = gguf_arch(cfg)
    files = weight_files(src)
    started = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    reader = CheckpointReader(src, files)

    def planned(hf: str) -> PlannedTensor:
        shape = reader.shape(hf)
        kind = type_for(shape, type_name)

        def data() -> np.ndarray:
            with torch.no_grad():
                w = reader.tensor(hf).float().numpy()
            heads = permuted_heads(cfg, arch, hf)
            if heads:
                w = permute_rows(w, heads)
            w = np.ascontiguousarray(w, dtype=np.float32)
            return w if kind == "F32" else quantize(torch.from_numpy(w), kind, name=gguf_tensor_name(hf)).data.numpy()

        return PlannedTensor(gguf_tensor_name(hf), shape, kind, data)

    try:
        writer = GGUFModelWriter(tmp / GGUF_WEIGHTS, src, cfg, arch, type_name, src.name)
        tensors = [*writer.rope_tensor(), *(planned(hf) for hf in sorted(files, key=_file_order))]
        writer.write(tensors)
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
        counts: dict[str, int] = {}
        for t in tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        mix = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        size = (out / GGUF_WEIGHTS).stat().st_size
        print(f"[pdserve] quantized {src} -> {out}: {mix}; {size / 2**20:.1f} MiB in "
              f"{time.perf_counter() - started:.1f}s", file=sys.stderr)
    return out


def gguf_arch(cfg: ModelConfig) -> str:
    """llama.cpp's architecture name for the config (Mistral checkpoints are llama to it)."""
    return next(a for a, hf in ARCHITECTURES.items() if hf == cfg.arch.replace("Mistral", "Llama"))


def permuted_heads(cfg: ModelConfig, arch: str, hf: str) -> int:
    """The head count whose rows llama.cpp interleaves in tensor `hf` (llama Q/K), else 0."""
    if arch != "llama":
        return 0
    if hf.endswith(("q_proj.weight", "q_proj.bias")):
        return cfg.num_heads
    if hf.endswith(("k_proj.weight", "k_proj.bias")):
        return cfg.num_kv_heads
    return 0


def _file_order(hf: str) -> tuple[int, str]:
    """Global tensors first, then layer by layer (llama.cpp's order)."""
    if hf.startswith("model.layers."):
        return int(hf.split(".")[2]) + 1, hf
    return 0, hf
