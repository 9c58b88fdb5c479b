"""Reads a GGUF file (llama.cpp's single-file format): header, metadata and tensor table, checked.

`scan_gguf` reads the file itself rather than through `gguf.GGUFReader`, which builds numpy views of
every vocabulary string (seconds for a 50k vocabulary) and stops at the first bad byte without saying
which tensor or field it was reading. The scan checks the magic, the version, every length against the
file size, the tensor types and that every tensor lies inside the file, so a bad file fails with a
GGUFImportError naming the file and the field or tensor. Tensor data stays memory-mapped until
`GGUFFile.values` dequantizes one tensor.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # v1 counted with 32-bit integers; nothing current writes it
DEFAULT_ALIGNMENT = 32
# What gguf-py dequantizes with plain numpy and this module supports (the IQ/TQ/FP4 families are not).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
MAX_DIMS = 4
# Weight files up to this size are hashed whole for the weights digest; larger ones are sampled.
FULL_HASH_BYTES = 512 * 1024**2
DIGEST_SAMPLES, DIGEST_SAMPLE_BYTES = 256, 64 * 1024

# Fixed-size GGUF metadata value types -> struct format (8 = string and 9 = array are variable-size).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFImportError(ValueError):
    """A GGUF file that cannot be imported; the message names the file and the field or tensor."""


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
    version = _read_header(cur)
    n_tensors, n_fields = cur.unpack("<QQ", "the tensor and metadata counts")
    metadata, lengths = _read_metadata(cur, n_fields)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFImportError(f"{cur.path}: metadata field 'general.alignment' must be a power of two, got {alignment!r}")
    raw = _read_tensor_table(cur, n_tensors)
    data_start = -(-cur.pos // alignment) * alignment
    tensors = _place_tensors(cur, raw, data_start)
    return GGUFFile(cur.path, version, alignment, metadata, lengths, tensors, cur.buf)


def _read_header(cur: _Cursor) -> int:
    """Checks the magic and returns the version (a supported, little-endian one)."""
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
    return version


def _read_metadata(cur: _Cursor, n_fields: int) -> tuple[dict[str, Any], dict[str, int]]:
    """The metadata fields, and the length of every array field."""
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for i in range(n_fields):
        key = cur.string(f"metadata key #{i}")
        (value_type,) = cur.unpack("<I", f"metadata field '{key}'")
        metadata[key] = cur.value(value_type, key, lengths)
    return metadata, lengths


def _read_tensor_table(cur: _Cursor, n_tensors: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """The tensor table as read: (name, dims fastest-moving first, type id, offset in the data section)."""
    raw = []
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor #{i}")
        (n_dims,) = cur.unpack("<I", f"tensor '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFImportError(f"{cur.path}: tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS} expected)")
        dims = cur.unpack(f"<{n_dims}Q", f"tensor '{name}'")
        type_id, rel_offset = cur.unpack("<IQ", f"tensor '{name}'")
        raw.append((name, dims, type_id, rel_offset))
    return raw


def _place_tensors(cur: _Cursor, raw: list[tuple[str, tuple[int, ...], int, int]],
                   data_start: int) -> dict[str, GGUFTensorEntry]:
    """Checks each tensor's type, row size and extent against the file, and places it."""
    path = cur.path
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
    return tensors


# -- a model directory's GGUF weights (torch-free: the fingerprint is computed without torch) ------------


def open_gguf_weights(path: Path) -> GGUFFile:
    """`scan_gguf` for a directory's weights file: its errors become ModelLoadErrors, as for safetensors."""
    from pdserve.engine.model_config import ModelLoadError

    try:
        return scan_gguf(path)
    except GGUFImportError as e:
        raise ModelLoadError(str(e)) from e


def gguf_weights_digest(path: Path) -> str:
    """Hex digest of the file: whole up to FULL_HASH_BYTES, else its size and DIGEST_SAMPLES evenly spaced
    chunks (cheap for an 8B file; misses edits confined to unsampled bytes)."""
    size = path.stat().st_size
    h = hashlib.sha256(f"gguf:{size};".encode())
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        else:
            for i in range(DIGEST_SAMPLES):
                f.seek(size * i // DIGEST_SAMPLES)
                h.update(f.read(DIGEST_SAMPLE_BYTES))
    return h.hexdigest()


def gguf_weight_format(path: Path) -> str:
    """How the file stores its matrices, e.g. "gguf:Q4_1+Q8_0" (the fingerprint covers it: nodes serving
    other blocks of the same model must not exchange KV)."""
    kinds = {e.type_name for e in open_gguf_weights(path).tensors.values() if len(e.shape) == 2}
    return "gguf:" + ("+".join(sorted(kinds)) or "F32")
