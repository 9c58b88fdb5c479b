"""The import plan of a GGUF file: its config files, and which GGUF tensor each Hugging Face tensor comes
from (checked against the shapes the config implies), with the llama Q/K projections whose rows
llama.cpp's converter interleaved for its RoPE layout."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.engine.gguf_config import ROPE_FREQS, GGUFMetadata, hf_configs
from pdserve.engine.gguf_scan import GGUFFile, GGUFImportError
from pdserve.engine.model_config import ModelLoadError, parse_model_config

if TYPE_CHECKING:
    import torch

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
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's `permute` of a Q or K projection (weight or bias): within each head it stores
    the rotary pairs interleaved (row 2j is HF row j, row 2j+1 is HF row j + D/2)."""
    rows, rest = weight.shape[0], weight.shape[1:]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class Plan:
    """Everything decided before writing: the config files and where each HF tensor comes from."""

    arch: str
    config: dict[str, Any]
    generation: dict[str, Any]
    tensors: dict[str, str]  # HF name -> GGUF name, in file order
    permute_heads: dict[str, int]  # GGUF name -> heads whose rows llama.cpp interleaved


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for one with no place in the model, e.g. rope_freqs)."""
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



def make_plan(gguf_file: GGUFFile, meta: GGUFMetadata, dtype: str) -> Plan:
    """Builds config.json/generation_config.json from the metadata and maps every tensor; raises
    GGUFImportError naming the field or tensor that does not fit, or when the engine could not serve
    the rebuilt config."""
    path = gguf_file.path
    arch, config, generation = hf_configs(gguf_file, meta, dtype)
    mapping = _tensor_mapping(gguf_file, config, arch)
    permute = _permuted_rows(arch, config)
    try:  # the engine must be able to serve what is written
        parse_model_config(config, generation, path.with_suffix(".config.json"))
    except ModelLoadError as e:
        raise GGUFImportError(f"{path}: the rebuilt config is not servable: {e}") from e
    return Plan(arch, config, generation, mapping, permute)


def _tensor_mapping(gguf_file: GGUFFile, config: dict[str, Any], arch: str) -> dict[str, str]:
    """HF name -> GGUF name for every tensor but rope_freqs; every tensor must have its expected place and
    shape, and every expected tensor must be there."""
    path, layers = gguf_file.path, config["num_hidden_layers"]
    expected = _expected_shapes(config, arch)
    mapping: dict[str, str] = {}
    for name, entry in gguf_file.tensors.items():
        if name == ROPE_FREQS:
            continue
        hf = hf_tensor_name(name)
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
    return mapping


def _permuted_rows(arch: str, config: dict[str, Any]) -> dict[str, int]:
    """GGUF name -> heads, for the Q/K projections whose rows llama.cpp's converter interleaved."""
    permute: dict[str, int] = {}
    if arch == "llama":  # llama.cpp's LlamaModel.permute; qwen2/qwen3 keep the Hugging Face row order
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        for i in range(config["num_hidden_layers"]):
            permute |= {f"blk.{i}.attn_q.weight": heads, f"blk.{i}.attn_k.weight": kv_heads}
            permute |= {f"blk.{i}.attn_q.bias": heads, f"blk.{i}.attn_k.bias": kv_heads}
    return permute
