"""Deterministic tiny models in exact Hugging Face format, for tests, benchmarks and the default model.

`make_tiny_model` writes config.json, model.safetensors, generation_config.json and a byte-level BPE
tokenizer trained in well under a second on Python standard-library sources plus a few built-in
multilingual lines (tokenizer.json, tokenizer_config.json, chat_template.jinja: what transformers 5
writes). The same (arch, seed, FORMAT_VERSION, Python stdlib) gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

FORMAT_VERSION = 1  # bump whenever the generated files change: cached directories are keyed by it
ARCHS = ("llama", "qwen2", "qwen3")

# Read in this order; all are pure-Python modules every CPython 3.11+ ships.
CORPUS_MODULES = (
    "argparse.py", "textwrap.py", "difflib.py", "dataclasses.py", "pathlib.py", "statistics.py",
    "calendar.py", "string.py", "functools.py", "heapq.py", "fractions.py", "shlex.py", "fnmatch.py",
    "glob.py", "bisect.py", "json/decoder.py", "json/encoder.py", "html/parser.py", "email/message.py",
    "collections/__init__.py", "random.py", "locale.py", "gettext.py", "csv.py",
)
# Multi-byte text, repeated so that BPE learns merges inside CJK characters and emoji.
MULTILINGUAL_LINES = (
    "你好，世界！今天的天气很好，我们去公园散步吧。",
    "模型在服务器上运行，预填充节点和解码节点分开部署。",
    "東京は日本の首都です。ラーメンが大好きです。",
    "안녕하세요, 만나서 반갑습니다.",
    "Привет, мир! Как дела?",
    "Café, naïve, résumé, façade, jalapeño, Straße.",
    "Emoji: 😀 😂 🚀 ✨ 👍🏽 🎉 ❤️ 🐍 🌍",
    "数学：∑ x² = ∫ f(x) dx ≈ 3.14159 ± 0.001 → ∞",
)
MULTILINGUAL_REPEATS = 8
# Qwen-style pre-tokenization: contractions, letter runs, single digits, punctuation runs, newlines,
# whitespace. Must match the transformers Qwen2 tokenizer, which rebuilds this pipeline when it loads.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "{{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


@dataclass(frozen=True)
class TinyShape:
    """Sizes shared by every tiny architecture (the vocabulary comes from the trained tokenizer)."""

    hidden_size: int = 384
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    vocab_size: int = 4096
    max_position_embeddings: int = 4096
    # Larger than a trained model's init so logits are peaked and greedy outputs vary.
    embed_std: float = 0.5
    linear_std: float = 0.08
    lm_head_std: float = 0.25
    norm_jitter: float = 0.1  # norm weights are 1 + jitter * N(0, 1)
    bias_std: float = 0.1


@dataclass(frozen=True)
class TinyTokens:
    """Special-token ids of a trained tiny tokenizer."""

    bos: int | None
    endoftext: int
    im_start: int
    im_end: int


def _special_tokens(arch: str) -> list[str]:
    base = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return ["<|begin_of_text|>", *base] if arch == "llama" else base


def corpus_texts() -> list[str]:
    """The training texts, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for rel in CORPUS_MODULES:
        path = stdlib / rel
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer corpus file {path} is missing from this Python installation")
        texts.append(path.read_text(encoding="utf-8"))
    texts.extend(list(MULTILINGUAL_LINES) * MULTILINGUAL_REPEATS)
    return texts


def train_tokenizer(arch: str, vocab_size: int) -> Tokenizer:
    """Trains a byte-level BPE tokenizer (any UTF-8 encodes) with the arch's special tokens at ids 0..k-1.
    llama style: GPT-2 byte-level splitting, prepends <|begin_of_text|>. qwen style: NFC, Qwen splitting,
    no BOS."""
    specials = _special_tokens(arch)
    tok = Tokenizer(models.BPE())
    if arch == "llama":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(), trainer)
    if arch == "llama":
        bos = specials[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _token_ids(tok: Tokenizer, arch: str) -> TinyTokens:
    def tid(s: str) -> int:
        i = tok.token_to_id(s)
        if i is None:
            raise RuntimeError(f"special token {s} missing from the trained tokenizer")
        return i

    return TinyTokens(
        bos=tid("<|begin_of_text|>") if arch == "llama" else None,
        endoftext=tid("<|endoftext|>"),
        im_start=tid("<|im_start|>"),
        im_end=tid("<|im_end|>"),
    )


def tiny_config(arch: str, shape: TinyShape, vocab_size: int, ids: TinyTokens) -> dict[str, Any]:
    """config.json contents. llama uses the older rope_theta + rope_scaling style (llama3 scaling);
    qwen2/qwen3 the transformers-5 rope_parameters style."""
    common: dict[str, Any] = {
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "num_attention_heads": shape.num_heads,
        "num_hidden_layers": shape.num_layers,
        "num_key_value_heads": shape.num_kv_heads,
        "dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
        "eos_token_id": ids.endoftext,
    }
    if arch == "llama":
        return {
            **common,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "mlp_bias": False,
            "head_dim": shape.head_dim,
            "bos_token_id": ids.bos,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
            "tie_word_embeddings": False,
        }
    qwen: dict[str, Any] = {
        **common,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape.num_layers,
    }
    if arch == "qwen2":
        return {**qwen, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True}
    return {
        **qwen,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "head_dim": shape.head_dim,
        "tie_word_embeddings": False,
    }


def tiny_weights(arch: str, shape: TinyShape, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 weights under Hugging Face names, drawn in a fixed order from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv, inter, d = (shape.hidden_size, shape.num_heads * shape.head_dim,
                          shape.num_kv_heads * shape.head_dim, shape.intermediate_size, shape.head_dim)

    def normal(std: float, *dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=g, dtype=torch.float32) * std

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + normal(shape.norm_jitter, dim)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(shape.embed_std, vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            w[f"{p}self_attn.{name}.weight"] = normal(shape.linear_std, rows, h)
            if arch == "qwen2":
                w[f"{p}self_attn.{name}.bias"] = normal(shape.bias_std, rows)
        w[p + "self_attn.o_proj.weight"] = normal(shape.linear_std, h, q)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = normal(shape.linear_std, inter, h)
        w[p + "mlp.up_proj.weight"] = normal(shape.linear_std, inter, h)
        w[p + "mlp.down_proj.weight"] = normal(shape.linear_std, h, inter)
    w["model.norm.weight"] = norm(h)
    if arch != "qwen2":  # qwen2 ties lm_head to the embedding, so the checkpoint has no lm_head
        w["lm_head.weight"] = normal(shape.lm_head_std, vocab_size, h)
    return w


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """Writes a deterministic tiny `arch` model into out_dir (created if needed; other files there are
    left alone) and returns its path."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    shape = TinyShape()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(arch, shape.vocab_size)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    ids = _token_ids(tok, arch)

    _write_json(out / "config.json", tiny_config(arch, shape, vocab_size, ids))
    save_file(tiny_weights(arch, shape, vocab_size, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    generation: dict[str, Any] = {
        "llama": {"bos_token_id": ids.bos, "eos_token_id": [ids.endoftext, ids.im_end]},
        "qwen2": {"eos_token_id": ids.im_end, "pad_token_id": ids.endoftext},
        "qwen3": {"eos_token_id": [ids.im_end, ids.endoftext], "pad_token_id": ids.endoftext},
    }[arch]
    _write_json(out / "generation_config.json", generation)

    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for s in _special_tokens(arch)
    }
    tokenizer_config: dict[str, Any] = {
        "added_tokens_decoder": added,
        "backend": "tokenizers",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>" if arch == "qwen3" else "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": shape.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = CHATML_TEMPLATE
    if arch == "llama":
        tokenizer_config["bos_token"] = "<|begin_of_text|>"
        template = "{{- bos_token }}\n" + CHATML_TEMPLATE
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return out


def default_model_dir(arch: str = "llama", seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    """Path of the cached tiny model, creating it on first use under cache_dir, else $PDSERVE_CACHE_DIR,
    else ~/.cache/pdserve/models. Creation writes a temp dir and renames it into place, so processes that
    race all end up with the same complete directory."""
    base = Path(cache_dir or os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve" / "models")
    final = base / f"tiny-{arch}-s{seed}-v{FORMAT_VERSION}"
    if (final / "config.json").is_file():
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=base))
    try:
        make_tiny_model(tmp, arch, seed)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.tiny DIR [--arch A] [--seed N]`: writes a tiny model and prints its path."""
    parser = argparse.ArgumentParser(description="Write a deterministic tiny Hugging Face model directory.")
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_tiny_model(args.out_dir, args.arch, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
