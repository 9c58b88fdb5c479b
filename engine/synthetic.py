"""Synthetic checkpoints with the shapes of real models (TinyLlama-1.1B, Llama-3-8B), written straight to
quantized GGUF blocks: the bigger models the benches serve where nothing downloads from a model hub.

The weights are random (`tiny.bell_noise`, a function of seed and tensor name: the same bits on every
machine), scaled by 1/sqrt(fan-in) as the tiny models' are at their width, so activations stay finite
through every layer and logits stay peaked. The tokenizer and chat template are the tiny llama's (4,096
tokens); the embedding and LM head rows past them are zero, as a trained model's unused rows never win the
argmax, and llama.cpp sees them as [PAD] tokens (engine.gguf_write). No float copy is written: each
tensor is made in row chunks on every core, quantized and streamed into model.gguf, so memory stays near
one tensor and the 8B file takes minutes, not a 32 GB float checkpoint.

    pdserve model make-tiny DIR --geometry llama3-8b --type Q4_K
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.gguf_write import GGUFModelWriter, PlannedTensor
from pdserve.engine.model_config import GGUF_WEIGHTS, parse_model_config
from pdserve.engine.quantize import TYPES, gguf_tensor_name, permute_rows, type_for
from pdserve.engine.tiny import TinyShape, bell_noise, default_model_dir

VERSION = 1  # bump whenever the written files change: cached directories are keyed by it
CHUNK_VALUES = 1 << 22  # values made and quantized at once by one thread


@dataclass(frozen=True)
class Geometry:
    """A llama model's sizes, as its config.json gives them."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float

    @property
    def parameters(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h * (2 * q + 2 * kv) + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * layer + 2 * self.vocab_size * h + h


GEOMETRIES = {
    "tinyllama-1.1b": Geometry(2048, 22, 32, 4, 64, 5632, 32000, 2048, 10000.0),
    "llama3-8b": Geometry(4096, 32, 32, 8, 128, 14336, 128256, 8192, 500000.0),
}


def geometry(name: str, layers: int | None = None) -> Geometry:
    """A named geometry, optionally with fewer layers (quick checks of the same widths)."""
    if name not in GEOMETRIES:
        raise ValueError(f"geometry must be one of {', '.join(GEOMETRIES)}, got {name!r}")
    g = GEOMETRIES[name]
    if layers is not None:
        if layers <= 0:
            raise ValueError(f"layers must be positive, got {layers}")
        g = dataclasses.replace(g, num_layers=layers)
    return g


def _config(g: Geometry, tiny: dict) -> dict:
    """The tiny llama's config.json at geometry `g` (plain RoPE, untied LM head, as both models have)."""
    config = {k: v for k, v in tiny.items() if k not in ("rope_scaling",)}
    return config | {
        "hidden_size": g.hidden_size, "num_hidden_layers": g.num_layers, "num_attention_heads": g.num_heads,
        "num_key_value_heads": g.num_kv_heads, "head_dim": g.head_dim, "intermediate_size": g.intermediate_size,
        "vocab_size": g.vocab_size, "max_position_embeddings": g.max_position_embeddings,
        "rope_theta": g.rope_theta, "tie_word_embeddings": False,
    }


class _Matrix:
    """The data of one random matrix [rows, cols]: rows past `used_rows` zero, llama Q/K rows interleaved
    a head at a time (`heads_of` rows each), quantized to `kind` a chunk of rows per thread."""

    def __init__(self, seed: int, hf: str, shape: tuple[int, int], std: float, kind: str, used_rows: int,
                 head_rows: int, pool: ThreadPoolExecutor) -> None:
        self.seed, self.hf, self.shape, self.std, self.kind = seed, hf, shape, std, kind
        self.used_rows, self.head_rows, self.pool = used_rows, head_rows, pool

    def _chunk(self, first: int, last: int) -> np.ndarray:
        from pdserve.kernels.quant_format import quantize

        rows, cols = self.shape
        used = max(0, min(last, self.used_rows) - first)
        if not used and self.kind != "F32":  # zero rows quantize to the same blocks: make one row of them
            zero = quantize(torch.zeros(1, cols), self.kind, name=self.hf).data.numpy()
            return np.tile(zero.reshape(-1), last - first)
        w = np.zeros((last - first, cols), dtype=np.float32)
        if used:
            noise = bell_noise(self.seed, self.hf, used * cols, start=first * cols) * self.std
            w[:used] = noise.astype(np.float32).reshape(used, cols)
        if self.head_rows:
            w = permute_rows(w, (last - first) // self.head_rows)
        if self.kind == "F32":
            return w
        return quantize(torch.from_numpy(np.ascontiguousarray(w)), self.kind, name=self.hf).data.numpy().reshape(-1)

    def __call__(self) -> np.ndarray:
        rows, cols = self.shape
        step = max(1, CHUNK_VALUES // cols)
        if self.head_rows:
            step = max(self.head_rows, step // self.head_rows * self.head_rows)
        starts = range(0, rows, step)
        parts = list(self.pool.map(lambda a: self._chunk(a, min(rows, a + step)), starts))
        return np.concatenate(parts)


def _vector(seed: int, hf: str, n: int, jitter: float) -> np.ndarray:
    return (1.0 + jitter * bell_noise(seed, hf, n)).astype(np.float32)


def make_synthetic_model(out: str | Path, g: Geometry, type_name: str = "Q4_K", seed: int = 0,
                         log: bool = True) -> Path:
    """Writes the quantized model directory OUT (which must not exist, or be empty) at geometry `g`;
    returns OUT. Built beside OUT and renamed into place, so it appears complete or not at all."""
    if type_name not in TYPES:
        raise ValueError(f"--type must be one of {', '.join(TYPES)}, got {type_name!r}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: already exists and is not an empty directory")
    started = time.perf_counter()
    tiny_dir = default_model_dir("llama")
    tiny = json.loads((tiny_dir / "config.json").read_text(encoding="utf-8"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name in ("tokenizer.json", "generation_config.json", "chat_template.jinja"):
            shutil.copyfile(tiny_dir / name, tmp / name)
        tok_cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        tok_cfg["model_max_length"] = g.max_position_embeddings
        config = _config(g, tiny)
        for path, data in ((tmp / "tokenizer_config.json", tok_cfg), (tmp / "config.json", config)):
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        generation = json.loads((tmp / "generation_config.json").read_text(encoding="utf-8"))
        cfg = parse_model_config(config, generation, tmp / "config.json")
        used_vocab = json.loads((tiny_dir / "config.json").read_text(encoding="utf-8"))["vocab_size"]
        writer = GGUFModelWriter(tmp / GGUF_WEIGHTS, tmp, cfg, "llama", type_name,
                                 f"synthetic llama {g.parameters / 1e9:.2f}B")
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            tensors = _plan(g, cfg.head_dim, used_vocab, type_name, seed, pool)
            total = sum(t.nbytes for t in tensors)
            written = 0

            def done(t: PlannedTensor) -> None:
                nonlocal written
                written += t.nbytes
                if log:
                    print(f"\r[pdserve] {out.name}: {written / 2**20:,.0f} of {total / 2**20:,.0f} MiB "
                          f"({time.perf_counter() - started:.0f}s)", end="", file=sys.stderr, flush=True)

            writer.write(tensors, done)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if log:
        print(f"\n[pdserve] wrote {out}: {g.parameters / 1e9:.2f}B parameters, {type_name}, "
              f"{(out / GGUF_WEIGHTS).stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - started:.0f}s",
              file=sys.stderr)
    return out


def _plan(g: Geometry, head_dim: int, used_vocab: int, type_name: str, seed: int,
          pool: ThreadPoolExecutor) -> list[PlannedTensor]:
    """Every tensor in llama.cpp's order, each a lazy generator of its data."""
    tiny = TinyShape()
    h, q, kv, inter = g.hidden_size, g.num_heads * head_dim, g.num_kv_heads * head_dim, g.intermediate_size
    # the tiny model's scales at its width, carried to this one by 1/sqrt(fan-in)
    linear = tiny.linear_std * math.sqrt(tiny.hidden_size)
    head = tiny.lm_head_std * math.sqrt(tiny.hidden_size) / math.sqrt(h)
    tensors: list[PlannedTensor] = []

    def matrix(hf: str, shape: tuple[int, int], std: float, used_rows: int | None = None,
               head_rows: int = 0) -> None:
        kind = type_for(shape, type_name)
        data = _Matrix(seed, hf, shape, std, kind, shape[0] if used_rows is None else used_rows, head_rows, pool)
        tensors.append(PlannedTensor(gguf_tensor_name(hf), shape, kind, data))

    def vector(hf: str) -> None:
        tensors.append(PlannedTensor(gguf_tensor_name(hf), (h,), "F32",
                                     lambda: _vector(seed, hf, h, tiny.norm_jitter)))

    matrix("model.embed_tokens.weight", (g.vocab_size, h), tiny.embed_std, used_rows=used_vocab)
    vector("model.norm.weight")
    matrix("lm_head.weight", (g.vocab_size, h), head, used_rows=used_vocab)
    for i in range(g.num_layers):
        p = f"model.layers.{i}."
        vector(p + "input_layernorm.weight")
        matrix(p + "self_attn.q_proj.weight", (q, h), linear / math.sqrt(h), head_rows=head_dim)
        matrix(p + "self_attn.k_proj.weight", (kv, h), linear / math.sqrt(h), head_rows=head_dim)
        matrix(p + "self_attn.v_proj.weight", (kv, h), linear / math.sqrt(h))
        matrix(p + "self_attn.o_proj.weight", (h, q), linear / math.sqrt(q))
        vector(p + "post_attention_layernorm.weight")
        matrix(p + "mlp.gate_proj.weight", (inter, h), linear / math.sqrt(h))
        matrix(p + "mlp.up_proj.weight", (inter, h), linear / math.sqrt(h))
        matrix(p + "mlp.down_proj.weight", (h, inter), linear / math.sqrt(inter))
    return tensors


def synthetic_model_dir(name: str, type_name: str = "Q4_K", seed: int = 0, layers: int | None = None,
                        cache_dir: str | Path | None = None) -> Path:
    """The cached synthetic model (made on first use) under cache_dir, else $PDSERVE_CACHE_DIR, else
    ~/.cache/pdserve/models."""
    g = geometry(name, layers)
    base = Path(cache_dir or os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve" / "models")
    final = base / f"synthetic-{name}{f'-l{layers}' if layers else ''}-{type_name}-s{seed}-v{VERSION}"
    if (final / GGUF_WEIGHTS).is_file():
        return final
    try:
        return make_synthetic_model(final, g, type_name, seed)
    except FileExistsError:  # another process finished it first
        return final
