"""Writing a GGUF file that both pdserve and llama.cpp load: the model's hyperparameters, its tokenizer and
chat template in llama.cpp's metadata keys, then the tensors one at a time.

`pdserve model quantize` and the synthetic checkpoints (engine.synthetic) write through `GGUFModelWriter`,
so `llama-server -m OUT/model.gguf` serves the very file pdserve serves (bench/llama_compare.py relies on
it) and `pdserve model import-gguf` reads it back to the same config and tokenizer. Tensors are declared
first and their data streamed after the header, so only one tensor's blocks are in memory at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.engine.gguf_config import ROPE_FREQS, llama3_factors
from pdserve.engine.model_config import ModelConfig, ModelLoadError
from pdserve.kernels.quant_format import block_layout

# A tokenizer.json pre-tokenizer -> llama.cpp's `tokenizer.ggml.pre` with the same split.
_GPT2_PRE = "gpt-2"
_QWEN2_PRE = "qwen2"


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the file: its GGUF name, float shape [rows, cols] (or [n]), block type, and a function
    that produces its data (float32 for F32, else the packed blocks as uint8) when its turn comes."""

    name: str
    shape: tuple[int, ...]
    type_name: str  # "F32" or a GGML block type
    data: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        if self.type_name == "F32":
            return 4 * int(np.prod(self.shape))
        values, size = block_layout(self.type_name)
        return int(np.prod(self.shape)) // values * size


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _pre_tokenizer(tok: dict[str, Any], source: Path) -> str:
    """llama.cpp's name of the tokenizer's split regex (it has no normalizer step; NFC is a no-op on the
    texts the chat template and clients produce in practice)."""
    pre = tok.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return _GPT2_PRE
    if kinds == ["Split", "ByteLevel"] and "\\p{L}+" in json.dumps(parts[0].get("pattern", {})):
        return _QWEN2_PRE
    raise ModelLoadError(f"{source}: pre-tokenizer {kinds} has no llama.cpp equivalent that pdserve knows")


def tokenizer_metadata(model_dir: Path, vocab_size: int) -> dict[str, Any]:
    """The `tokenizer.ggml.*` fields of a byte-level BPE tokenizer.json. Ids the tokenizer does not use up
    to `vocab_size` (the embedding's rows) become `[PADn]` tokens of type UNUSED, as llama.cpp's converter
    writes them."""
    import gguf

    source = model_dir / "tokenizer.json"
    tok = _read_json(source)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ModelLoadError(f"{source}: only byte-level BPE tokenizers are written to GGUF")
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    types: dict[int, int] = {i: gguf.TokenType.NORMAL for i in by_id}
    for added in tok.get("added_tokens", []):
        by_id[int(added["id"])] = added["content"]
        types[int(added["id"])] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    if max(by_id) >= vocab_size:
        raise ModelLoadError(f"{source}: token id {max(by_id)} is beyond the model's {vocab_size} embedding rows")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    token_types = [types.get(i, gguf.TokenType.UNUSED) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"pre": _pre_tokenizer(tok, source), "tokens": tokens, "types": token_types, "merges": merges}


def _special_ids(model_dir: Path, cfg: ModelConfig) -> tuple[int | None, int | None, int | None]:
    """(eos, eot, pad). The stop tokens are the served ones (generation_config.json's, else config.json's):
    config.json's EOS when it is one of them, and a second one as llama.cpp's end of turn (the chat
    templates' <|im_end|>); pdserve's import reads both back as the stop tokens."""
    raw = _read_json(model_dir / "config.json")
    stops = list(cfg.eos_token_ids)
    eos = raw.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos not in stops:
        eos = stops[0] if stops else None
    others = [t for t in stops if t != eos]
    pad = raw.get("pad_token_id", _read_json(model_dir / "generation_config.json").get("pad_token_id"))
    return eos, (others[0] if others else None), pad


def _add_bos(model_dir: Path) -> bool:
    """Whether the tokenizer puts BOS in front of every text (its post-processor's template)."""
    post = _read_json(model_dir / "tokenizer.json").get("post_processor") or {}
    return post.get("type") == "TemplateProcessing" and any("SpecialToken" in p for p in post.get("single", [])[:1])


class GGUFModelWriter:
    """Writes `path` for the float model `model_dir` (config.json, tokenizer.json, chat_template.jinja): the
    metadata at once, then `write(tensors)` declares every tensor and streams their data in order."""

    def __init__(self, path: Path, model_dir: Path, cfg: ModelConfig, arch: str, file_type: str,
                 name: str) -> None:
        import gguf

        self.path, self.cfg, self.arch = path, cfg, arch
        self.writer = gguf.GGUFWriter(str(path), arch)
        w = self.writer
        w.add_name(name)
        w.add_file_type(int(getattr(gguf.LlamaFileType, f"MOSTLY_{file_type}", gguf.LlamaFileType.ALL_F32)))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_block_count(cfg.num_layers)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_heads)
        w.add_head_count_kv(cfg.num_kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_vocab_size(cfg.vocab_size)
        scaling = cfg.rope_scaling or {}
        if scaling.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(scaling["factor"]))
        elif scaling and scaling.get("rope_type") != "llama3":  # llama3 scaling goes in as the rope_freqs tensor
            raise ModelLoadError(f"{model_dir}: rope_scaling {scaling.get('rope_type')!r} is not written to GGUF")
        vocab = tokenizer_metadata(model_dir, cfg.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(vocab["pre"])
        w.add_token_list(vocab["tokens"])
        w.add_token_types(vocab["types"])
        w.add_token_merges(vocab["merges"])
        eos, eot, pad = _special_ids(model_dir, cfg)
        if cfg.bos_token_id is not None:
            w.add_bos_token_id(cfg.bos_token_id)
        w.add_add_bos_token(_add_bos(model_dir))
        if eos is not None:
            w.add_eos_token_id(eos)
        if eot is not None:
            w.add_eot_token_id(eot)
        if pad is not None:
            w.add_pad_token_id(pad)
        template = model_dir / "chat_template.jinja"
        chat = template.read_text(encoding="utf-8") if template.is_file() else \
            _read_json(model_dir / "tokenizer_config.json").get("chat_template")
        if isinstance(chat, str):
            w.add_chat_template(chat)

    def rope_tensor(self) -> Iterator[PlannedTensor]:
        """llama3 RoPE scaling as llama.cpp keeps it: the per-frequency divisors, a tensor of its own."""
        scaling = self.cfg.rope_scaling or {}
        if scaling.get("rope_type") == "llama3":
            factors = llama3_factors(scaling, self.cfg.rope_theta, self.cfg.head_dim).astype(np.float32)
            yield PlannedTensor(ROPE_FREQS, factors.shape, "F32", lambda: factors)

    def write(self, tensors: list[PlannedTensor], done: Callable[[PlannedTensor], None] | None = None) -> None:
        """Declares `tensors`, writes the header, then each tensor's data as its function produces it."""
        import gguf

        w = self.writer
        for t in tensors:
            raw = None if t.type_name == "F32" else gguf.GGMLQuantizationType[t.type_name]
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in tensors:
            data = t.data()
            if data.nbytes != t.nbytes:
                raise AssertionError(f"{t.name}: {data.nbytes} bytes produced, {t.nbytes} declared")
            w.write_tensor_data(np.ascontiguousarray(data))
            if done is not None:
                done(t)
        w.close()
