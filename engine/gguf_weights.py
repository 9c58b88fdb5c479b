"""A model directory's weights served straight from its GGUF file (`model.gguf`): quantized blocks as the file
stores them, no float copy.

A quantized model directory is what `import_gguf(..., weights="gguf")` and `pdserve model quantize` write:
config.json, generation_config.json, the tokenizer files and `model.gguf`, no safetensors. The config files
say what the model is; the GGUF's tensor table says where each tensor's blocks lie. Projections and the
embedding of a type the quantized kernels run (`kernels.quant_format.QUANT_TYPES`) are handed out as
QuantWeight views of the mapped file; norms, biases and tensors of other types are dequantized to float32.
llama.cpp's converter interleaves the rows of llama Q/K projections for its RoPE layout; they are put back
in Hugging Face order here (rows are independent in every GGUF type, so blocks move as they are).

Blocks the loader copies (fused Q/K/V and gate/up projections, llama's reordered Q/K rows) leave the
mapping's pages behind; `release_copied` tells the kernel this process no longer needs them, so a node's
resident memory is one copy of the weights, not the copies plus the file (an 8B Q4_K model: 4.6 GB, not 7).
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable
from pathlib import Path

import torch

from pdserve.engine.gguf_plan import hf_tensor_name, unpermute_rows
from pdserve.engine.gguf_scan import GGUFImportError, GGUFTensorEntry, open_gguf_weights
from pdserve.engine.model_config import ModelConfig, ModelLoadError
from pdserve.kernels.quant_format import QUANT_TYPES, QuantFormatError, QuantWeight


class GGUFWeights:
    """Hands out the tensors of `model.gguf` by Hugging Face name, checking shapes against the config.
    The file stays mapped while any QuantWeight it handed out is alive."""

    def __init__(self, path: Path, cfg: ModelConfig) -> None:
        self.path = path
        self.file = open_gguf_weights(path)
        self.by_hf: dict[str, GGUFTensorEntry] = {}
        for name, entry in self.file.tensors.items():
            hf = hf_tensor_name(name)
            if hf is not None:
                self.by_hf[hf] = entry
        # llama.cpp permutes llama Q/K rows (rotary pairs interleaved); qwen2/qwen3 keep HF order.
        self.permute: dict[str, int] = {}
        self._touched: list[tuple[int, int]] = []  # (offset, bytes) of the tensors read, not yet released
        if self.file.metadata.get("general.architecture") == "llama":
            for i in range(cfg.num_layers):
                for part in ("weight", "bias"):
                    self.permute[f"model.layers.{i}.self_attn.q_proj.{part}"] = cfg.num_heads
                    self.permute[f"model.layers.{i}.self_attn.k_proj.{part}"] = cfg.num_kv_heads

    def _read(self, entry: GGUFTensorEntry) -> None:
        self._touched.append((entry.offset, entry.nbytes))

    def release_copied(self, kept: Iterable[torch.Tensor]) -> int:
        """Drops from this process's memory the file pages read so far that no tensor in `kept` (every
        tensor still viewing the file) lies on; their data lives on in copies. The pages stay in the page
        cache for other processes, and a later read would fault them back. Returns the bytes released."""
        base = self.file.data.ctypes.data
        views = sorted((t.data_ptr() - base, t.data_ptr() - base + t.nbytes) for t in kept
                       if 0 <= t.data_ptr() - base < len(self.file.data))
        page = mmap.PAGESIZE
        released = 0
        for lo, n in self._touched:
            hi = lo + n
            if any(a < hi and lo < b for a, b in views):
                continue
            start, end = -(-lo // page) * page, hi // page * page  # whole pages inside this tensor only
            if end > start:
                if _libc().madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(end - start), MADV_DONTNEED):
                    continue  # advice refused: the pages stay, which costs memory only
                released += end - start
        self._touched = []
        return released

    def _entry(self, name: str, shape: tuple[int, ...]) -> GGUFTensorEntry:
        entry = self.by_hf.get(name)
        if entry is None:
            raise ModelLoadError(f"{self.path}: tensor for '{name}' is missing from the GGUF file")
        if tuple(entry.shape) != tuple(shape):
            raise ModelLoadError(f"{self.path}: tensor '{entry.name}' has shape {list(entry.shape)}, but "
                                 f"config.json implies {list(shape)}")
        return entry

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor `name` dequantized to float32 [shape], in Hugging Face row order."""
        entry = self._entry(name, shape)
        self._read(entry)
        try:
            t = torch.from_numpy(self.file.values(entry.name))
        except GGUFImportError as e:
            raise ModelLoadError(str(e)) from e
        heads = self.permute.get(name)
        return unpermute_rows(t, heads) if heads else t

    def get_weight(self, name: str, shape: tuple[int, int]) -> QuantWeight | torch.Tensor:
        """A projection or embedding: its blocks when the kernels run its type (a view of the file, rows
        moved only where llama.cpp interleaved them), else float32."""
        entry = self._entry(name, shape)
        if entry.type_name not in QUANT_TYPES:
            return self.get(name, shape)
        self._read(entry)
        raw = self.file.data[entry.offset : entry.offset + entry.nbytes]
        try:
            w = QuantWeight.from_raw(entry.name, entry.type_name, (shape[0], shape[1]), raw)
        except QuantFormatError as e:
            raise ModelLoadError(f"{self.path}: {e}") from e
        heads = self.permute.get(name)
        if heads:
            w = w.select_rows(unpermute_rows(torch.arange(shape[0]), heads))
        return w


MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
