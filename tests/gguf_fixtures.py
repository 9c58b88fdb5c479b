"""GGUF files for tests, and the default model as a session fixture.

`write_gguf(model_dir, out, tensor_type)` writes a Hugging Face llama/qwen2/qwen3 directory (the tiny
models) as llama.cpp's converter would: its metadata keys, the byte-level BPE vocabulary with merges,
Q/K rows of llama models permuted for llama.cpp's RoPE, llama3 RoPE scaling as a `rope_freqs.weight`
tensor, 1-D tensors in F32 and 2-D ones quantized with `gguf.quants.quantize`. It is written here from
llama.cpp's convert_hf_to_gguf.py, independently of engine/gguf_import.py, which it tests.

gguf-py cannot quantize to the K types (Q2_K..Q6_K), so `craft_blocks` makes valid random blocks of any
type (random bits, with the fp16 scales set to sane values) to put into a file instead.

Fixtures: `smollm2_dir` (session): the default model, fetched and imported on first use;
`smollm2_gguf`: the verified GGUF beside it. Import them into a test module to use them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

Q = gguf.GGMLQuantizationType
# Offsets of the fp16 scale fields inside one block of each type (ggml-common.h); everything else in a
# block is quantized bits, for which any value is valid.
BLOCK_SCALES: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (n_head is the K/V head count for K)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llamacpp_rope_freqs(config: dict[str, Any]) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    scaling, base = config["rope_scaling"], config["rope_theta"]
    dim = config["head_dim"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def craft_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random valid blocks of `type_name` for a [rows, cols] tensor: uint8 [rows, bytes per row]."""
    qtype = Q[type_name]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block, block_bytes), dtype=np.uint8)
    for offset in BLOCK_SCALES[type_name]:
        scale = rng.uniform(0.002, 0.02, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * block_bytes)


def quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    """What llama.cpp stores for `values` in `type_name` (F32/F16 as floats, the rest as bytes)."""
    if type_name == "F32":
        return values.astype(np.float32)
    if type_name == "F16":
        return values.astype(np.float16)
    return gguf.quants.quantize(values.astype(np.float32), Q[type_name])


def stored_values(values: np.ndarray, type_name: str) -> np.ndarray:
    """The float32 values a reader gets back for `values` stored as `type_name`."""
    return gguf.quants.dequantize(quantize(values, type_name), Q[type_name]).astype(np.float32).reshape(values.shape)


def _vocab(model_dir: Path) -> tuple[list[str], list[int], list[str]]:
    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    for t in tok["added_tokens"]:
        vocab.setdefault(t["content"], t["id"])
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    types = [3 if t in special else 1 for t in tokens]  # 3 = CONTROL, 1 = NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return tokens, types, merges


def write_gguf(
    model_dir: Path, out: Path, tensor_type: str = "F32", *,
    override: Callable[[str, np.ndarray], tuple[np.ndarray, str] | None] | None = None,
    drop: frozenset[str] = frozenset(),
) -> dict[str, np.ndarray]:
    """Writes `model_dir` as the GGUF `out`; 2-D weights in `tensor_type`. `override(hf_name, values)` may
    return (stored array, type name) to store a tensor differently (e.g. crafted K-type blocks); tensors
    named in `drop` are left out. Returns, by Hugging Face name, the float32 values a correct importer
    must produce."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    generation = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    arch = GGUF_ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta") or rope.get("rope_theta") or 10000.0

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(model_dir.name)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // heads or arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(config["vocab_size"])

    tokens, types, merges = _vocab(model_dir)
    ids = {t: i for i, t in enumerate(tokens)}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    # llama.cpp's EOS is the tokenizer's; a second stop id of generation_config.json goes in as EOT.
    stops = generation.get("eos_token_id", config.get("eos_token_id"))
    stops = stops if isinstance(stops, list) else [stops]
    eos = ids[tok_cfg["eos_token"]] if tok_cfg.get("eos_token") else stops[0]
    w.add_eos_token_id(eos)
    if [t for t in stops if t != eos]:
        w.add_eot_token_id(next(t for t in stops if t != eos))
    if tok_cfg.get("bos_token"):
        w.add_bos_token_id(ids[tok_cfg["bos_token"]])
        w.add_add_bos_token(True)
    else:
        w.add_add_bos_token(False)
    if tok_cfg.get("pad_token"):
        w.add_pad_token_id(ids[tok_cfg["pad_token"]])
    template = model_dir / "chat_template.jinja"
    if template.is_file():
        w.add_chat_template(template.read_text(encoding="utf-8"))

    expected: dict[str, np.ndarray] = {}
    weights = load_file(str(model_dir / "model.safetensors"))
    for hf_name, tensor in weights.items():
        if hf_name in drop:
            continue
        values = tensor.to(torch.float32).numpy()
        name = gguf_tensor_name(hf_name)
        stored = override(hf_name, values) if override else None
        if stored is not None and arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            raise ValueError(f"cannot override {hf_name}: llama Q/K rows would need permuting")
        if stored is not None:
            data, type_name = stored
            expected[hf_name] = gguf.quants.dequantize(data, Q[type_name]).reshape(values.shape).astype(np.float32)
        else:
            type_name = tensor_type if values.ndim == 2 else "F32"
            expected[hf_name] = stored_values(values, type_name)
            data = values
            if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
                data = llamacpp_permute(values, heads if "attn_q" in name else kv_heads)
            data = quantize(data, type_name)
        raw_dtype = None if type_name in ("F32", "F16") else Q[type_name]
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    if arch == "llama" and (config.get("rope_scaling") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llamacpp_rope_freqs({**config, "head_dim": head_dim}))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model's directory (SmolLM2-135M-Instruct imported from its GGUF), fetched on first use."""
    from pdserve.engine.default_model import fetch_default_model
    from pdserve.engine.gguf_import import StderrProgress

    return fetch_default_model(progress=StderrProgress("smollm2 fixture"))


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir: Path) -> Path:
    """The verified GGUF the default model was imported from (kept in the model cache)."""
    from pdserve.engine.default_model import GGUF_MEMBER

    path = smollm2_dir.parent / Path(GGUF_MEMBER).name
    assert path.is_file(), f"{path} should sit beside {smollm2_dir}"
    return path
