"""The tiny models are the same bytes on every machine: pinned sha256 of the generated corpus and of every
file `make_tiny_model` writes, checked in this process and in processes with other hash seeds, thread
counts and CPU kernels; the tokenizer still learns merges for English, code, CJK and emoji.

A failing pin means the generated files changed. If that is intended (corpus, shapes, noise, layout, or a
tokenizers/safetensors upgrade that serializes differently), bump engine.tiny.FORMAT_VERSION so that
cached directories are rebuilt, and paste the new hashes that the failure prints.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.tiny import ARCHS, FORMAT_VERSION, corpus_texts, make_tiny_model, train_tokenizer

PINNED_FORMAT_VERSION = 2
CORPUS_SHA256 = "35ebb290384b1af1000e184386d1ec4d9262eaab0e6068079d525de7ba9e0d77"
PINS: dict[str, dict[str, str]] = {  # arch -> file -> sha256, at seed 0
    "llama": {
        "chat_template.jinja": "f7fa37ee15aae917548a5fdd7472ad0f40d41a73a8009a0720f84c30c4c766cf",
        "config.json": "10221a15b96a603b3cd37661be87b4cfdf017cf9903b9698014f9384635a345f",
        "generation_config.json": "0d3b37f82c427465c87d7e66adbc540b2e54e367b4fc0ad2800fb207265c21de",
        "model.safetensors": "f5d457494386b8043e240c864b2022369039064a8ef26d413db91e7e86fa3b3c",
        "tokenizer.json": "b6e483429028e5dbdbbbdd24f886d4363e1598507c3e2f98f14c2586e55482d4",
        "tokenizer_config.json": "2b79b46ef4a26b8af56ed09537d564033ba43b79d3c4a03fa1fc00451d431ce8",
    },
    "qwen2": {
        "chat_template.jinja": "74233e018408bb512d557edb874c53fd32709d53380403e085f18d1952bb45a6",
        "config.json": "1c41b1ea783505f1bcf0d13edd4302d8cde031a0c108cc5da64be0fac26b8d71",
        "generation_config.json": "5b326179b109aca701ee58452c03433d8374372c078ec4de9b0d54b0ecdbd31b",
        "model.safetensors": "2aa2a3579d477195250da3eb457736cfe49ac55346bd311dda81692809ccff66",
        "tokenizer.json": "5a8290febd038d7426738784f9bbf324a676b7e2076cc2207ec111ebb33d61e2",
        "tokenizer_config.json": "0327f4e02c9f05efc653c001762780043055533fa27e220f577df6df374228c4",
    },
    "qwen3": {
        "chat_template.jinja": "74233e018408bb512d557edb874c53fd32709d53380403e085f18d1952bb45a6",
        "config.json": "7c8c69401e7df8d3da81dc790d5a3ced2689807205094829be6f48195bd6f64f",
        "generation_config.json": "12a7904997184cf610c9aa54ada5c68ce5114e231156043c1bf9136ee47d7e5a",
        "model.safetensors": "e8ca60e0ce9c767f7c043f31100c089c71a525e9af58915055d39acf72636519",
        "tokenizer.json": "5a8290febd038d7426738784f9bbf324a676b7e2076cc2207ec111ebb33d61e2",
        "tokenizer_config.json": "6d87e456a00f34c8cea968af6e5870d7c2b9863b6c9da34e47467e51efa7e4d8",
    },
}
ROOT = Path(__file__).resolve().parents[1]
# Writes one tiny model and prints {file: sha256}; run in processes set up differently from this one.
HASH_SCRIPT = """
import hashlib, json, sys, tempfile
from pathlib import Path
from pdserve.engine.tiny import make_tiny_model
out = make_tiny_model(Path(tempfile.mkdtemp()) / "m", sys.argv[1], 0)
print(json.dumps({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.iterdir())}))
"""


def file_hashes(model_dir: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(model_dir.iterdir())}


def test_pins_match_the_format_version() -> None:
    assert FORMAT_VERSION == PINNED_FORMAT_VERSION, "new FORMAT_VERSION: regenerate the pins in this file"


def test_corpus_is_pinned() -> None:
    # Pure Python on integers: the same on every CPython 3.11+ (checked: 3.11.2 and 3.11.7).
    digest = hashlib.sha256("\x00".join(corpus_texts()).encode()).hexdigest()
    assert digest == CORPUS_SHA256, f"the generated tokenizer corpus changed: {digest}"


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_files_are_pinned(arch: str, tmp_path: Path) -> None:
    got = file_hashes(make_tiny_model(tmp_path / arch, arch, seed=0))
    assert got == PINS[arch], f"{arch} files changed; new pins:\n{json.dumps(got, indent=4)}"


def test_tokenizer_training_is_deterministic_in_one_process() -> None:
    for arch in ("llama", "qwen2"):  # qwen3 shares qwen2's tokenizer
        first, second = train_tokenizer(arch, 4096).to_str(), train_tokenizer(arch, 4096).to_str()
        assert first == second, arch


@pytest.mark.parametrize(("arch", "env"), [
    ("llama", {"PYTHONHASHSEED": "1", "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
               "ATEN_CPU_CAPABILITY": "default"}),
    ("qwen2", {"PYTHONHASHSEED": "2", "RAYON_NUM_THREADS": "2", "OMP_NUM_THREADS": "2",
               "TOKENIZERS_PARALLELISM": "true"}),
], ids=["llama-serial-nosimd", "qwen2-parallel"])
def test_pins_hold_in_differently_configured_processes(arch: str, env: dict[str, str]) -> None:
    """Other hash seeds, tokenizers (rayon) and torch thread counts, torch's non-SIMD CPU kernels."""
    res = subprocess.run([sys.executable, "-c", HASH_SCRIPT, arch], cwd=ROOT, env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout) == PINS[arch]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_learns_english_code_cjk_and_emoji(arch: str) -> None:
    tok = train_tokenizer(arch, 4096)
    assert tok.get_vocab_size() == 4096  # the corpus is rich enough to fill the vocabulary

    def pieces(text: str) -> list[str]:
        return tok.encode(text, add_special_tokens=False).tokens

    for word in ("The quick brown fox", "Hello world", "Once upon a time", " return", "def main():", "    "):
        assert len(pieces(word)) <= len(word.split()) + 2, (word, pieces(word))  # whole words, not letters
    for text in ("你好", "世界", "数学", "🚀"):
        assert len(pieces(text)) < len(text.encode()), (text, pieces(text))  # merges inside characters
    # ...yet rarer characters stay split across byte tokens, which the streaming tests need
    assert len(pieces("中文")) > len("中文"), pieces("中文")
