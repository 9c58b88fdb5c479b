"""GGUF metadata -> the Hugging Face config.json and generation_config.json.

Architectures: llama, qwen2, qwen3. llama.cpp stores llama3 RoPE scaling as a `rope_freqs.weight` tensor
of per-frequency divisors; `llama3_rope_scaling` recovers the `rope_scaling` constants from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.engine.gguf_scan import GGUFFile, GGUFImportError, GGUFTensorEntry

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE scaling, folded into config.json's rope_scaling


class GGUFMetadata:
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
class _Dimensions:
    hidden: int
    heads: int
    kv_heads: int
    layers: int
    head_dim: int


def hf_configs(gguf_file: GGUFFile, meta: GGUFMetadata, dtype: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(architecture, config.json, generation_config.json) from the metadata (and the shapes of the
    embedding and first Q projection, and the rope_freqs tensor); raises GGUFImportError naming the
    field or tensor that does not fit."""
    arch = _architecture(meta)
    dims = _dimensions(gguf_file, meta, arch)
    theta, rope_scaling = _rope(gguf_file, meta, arch, dims.head_dim)
    vocab = _vocabulary(gguf_file, meta)
    bos = meta.get("tokenizer.ggml.bos_token_id", int, None)
    eos = meta.get("tokenizer.ggml.eos_token_id", int, None)
    pad = meta.get("tokenizer.ggml.padding_token_id", int, None)
    # llama.cpp also stops on the end-of-turn / end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>).
    stops = sorted({t for t in (eos, meta.get("tokenizer.ggml.eot_token_id", int, None),
                                meta.get("tokenizer.ggml.eom_token_id", int, None)) if t is not None})
    config = _config(gguf_file, meta, arch, dims, vocab, dtype) | {
        "rope_theta": theta, "rope_scaling": rope_scaling, "bos_token_id": bos, "eos_token_id": eos,
        "pad_token_id": pad,
    }
    generation: dict[str, Any] = {"bos_token_id": bos, "eos_token_id": stops[0] if len(stops) == 1 else stops or None,
                                  "pad_token_id": pad}
    return arch, config, {k: v for k, v in generation.items() if v is not None}


def _architecture(meta: GGUFMetadata) -> str:
    arch = meta.get("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise GGUFImportError(
            f"{meta.path}: metadata field 'general.architecture' is {arch!r}: unsupported architecture "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def _need(gguf_file: GGUFFile, name: str) -> GGUFTensorEntry:
    if name not in gguf_file.tensors:
        raise GGUFImportError(f"{gguf_file.path}: tensor '{name}' is missing")
    return gguf_file.tensors[name]


def _dimensions(gguf_file: GGUFFile, meta: GGUFMetadata, arch: str) -> _Dimensions:
    """Width, heads, layers and head size; the head size checked against the first Q projection."""
    path = gguf_file.path
    hidden = meta.get(f"{arch}.embedding_length", int)
    heads = meta.get(f"{arch}.attention.head_count", int)
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", int, heads)
    layers = meta.get(f"{arch}.block_count", int)
    if min(hidden, heads, kv_heads, layers) <= 0:
        raise GGUFImportError(f"{path}: metadata fields '{arch}.embedding_length/block_count/attention.head_count*' "
                              "must be positive")
    q_rows = _need(gguf_file, "blk.0.attn_q.weight").shape[0]
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
    return _Dimensions(hidden, heads, kv_heads, layers, head_dim)


def _rope(gguf_file: GGUFFile, meta: GGUFMetadata, arch: str, head_dim: int) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and rope_scaling: none, linear (from the metadata) or llama3 (from the rope_freqs tensor)."""
    path = gguf_file.path
    theta = _tidy_float(meta.get(f"{arch}.rope.freq_base", float, 10000.0))
    rope_scaling: dict[str, Any] | None = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type", str, "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _tidy_float(meta.get(f"{arch}.rope.scaling.factor", float))}
    elif scaling_type != "none":
        raise GGUFImportError(f"{path}: metadata field '{arch}.rope.scaling.type' is {scaling_type!r}; "
                              "supported: none, linear (and llama3 through the rope_freqs tensor)")
    if ROPE_FREQS in gguf_file.tensors:
        if rope_scaling is not None:
            raise GGUFImportError(f"{path}: tensor '{ROPE_FREQS}' and field '{arch}.rope.scaling.type' both scale RoPE")
        factors = gguf_file.values(ROPE_FREQS)
        rope_scaling = llama3_rope_scaling(factors.reshape(-1), theta, head_dim, str(path))
    return theta, rope_scaling


def _vocabulary(gguf_file: GGUFFile, meta: GGUFMetadata) -> int:
    """The embedding's rows, which must hold every token of the vocabulary."""
    path = gguf_file.path
    vocab = _need(gguf_file, "token_embd.weight").shape[0]
    tokens = meta.count("tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFImportError(f"{path}: missing metadata field 'tokenizer.ggml.tokens' (the vocabulary)")
    if tokens > vocab:
        raise GGUFImportError(f"{path}: metadata field 'tokenizer.ggml.tokens' lists {tokens} tokens, but tensor "
                              f"'token_embd.weight' has only {vocab} rows")
    return vocab


def _config(gguf_file: GGUFFile, meta: GGUFMetadata, arch: str, dims: _Dimensions, vocab: int,
            dtype: str) -> dict[str, Any]:
    """config.json but for RoPE and the special token ids."""
    tensors = gguf_file.tensors
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": dims.hidden,
        "intermediate_size": meta.get(f"{arch}.feed_forward_length", int),
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _tidy_float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", float)),
        "max_position_embeddings": meta.get(f"{arch}.context_length", int),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors if arch != "qwen2" else True,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "dtype": dtype,
        "use_cache": True,
    }
    if arch in ("qwen2", "qwen3"):
        # llama.cpp applies no sliding window to these architectures, and the file records none.
        config |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": dims.layers}
    if arch == "qwen3":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    return config
