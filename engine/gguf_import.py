"""Imports a GGUF checkpoint (llama.cpp's single-file format) as a Hugging Face model directory.

`import_gguf(FILE.gguf, DIR)` writes what the engine (and transformers) load: config.json rebuilt from
the GGUF metadata, model.safetensors (sharded past MAX_SHARD_BYTES) with every tensor dequantized by
the `gguf` package (`gguf.quants.dequantize`) to plain float32 or bfloat16, tokenizer.json through
transformers' GGUF tokenizer conversion (so the ids equal `AutoTokenizer.from_pretrained(...,
gguf_file=...)`), tokenizer_config.json and chat_template.jinja with the file's chat template, and
generation_config.json with its EOS ids.

Architectures: llama, qwen2, qwen3. llama.cpp's converter interleaves the rows of each head of the llama
Q and K projections for its RoPE layout, and stores llama3 RoPE scaling as a `rope_freqs.weight` tensor of
per-frequency divisors; both are undone here.

`scan_gguf` reads the file itself rather than through `gguf.GGUFReader`, which builds numpy views of
every vocabulary string (seconds for a 50k vocabulary) and stops at the first bad byte without saying
which tensor or field it was reading. The scan checks the magic, the version, every length against the
file size, the tensor types and that every tensor lies inside the file, so a bad file fails with a
GGUFImportError naming the file and the field or tensor, before anything is written. The directory
appears atomically: it is built beside DIR and renamed into place at the end.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from engine.model_config import ModelLoadError, parse_model_config

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # v1 counted with 32-bit integers; nothing current writes it
DEFAULT_ALIGNMENT = 32
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# What gguf-py dequantizes with plain numpy and this module supports (the IQ/TQ/FP4 families are not).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# safetensors.save_file holds a second copy of a shard while it writes, so shards stay modest.
MAX_SHARD_BYTES = 2 * 1024**3
MAX_DIMS = 4

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {  # blk.N.<gguf> -> model.layers.N.<hf>
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_down.bias": "mlp.down_proj.bias",
}
ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE scaling, folded into config.json's rope_scaling
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")

# Fixed-size GGUF metadata value types -> struct format (8 = string and 9 = array are variable-size).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFImportError(ValueError):
    """A GGUF file that cannot be imported; the message names the file and the field or tensor."""


class ImportProgress(Protocol):
    """Receives progress reports from `import_gguf`."""

    def stage(self, text: str) -> None: ...

    def tensors(self, done: int, total: int) -> None: ...


class StderrProgress:
    """A line per stage on stderr, and a tensor progress bar when stderr is a terminal."""

    def __init__(self, prefix: str = "pdserve") -> None:
        self.prefix = prefix
        self._bar: Any = None
        self._task: Any = None

    def stage(self, text: str) -> None:
        self._close_bar()
        print(f"[{self.prefix}] {text}", file=sys.stderr, flush=True)

    def tensors(self, done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self._bar = Progress("  tensors", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("tensors", total=total)
        self._bar.update(self._task, completed=done)
        if done >= total:
            self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class _Silent:
    def stage(self, text: str) -> None:
        pass

    def tensors(self, done: int, total: int) -> None:
        pass


# -- the file ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFTensorEntry:
    """One tensor of the file's tensor table, checked to lie inside the file."""

    name: str
    type_name: str  # e.g. "Q4_K"
    shape: tuple[int, ...]  # torch order: rows first (GGUF lists dimensions fastest-moving first)
    offset: int  # absolute byte offset of its data in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file as `scan_gguf` read it: metadata, tensor table (file order), and the mapped bytes.

    `metadata` holds scalars, strings and numeric arrays (as lists); string arrays (the vocabulary, the
    merges) are not decoded, only counted in `array_lengths`, which has every array field."""

    path: Path
    version: int
    alignment: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: dict[str, GGUFTensorEntry]
    data: np.ndarray  # the whole file, memory-mapped uint8

    def values(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized by the gguf package: a fresh float32 array in torch order."""
        entry = self.tensors[name]
        qtype = gguf.GGMLQuantizationType[entry.type_name]
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        # gguf.quants.dequantize takes the raw bytes, one row of blocks per row (floats are read by view).
        raw = self.data[entry.offset : entry.offset + entry.nbytes].reshape(-1, entry.shape[-1] // block * block_bytes)
        try:
            values = gguf.quants.dequantize(raw, qtype)
            return np.array(values, dtype=np.float32).reshape(entry.shape)
        except Exception as e:  # gguf raises plain errors for malformed blocks
            raise GGUFImportError(f"{self.path}: tensor '{name}' ({entry.type_name}) cannot be dequantized ({e})") from e


class _Cursor:
    """Reads little-endian values from the mapped file; running past its end is a truncated file."""

    def __init__(self, buf: np.ndarray, path: Path) -> None:
        self.buf, self.path, self.size, self.pos = buf, path, len(buf), 0

    def take(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise GGUFImportError(
                f"{self.path}: file is truncated: {what} needs {n} bytes at offset {start}, "
                f"but the file has {self.size} bytes"
            )
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))

    def string(self, what: str) -> str:
        (n,) = self.unpack("<Q", what)
        start = self.take(n, what)
        return self.buf[start : start + n].tobytes().decode("utf-8", errors="replace")

    def value(self, value_type: int, key: str, lengths: dict[str, int]) -> Any:
        """Reads one metadata value. String arrays are stepped over (None), their length kept in `lengths`."""
        what = f"metadata field '{key}'"
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type], what)[0]
        if value_type == _STRING:
            return self.string(what)
        if value_type != _ARRAY:
            raise GGUFImportError(f"{self.path}: {what} has unknown value type {value_type}")
        element_type, count = self.unpack("<IQ", what)
        lengths[key] = count
        if element_type in _SCALARS:
            fmt = _SCALARS[element_type]
            start = self.take(count * struct.calcsize(fmt), what)
            return list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, start))
        if element_type == _STRING:
            for _ in range(count):  # variable-size elements: walk them
                (n,) = self.unpack("<Q", what)
                self.take(n, what)
            return None
        if element_type == _ARRAY:
            return [self.value(_ARRAY, key, {}) for _ in range(count)]
        raise GGUFImportError(f"{self.path}: {what} is an array of unknown type {element_type}")


def _type_name(type_id: int, tensor: str, path: Path) -> str:
    try:
        name = gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        raise GGUFImportError(
            f"{path}: tensor '{tensor}' has unknown ggml tensor type {type_id} "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        ) from None
    if name not in SUPPORTED_TYPES:
        raise GGUFImportError(
            f"{path}: tensor '{tensor}' has tensor type {name} ({type_id}), which is not supported "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    return name


def scan_gguf(path: str | Path) -> GGUFFile:
    """Reads the header, metadata and tensor table of a GGUF file (tensor data stays mapped, unread).
    Raises GGUFImportError for a wrong magic, an unsupported version, a truncated file, an unknown or
    unsupported tensor type, or a tensor table that does not fit the file."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise GGUFImportError(f"{path}: file is empty (truncated), not a GGUF file")
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise GGUFImportError(f"{path}: cannot read the file ({e.strerror or e})") from e
    return _scan(_Cursor(buf, path))


def _scan(cur: _Cursor) -> GGUFFile:
    path = cur.path
    magic = cur.buf[:4].tobytes()
    if magic != GGUF_MAGIC:
        if GGUF_MAGIC.startswith(magic):
            raise GGUFImportError(f"{path}: file is truncated: {cur.size} bytes, shorter than the GGUF header")
        raise GGUFImportError(f"{path}: wrong magic {magic!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
    cur.take(4, "magic")
    (version,) = cur.unpack("<I", "the version")
    if version not in GGUF_VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        kind = "a big-endian GGUF file" if swapped in GGUF_VERSIONS else f"GGUF version {version}"
        raise GGUFImportError(f"{path}: {kind} is not supported (versions {GGUF_VERSIONS}, little-endian)")
    n_tensors, n_fields = cur.unpack("<QQ", "the tensor and metadata counts")
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for i in range(n_fields):
        key = cur.string(f"metadata key #{i}")
        (value_type,) = cur.unpack("<I", f"metadata field '{key}'")
        metadata[key] = cur.value(value_type, key, lengths)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFImportError(f"{path}: metadata field 'general.alignment' must be a power of two, got {alignment!r}")
    raw = []
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor #{i}")
        (n_dims,) = cur.unpack("<I", f"tensor '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFImportError(f"{path}: tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS} expected)")
        dims = cur.unpack(f"<{n_dims}Q", f"tensor '{name}'")
        type_id, rel_offset = cur.unpack("<IQ", f"tensor '{name}'")
        raw.append((name, dims, type_id, rel_offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorEntry] = {}
    for name, dims, type_id, rel_offset in raw:
        if name in tensors:
            raise GGUFImportError(f"{path}: tensor '{name}' appears twice in the tensor table")
        type_name = _type_name(type_id, name, path)
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
        if dims[0] % block:
            raise GGUFImportError(
                f"{path}: tensor '{name}' has rows of {dims[0]} values, not a whole number of {type_name} blocks ({block})"
            )
        nbytes = math.prod(dims) // block * block_bytes
        offset = data_start + rel_offset
        if offset + nbytes > cur.size:
            raise GGUFImportError(
                f"{path}: file is truncated: tensor '{name}' ({type_name}, {nbytes} bytes at offset {offset}) "
                f"ends past the end of the file ({cur.size} bytes)"
            )
        tensors[name] = GGUFTensorEntry(name, type_name, tuple(reversed(dims)), offset, nbytes)
    return GGUFFile(path, version, alignment, metadata, lengths, tensors, cur.buf)


# -- metadata -> config.json ---------------------------------------------------------------------------


class _Metadata:
    """Typed access to the GGUF metadata; a missing or mistyped field is a GGUFImportError naming it."""

    def __init__(self, file: GGUFFile) -> None:
        self.file, self.path = file, file.path

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if key not in self.file.metadata:
            if default is ...:
                raise GGUFImportError(f"{self.path}: missing metadata field '{key}'")
            return default
        value = self.file.metadata[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise GGUFImportError(f"{self.path}: metadata field '{key}' is {value!r}, expected {kind}")
        return value

    def count(self, key: str) -> int | None:
        """Element count of an array field (e.g. the vocabulary)."""
        return self.file.array_lengths.get(key)


def _tidy_float(value: float) -> float:
    """float32 metadata as a config would write it: 1e-05 rather than 9.999999747378752e-06."""
    return float(str(np.float32(value)))


def _snap(value: float, digits: int) -> float:
    # Recovered RoPE constants come out slightly off (float32 divisors, a least-squares line); snap them to
    # the round values configs hold.
    rounded = round(float(value), digits)
    return rounded if abs(rounded - value) <= 1e-4 * max(1.0, abs(value)) else float(value)


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int, source: str) -> dict[str, Any] | None:
    """The llama3 `rope_scaling` whose frequency divisors are `factors` (llama.cpp's rope_freqs tensor),
    or None when every divisor is 1. Only the ratios of the llama3 constants fix the divisors, so
    low_freq_factor is taken as 1 and the other two follow from a line through the blended ones.
    Raises GGUFImportError when the divisors are not llama3's."""
    f = factors.astype(np.float64)
    if f.shape != (head_dim // 2,):
        raise GGUFImportError(f"{source}: tensor '{ROPE_FREQS}' has shape {list(f.shape)}, expected [{head_dim // 2}]")
    if np.allclose(f, 1.0, rtol=0, atol=1e-7):
        return None
    factor = float(f.max())
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    blended = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    if blended.sum() < 2 or factor <= 1:
        raise GGUFImportError(
            f"{source}: tensor '{ROPE_FREQS}' is not llama3 RoPE scaling this importer can recover "
            f"(it needs at least two blended frequencies)"
        )
    # llama3: 1/f = (1 - s)/factor + s with s = (L/wavelen - low)/(high - low), linear in 1/wavelen.
    smooth = (1 / f[blended] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelen[blended], smooth, 1)
    if slope <= 0 or intercept >= 0:
        raise GGUFImportError(f"{source}: tensor '{ROPE_FREQS}' is not monotonic llama3 RoPE scaling")
    low = 1.0
    high = _snap(low - low / intercept, 3)
    old_len: float | int = _snap(-slope * low / intercept, 0)
    if old_len == int(old_len):
        old_len = int(old_len)  # a token count, an integer in every config
    scaling = {"rope_type": "llama3", "factor": _snap(factor, 3), "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": old_len}
    if not np.allclose(llama3_factors(scaling, theta, head_dim), f, rtol=1e-4, atol=0):
        raise GGUFImportError(f"{source}: tensor '{ROPE_FREQS}' does not match any llama3 RoPE scaling")
    return scaling


def llama3_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs divisors for a llama3 `rope_scaling` (what its converter writes)."""
    factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old_len = float(scaling["original_max_position_embeddings"])
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, blended))


@dataclass(frozen=True)
class _Plan:
    """Everything decided before writing: the config files and where each HF tensor comes from."""

    arch: str
    config: dict[str, Any]
    generation: dict[str, Any]
    tensors: dict[str, str]  # HF name -> GGUF name, in file order
    permute_heads: dict[str, int]  # GGUF name -> heads whose rows llama.cpp interleaved


def _hf_name(name: str) -> str | None:
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    m = _LAYER_NAME.fullmatch(name)
    if m and m.group(2) in LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{LAYER_TENSORS[m.group(2)]}"
    return None


def _expected_shapes(config: dict[str, Any], arch: str) -> dict[str, tuple[int, ...]]:
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d, q, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q * d, h), "self_attn.k_proj.weight": (kv * d, h),
            "self_attn.v_proj.weight": (kv * d, h), "self_attn.o_proj.weight": (h, q * d),
            "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
        }
        if arch == "qwen2" or config.get("attention_bias"):
            layer |= {"self_attn.q_proj.bias": (q * d,), "self_attn.k_proj.bias": (kv * d,),
                      "self_attn.v_proj.bias": (kv * d,)}
        if arch == "llama" and config.get("attention_bias"):
            layer["self_attn.o_proj.bias"] = (h,)
        if config.get("mlp_bias"):
            layer |= {"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,), "mlp.down_proj.bias": (h,)}
        if arch == "qwen3":
            layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        shapes.update({p + k: v for k, v in layer.items()})
    return shapes


def _plan(gguf_file: GGUFFile, meta: _Metadata, dtype: str) -> _Plan:
    """Builds config.json/generation_config.json from the metadata and maps every tensor; raises
    GGUFImportError naming the field or tensor that does not fit."""
    path, tensors = gguf_file.path, gguf_file.tensors
    arch = meta.get("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise GGUFImportError(
            f"{path}: metadata field 'general.architecture' is {arch!r}: unsupported architecture "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )

    def need(name: str) -> GGUFTensorEntry:
        if name not in tensors:
            raise GGUFImportError(f"{path}: tensor '{name}' is missing")
        return tensors[name]

    hidden = meta.get(f"{arch}.embedding_length", int)
    heads = meta.get(f"{arch}.attention.head_count", int)
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", int, heads)
    layers = meta.get(f"{arch}.block_count", int)
    if min(hidden, heads, kv_heads, layers) <= 0:
        raise GGUFImportError(f"{path}: metadata fields '{arch}.embedding_length/block_count/attention.head_count*' "
                              "must be positive")
    q_rows = need("blk.0.attn_q.weight").shape[0]
    head_dim = meta.get(f"{arch}.attention.key_length", int, q_rows // heads)
    if head_dim * heads != q_rows:
        raise GGUFImportError(f"{path}: tensor 'blk.0.attn_q.weight' has {q_rows} rows, but metadata says "
                              f"{heads} heads of {head_dim} ('{arch}.attention.key_length')")
    rotary = meta.get(f"{arch}.rope.dimension_count", int, head_dim)
    if rotary != head_dim:
        raise GGUFImportError(f"{path}: metadata field '{arch}.rope.dimension_count' is {rotary}, but heads have "
                              f"{head_dim} dimensions: partial rotary embeddings are not supported")
    value_dim = meta.get(f"{arch}.attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise GGUFImportError(f"{path}: metadata field '{arch}.attention.value_length' ({value_dim}) differs from "
                              f"the key length ({head_dim}), which is not supported")
    theta = _tidy_float(meta.get(f"{arch}.rope.freq_base", float, 10000.0))
    rope_scaling: dict[str, Any] | None = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type", str, "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _tidy_float(meta.get(f"{arch}.rope.scaling.factor", float))}
    elif scaling_type != "none":
        raise GGUFImportError(f"{path}: metadata field '{arch}.rope.scaling.type' is {scaling_type!r}; "
                              "supported: none, linear (and llama3 through the rope_freqs tensor)")
    if ROPE_FREQS in tensors:
        if rope_scaling is not None:
            raise GGUFImportError(f"{path}: tensor '{ROPE_FREQS}' and field '{arch}.rope.scaling.type' both scale RoPE")
        factors = gguf_file.values(ROPE_FREQS)
        rope_scaling = llama3_rope_scaling(factors.reshape(-1), theta, head_dim, str(path))

    vocab = need("token_embd.weight").shape[0]
    tokens = meta.count("tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFImportError(f"{path}: missing metadata field 'tokenizer.ggml.tokens' (the vocabulary)")
    if tokens > vocab:
        raise GGUFImportError(f"{path}: metadata field 'tokenizer.ggml.tokens' lists {tokens} tokens, but tensor "
                              f"'token_embd.weight' has only {vocab} rows")
    bos = meta.get("tokenizer.ggml.bos_token_id", int, None)
    eos = meta.get("tokenizer.ggml.eos_token_id", int, None)
    pad = meta.get("tokenizer.ggml.padding_token_id", int, None)
    # llama.cpp also stops on the end-of-turn / end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>).
    stops = sorted({t for t in (eos, meta.get("tokenizer.ggml.eot_token_id", int, None),
                                meta.get("tokenizer.ggml.eom_token_id", int, None)) if t is not None})
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.get(f"{arch}.feed_forward_length", int),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _tidy_float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", float)),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": meta.get(f"{arch}.context_length", int),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors if arch != "qwen2" else True,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": dtype,
        "use_cache": True,
    }
    if arch in ("qwen2", "qwen3"):
        # llama.cpp applies no sliding window to these architectures, and the file records none.
        config |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers}
    if arch == "qwen3":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    generation: dict[str, Any] = {"bos_token_id": bos, "eos_token_id": stops[0] if len(stops) == 1 else stops or None,
                                  "pad_token_id": pad}
    generation = {k: v for k, v in generation.items() if v is not None}

    expected = _expected_shapes(config, arch)
    mapping: dict[str, str] = {}
    for name, entry in tensors.items():
        if name == ROPE_FREQS:
            continue
        hf = _hf_name(name)
        if hf is None or hf not in expected:
            raise GGUFImportError(f"{path}: tensor '{name}' has no place in a {arch} model with this metadata "
                                  f"({layers} layers)")
        if entry.shape != expected[hf]:
            raise GGUFImportError(f"{path}: tensor '{name}' has shape {list(entry.shape)}, but the metadata "
                                  f"implies {list(expected[hf])}")
        mapping[hf] = name
    for hf in expected:
        if hf not in mapping:
            gguf_name = next((g for g, h in GLOBAL_TENSORS.items() if h == hf), None)
            if gguf_name is None:
                layer, rest = hf.removeprefix("model.layers.").split(".", 1)
                gguf_name = "blk." + layer + "." + next(g for g, h in LAYER_TENSORS.items() if h == rest)
            raise GGUFImportError(f"{path}: tensor '{gguf_name}' is missing")
    permute: dict[str, int] = {}
    if arch == "llama":  # llama.cpp's LlamaModel.permute; qwen2/qwen3 keep the Hugging Face row order
        for i in range(layers):
            permute |= {f"blk.{i}.attn_q.weight": heads, f"blk.{i}.attn_k.weight": kv_heads}
            permute |= {f"blk.{i}.attn_q.bias": heads, f"blk.{i}.attn_k.bias": kv_heads}
    try:  # the engine must be able to serve what is written
        parse_model_config(config, generation, path.with_suffix(".config.json"))
    except ModelLoadError as e:
        raise GGUFImportError(f"{path}: the rebuilt config is not servable: {e}") from e
    return _Plan(arch, config, generation, mapping, permute)


# -- tensors -------------------------------------------------------------------------------------------


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's `permute` of a Q or K projection (weight or bias): within each head it stores
    the rotary pairs interleaved (row 2j is HF row j, row 2j+1 is HF row j + D/2)."""
    rows, rest = weight.shape[0], weight.shape[1:]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _shards(plan: _Plan, gguf_file: GGUFFile, itemsize: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for hf, name in plan.tensors.items():
        nbytes = math.prod(gguf_file.tensors[name].shape) * itemsize
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(hf)
        size += nbytes
    return shards


def _write_weights(plan: _Plan, gguf_file: GGUFFile, out: Path, dtype: torch.dtype,
                   progress: ImportProgress) -> None:
    shards = _shards(plan, gguf_file, torch.finfo(dtype).bits // 8)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total, done = len(plan.tensors), 0
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for shard, file_name in zip(shards, names, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for hf in shard:
            name = plan.tensors[hf]
            t = torch.from_numpy(gguf_file.values(name))
            if name in plan.permute_heads:
                t = unpermute_rows(t, plan.permute_heads[name])
            tensors[hf] = t.to(dtype).contiguous()
            weight_map[hf] = file_name
            total_bytes += tensors[hf].numel() * tensors[hf].element_size()
            done += 1
            progress.tensors(done, total)
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)


# -- tokenizer -----------------------------------------------------------------------------------------


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    # The GGUF tokenizer conversion logs a line per step at INFO/WARNING; the importer reports its own.
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _write_tokenizer(gguf_path: Path, meta: _Metadata, config: dict[str, Any], out: Path) -> None:
    """tokenizer.json through transformers' GGUF tokenizer conversion; tokenizer_config.json and
    chat_template.jinja with the file's chat template and BOS/EOS flags."""
    kind = meta.get("tokenizer.ggml.model", str, None)
    try:
        from transformers import AutoTokenizer

        with _quiet_transformers():
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            tok.save_pretrained(str(out))
    except Exception as e:  # transformers raises several types for tokenizers it cannot convert
        raise GGUFImportError(f"{gguf_path}: cannot build a tokenizer for metadata field 'tokenizer.ggml.model' = "
                              f"{kind!r} ({type(e).__name__}: {e})") from e
    for leftover in ("special_tokens_map.json", "added_tokens.json", "chat_template.json"):
        with suppress(FileNotFoundError):
            (out / leftover).unlink()
    cfg_path = out / "tokenizer_config.json"
    saved = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    keep = ("added_tokens_decoder", "bos_token", "eos_token", "unk_token", "pad_token", "clean_up_tokenization_spaces")
    tok_cfg: dict[str, Any] = {k: saved[k] for k in keep if saved.get(k) is not None}
    tok_cfg |= {"model_max_length": config["max_position_embeddings"], "tokenizer_class": "PreTrainedTokenizerFast"}
    for flag in ("add_bos_token", "add_eos_token"):
        value = meta.get(f"tokenizer.ggml.{flag}", bool, None)
        if value is not None:
            tok_cfg[flag] = value
    template = meta.get("tokenizer.chat_template", str, None)
    with suppress(FileNotFoundError):
        (out / "chat_template.jinja").unlink()
    if template is not None:
        tok_cfg["chat_template"] = template
        # transformers 5 (and the engine) read chat_template.jinja first; older ones tokenizer_config.json.
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    _write_json(cfg_path, tok_cfg)


# -- entry point ---------------------------------------------------------------------------------------


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32",
                progress: ImportProgress | None = None) -> Path:
    """Writes the Hugging Face directory `out_dir` (which must not exist, or be empty) from `gguf_path`,
    with weights in `dtype` ("float32" | "bfloat16"), and returns it. The file is checked completely
    before anything is written; the directory is built beside `out_dir` and renamed into place, so it
    either appears complete or not at all. Raises GGUFImportError (see `scan_gguf`, and: unsupported
    architecture, missing or misshapen tensors, metadata the engine cannot serve, no tokenizer)."""
    src, out = Path(gguf_path), Path(out_dir)
    report = progress or _Silent()
    if dtype not in OUTPUT_DTYPES:
        raise GGUFImportError(f"dtype must be one of {', '.join(OUTPUT_DTYPES)}, got {dtype!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: already exists and is not an empty directory")
    started = time.perf_counter()
    report.stage(f"reading {src.name}")
    gguf_file = scan_gguf(src)
    plan = _plan(gguf_file, _Metadata(gguf_file), dtype)
    types = sorted({gguf_file.tensors[n].type_name for n in plan.tensors.values()})
    report.stage(f"{plan.config['architectures'][0]}: {plan.config['num_hidden_layers']} layers, "
                 f"{len(plan.tensors)} tensors ({', '.join(types)}) -> {dtype}")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        report.stage("dequantizing the weights")
        _write_weights(plan, gguf_file, tmp, OUTPUT_DTYPES[dtype], report)
        report.stage("converting the tokenizer")
        _write_tokenizer(src, _Metadata(gguf_file), plan.config, tmp)
        _write_json(tmp / "config.json", plan.config)
        _write_json(tmp / "generation_config.json", plan.generation)
        for file in tmp.iterdir():
            file.chmod(0o644)  # safetensors creates its files owner-only
        tmp.chmod(0o755)
        os.rename(tmp, out)  # atomic; replaces `out` only when it is an empty directory
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    report.stage(f"wrote {out} in {time.perf_counter() - started:.1f}s")
    return out
