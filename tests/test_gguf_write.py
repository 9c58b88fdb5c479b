"""GGUF files pdserve writes (`pdserve model quantize`, the synthetic geometries of `make-tiny --geometry`):
llama.cpp's metadata (hyperparameters, tokenizer, chat template) that reads back to the same model, and
synthetic checkpoints at real shapes that the engine serves.

llama.cpp itself loads these files in bench/llama_compare.py (its build is cached outside the suite)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer

from pdserve.engine import synthetic
from pdserve.engine.config import EngineConfig
from pdserve.engine.gguf_import import import_gguf
from pdserve.engine.gguf_scan import scan_gguf
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_config import GGUF_WEIGHTS, load_model_config
from pdserve.engine.sampling_params import SamplingParams
from testing.cli import run_cli

TEXTS = (
    "Hello, world! It's 2026.",
    "def f(x):\n    return x**2  # café",
    "中文 😀 emoji\n\n  spaces\t tabs",
    "<|im_start|>user\nhi<|im_end|>\n",
)
# A small llama geometry with whole 256-value blocks and a vocabulary past the tokenizer's (padded rows).
SMALL = synthetic.Geometry(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                           intermediate_size=1024, vocab_size=8192, max_position_embeddings=2048, rope_theta=10000.0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_quantized_file_reads_back_as_the_same_model(quantized_dirs: Callable[[str, str], Path], arch: str,
                                                       tmp_path: Path) -> None:
    """import-gguf of the written file alone gives the config the directory serves (every field, the
    stop tokens and llama3 RoPE scaling included), a tokenizer that encodes every text to the same ids,
    and the same chat template."""
    q = quantized_dirs(arch, "Q4_K")
    back = import_gguf(q / GGUF_WEIGHTS, tmp_path / "back", weights="gguf")
    assert load_model_config(back) == load_model_config(q)
    src_tok, back_tok = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (q, back))
    for text in TEXTS:
        assert back_tok.encode(text).ids == src_tok.encode(text).ids, text
    assert (back / "chat_template.jinja").read_text() == (q / "chat_template.jinja").read_text()
    meta = scan_gguf(q / GGUF_WEIGHTS).metadata
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == ("gpt-2" if arch == "llama" else "qwen2")
    assert meta["tokenizer.ggml.add_bos_token"] is (arch == "llama")


def _greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=32, block_size=16))
    engine.add_request("g", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0  # every KV block back in the pool
    return tokens


def test_a_synthetic_geometry_is_served_and_its_padding_never_wins(tmp_path: Path) -> None:
    """The file holds the geometry's shapes in Q4_K with the tokenizer padded by [PAD] tokens; the engine
    serves it with logits finite and greedy tokens inside the tokenizer's vocabulary (the padded rows are
    zero); import-gguf reads it back to the same config."""
    out = synthetic.make_synthetic_model(tmp_path / "small", SMALL, "Q4_K", log=False)
    cfg = load_model_config(out)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.vocab_size) == (512, 2, 2, 8192)
    assert cfg.weight_format == "gguf:F32+Q4_K" or cfg.weight_format == "gguf:Q4_K"
    f = scan_gguf(out / GGUF_WEIGHTS)
    assert {e.type_name for n, e in f.tensors.items() if n.endswith("norm.weight")} == {"F32"}
    assert {e.type_name for n, e in f.tensors.items() if not n.endswith("norm.weight")} == {"Q4_K"}
    used = len(Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab(with_added_tokens=True))
    fields = gguf.GGUFReader(str(out / GGUF_WEIGHTS)).fields
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == 8192 and tokens[used] == f"[PAD{used}]" and tokens[-1] == "[PAD8191]"
    assert set(types[used:]) == {gguf.TokenType.UNUSED} and gguf.TokenType.UNUSED not in types[:used]
    assert load_model_config(import_gguf(out / GGUF_WEIGHTS, tmp_path / "back", weights="gguf")) == cfg
    greedy = _greedy(out, [5, 17, 300, 41, 9, 1200], 12)
    assert len(greedy) == 12 and max(greedy) < used
    assert len(set(greedy)) > 1


def test_synthetic_weights_do_not_depend_on_the_chunking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each tensor is a function of (seed, name) alone: made in other row chunks, the file is the same."""
    g = dataclasses.replace(SMALL, num_layers=1, vocab_size=4608)
    a = synthetic.make_synthetic_model(tmp_path / "a", g, "Q8_0", log=False)
    monkeypatch.setattr(synthetic, "CHUNK_VALUES", 3 * 512)  # 3 rows at a time; Q/K by whole heads
    b = synthetic.make_synthetic_model(tmp_path / "b", g, "Q8_0", log=False)
    assert (a / GGUF_WEIGHTS).read_bytes() == (b / GGUF_WEIGHTS).read_bytes()
    c = synthetic.make_synthetic_model(tmp_path / "c", g, "Q8_0", seed=1, log=False)
    assert (a / GGUF_WEIGHTS).read_bytes() != (c / GGUF_WEIGHTS).read_bytes()


def test_the_geometries_are_the_real_models_sizes() -> None:
    """Parameter counts of the real checkpoints: TinyLlama-1.1B 1,100,048,384; Llama-3-8B 8,030,261,248."""
    assert synthetic.geometry("tinyllama-1.1b").parameters == 1_100_048_384
    assert synthetic.geometry("llama3-8b").parameters == 8_030_261_248
    assert synthetic.geometry("llama3-8b", layers=1).num_layers == 1
    with pytest.raises(ValueError, match="geometry must be one of"):
        synthetic.geometry("gpt-5")


def test_make_tiny_geometry_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pdserve model make-tiny DIR --geometry tinyllama-1.1b --layers 1`: TinyLlama's widths and
    vocabulary; --type without --geometry, or another arch, is refused with a clear error."""
    out = tmp_path / "tl"
    rc, stdout, stderr = run_cli(["model", "make-tiny", str(out), "--geometry", "tinyllama-1.1b", "--layers", "1",
                                  "--type", "Q4_K"], capsys)
    assert rc == 0, stderr
    assert Path(stdout.strip()) == out
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"],
            config["vocab_size"], config["num_hidden_layers"]) == (2048, 5632, 4, 32000, 1)
    assert "wrote" in stderr and "Q4_K" in stderr
    rc, _, stderr = run_cli(["model", "make-tiny", str(tmp_path / "x"), "--type", "Q4_K"], capsys)
    assert rc == 2 and "--type and --layers go with --geometry" in stderr
    rc, _, stderr = run_cli(["model", "make-tiny", str(tmp_path / "y"), "--geometry", "llama3-8b", "--arch", "qwen2"],
                            capsys)
    assert rc == 2 and "is a llama geometry" in stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
