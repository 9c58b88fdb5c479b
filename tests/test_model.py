"""Model loading, the paged forward against the transformers reference, tokenizer/chat template, tiny models.

Tolerances: fp32 logits must lie as close to transformers' float64 logits as transformers' own fp32 logits
do (within FP32_ERROR_FACTOR, see tests/logit_reference.py: no fixed atol, which holds for some weights
only), with the same greedy tokens as transformers fp32; bf16/fp16 logits within 8% of the fp32 logit
range, with the same greedy token at >= 80% of positions.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.loader import CheckpointReader, LoadedModel, load_model
from pdserve.engine.model import CausalLM, RMSNorm, cpu_weight_packing
from pdserve.engine.model_config import ModelLoadError, load_model_config, weight_files
from pdserve.engine.tiny import default_model_dir, make_tiny_model
from pdserve.engine.tokenizer import ChatTemplateError, Tokenizer
from pdserve.kernels import get_kernel_ops
from testing.threads import start_thread
from tests.logit_reference import assert_fp32_close, forward_logits, load_float64_reference

ARCHS = ("llama", "qwen2", "qwen3")
BLOCK_SIZE = 8
NUM_BLOCKS = 64


# ---------------------------------------------------------------------------------------------------
# A hand-built paged batch: shuffled physical blocks, slot mappings and AttentionMetadata per step.


@dataclass
class PagedSeq:
    tokens: list[int]  # every token known so far (prompt + appended)
    blocks: list[int] = field(default_factory=list)  # physical block ids, in order
    computed: int = 0  # tokens whose K/V are in the pool


@dataclass
class BlockPool:
    free: list[int]  # shuffled physical block ids

    @classmethod
    def shuffled(cls, num_blocks: int, seed: int) -> BlockPool:
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        return cls(free=perm.tolist())

    def cover(self, seq: PagedSeq, num_tokens: int) -> None:
        """Gives `seq` enough blocks for num_tokens tokens."""
        while len(seq.blocks) * BLOCK_SIZE < num_tokens:
            seq.blocks.append(self.free.pop())


def _slots(seq: PagedSeq, start: int, end: int) -> list[int]:
    return [seq.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]


def _table(seqs: list[PagedSeq]) -> torch.Tensor:  # [B, MB] int32, padded with 0
    width = max(len(s.blocks) for s in seqs)
    return torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs], dtype=torch.int32)


def run_step(
    model: CausalLM,
    kv: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
    pool: BlockPool,
    decodes: list[PagedSeq],
    prefills: list[tuple[PagedSeq, int]],  # (sequence, number of new tokens in this chunk)
) -> list[torch.Tensor]:  # per sequence (decodes first), logits [n_new, V] float32
    """One forward over decode tokens then prefill chunks, as the runner would pack them."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    spans: list[tuple[PagedSeq, int, int]] = [(s, s.computed, s.computed + 1) for s in decodes]
    spans += [(s, s.computed, s.computed + n) for s, n in prefills]
    for seq, start, end in spans:
        pool.cover(seq, end)
        ids += seq.tokens[start:end]
        pos += list(range(start, end))
        slots += _slots(seq, start, end)
    pre = [s for s, _ in prefills]
    cu = [0]
    for _, n in prefills:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_tokens=len(decodes),
        decode_block_tables=_table(decodes) if decodes else None,
        decode_context_lens=torch.tensor([s.computed + 1 for s in decodes], dtype=torch.int32) if decodes else None,
        prefill_block_tables=_table(pre) if pre else None,
        prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32) if pre else None,
        prefill_context_lens=torch.tensor([s.computed + n for s, n in prefills], dtype=torch.int32) if pre else None,
    )
    hidden = model(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta, kv)
    logits = model.compute_logits(hidden)
    out = []
    offset = 0
    for seq, start, end in spans:
        out.append(logits[offset : offset + end - start])
        offset += end - start
        seq.computed = end
    return out


def new_pool(loaded: LoadedModel, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.zeros(loaded.config.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE), dtype=dtype or loaded.config.dtype)


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:  # [n, V] float32
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


# ---------------------------------------------------------------------------------------------------
# Fixtures


@dataclass
class Pair:
    ours: LoadedModel
    hf: Any
    hf_loading_info: dict[str, Any]
    hf64: Any  # the float64 reference

    def check(self, got: torch.Tensor, tokens: list[int], what: str) -> None:
        """Asserts `got`, our fp32 logits for the last len(got) positions of `tokens`, are within the fp32
        tolerance of the float64 reference and pick transformers' fp32 greedy tokens."""
        n = len(got)
        hf32, ref64 = hf_logits(self.hf, tokens)[-n:], forward_logits(self.hf64, tokens)[-n:]
        assert_fp32_close(got, hf32, ref64, what)
        assert torch.equal(got.argmax(-1), hf32.argmax(-1)), what


@pytest.fixture(scope="module")
def pairs(tiny_model_dir: Callable[[str], Path]) -> dict[str, Pair]:
    out = {}
    for arch in ARCHS:
        path = tiny_model_dir(arch)
        hf, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        out[arch] = Pair(ours=load_model(path), hf=hf.eval(), hf_loading_info=info,
                         hf64=load_float64_reference(path))
    return out


def _link_dir(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    """A copy of a model dir whose big files are symlinks, so tests can edit the small ones."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).symlink_to(f)
    return dst


def _edit_config(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    _link_dir(src, dst, skip=("config.json",))
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ---------------------------------------------------------------------------------------------------
# (a)-(c): paged forward against the transformers reference


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_prefill_matches_hf(pairs: dict[str, Pair], arch: str) -> None:
    pair = pairs[arch]
    assert not pair.hf_loading_info["missing_keys"] and not pair.hf_loading_info["unexpected_keys"]
    prompts = random_prompts([5, 17, 33], pair.ours.config.vocab_size, seed=1)
    seqs = [PagedSeq(p) for p in prompts]
    kv = new_pool(pair.ours)
    got = run_step(pair.ours.model, kv, BlockPool.shuffled(NUM_BLOCKS, 0), [], [(s, len(s.tokens)) for s in seqs])
    for prompt, logits in zip(prompts, got, strict=True):
        pair.check(logits, prompt, f"{arch} prefill of {len(prompt)}")


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_steps_read_the_cache(pairs: dict[str, Pair], arch: str) -> None:
    pair = pairs[arch]
    model = pair.ours.model
    prompts = random_prompts([7, 12, 20, 9], pair.ours.config.vocab_size, seed=2)
    seqs = [PagedSeq(p) for p in prompts]
    kv = new_pool(pair.ours)
    pool = BlockPool.shuffled(NUM_BLOCKS, 1)
    # Three sequences prefill first; the fourth joins mid-way, so one step mixes decodes and a prefill.
    first = run_step(model, kv, pool, [], [(s, len(s.tokens)) for s in seqs[:3]])
    step_logits: list[list[torch.Tensor]] = [[lg[-1]] for lg in first]
    for step in range(4):
        for s, lg in zip(seqs[:3], step_logits, strict=True):
            s.tokens.append(int(lg[-1].argmax()))
        prefills = [(seqs[3], len(seqs[3].tokens))] if step == 1 else []
        out = run_step(model, kv, pool, seqs[:3], prefills)
        for lg_list, lg in zip(step_logits, out[:3], strict=True):
            lg_list.append(lg[0])
        if step == 1:
            pair.check(out[3], prompts[3], f"{arch} prefill joining decodes")
    for s, lg_list in zip(seqs[:3], step_logits, strict=True):
        # teacher-forced over prompt + our greedy tokens; the last logits pick no token yet
        pair.check(torch.stack(lg_list), s.tokens, f"{arch} decode steps")


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_unchunked(pairs: dict[str, Pair], arch: str) -> None:
    pair = pairs[arch]
    model = pair.ours.model
    (prompt,) = random_prompts([40], pair.ours.config.vocab_size, seed=3)
    whole = run_step(model, new_pool(pair.ours), BlockPool.shuffled(NUM_BLOCKS, 2), [], [(PagedSeq(prompt), 40)])[0]
    seq = PagedSeq(prompt)
    kv = new_pool(pair.ours)
    pool = BlockPool.shuffled(NUM_BLOCKS, 3)
    first = run_step(model, kv, pool, [], [(seq, 21)])[0]  # ends mid-block, so chunk 2 shares a block
    second = run_step(model, kv, pool, [], [(seq, 19)])[0]
    chunked = torch.cat([first, second])
    # chunking changes the summation order only: both within fp32 error of the float64 reference
    pair.check(whole, prompt, f"{arch} unchunked prefill")
    pair.check(chunked, prompt, f"{arch} chunked prefill")


def test_rope_table_grows_lazily(pairs: dict[str, Pair], tiny_llama_dir: Path) -> None:
    loaded = pairs["llama"].ours
    small = CausalLM(loaded.config, get_kernel_ops("torch"), rope_table_len=8)
    reader = CheckpointReader(tiny_llama_dir, weight_files(tiny_llama_dir))
    small.load_hf_weights(reader.get)
    reader.close()
    (prompt,) = random_prompts([30], loaded.config.vocab_size, seed=4)
    a = run_step(small, new_pool(loaded), BlockPool.shuffled(NUM_BLOCKS, 0), [], [(PagedSeq(prompt), 30)])[0]
    b = run_step(loaded.model, new_pool(loaded), BlockPool.shuffled(NUM_BLOCKS, 0), [], [(PagedSeq(prompt), 30)])[0]
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------
# (d) reduced-precision loads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_close_to_fp32(pairs: dict[str, Pair], tiny_llama_dir: Path, dtype: torch.dtype) -> None:
    fp32 = pairs["llama"].ours
    half = load_model(tiny_llama_dir, dtype=dtype)
    assert half.config.dtype == dtype and half.model.embed_weight.dtype == dtype
    assert half.config.fingerprint() != fp32.config.fingerprint()
    prompts = random_prompts([9, 26], fp32.config.vocab_size, seed=5)
    got = run_step(half.model, new_pool(half), BlockPool.shuffled(NUM_BLOCKS, 0), [],
                   [(PagedSeq(p), len(p)) for p in prompts])
    ref = run_step(fp32.model, new_pool(fp32), BlockPool.shuffled(NUM_BLOCKS, 0), [],
                   [(PagedSeq(p), len(p)) for p in prompts])
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == torch.float32
        span = float(r.max() - r.min())
        assert float((g - r).abs().max()) < 0.08 * span
        assert float((g.argmax(-1) == r.argmax(-1)).float().mean()) >= 0.8


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: q/k norms
def test_packed_cpu_weights_give_the_same_bits(tiny_model_dir: Callable[[str], Path], arch: str) -> None:
    """bf16 on a CPU with oneDNN: the packed linear weights give exactly F.linear's logits, through a
    ragged prefill and a decode step, and replace the layers' plain weights."""
    if not cpu_weight_packing(torch.bfloat16):
        pytest.skip("no oneDNN bfloat16 packing on this CPU")
    packed = load_model(tiny_model_dir(arch), dtype=torch.bfloat16)
    plain = load_model(tiny_model_dir(arch), dtype=torch.bfloat16, pack_weights=False)
    assert packed.model.lm_head.packed is not None and plain.model.lm_head.packed is None
    assert all(layer.mlp.down.weight.numel() == 0 for layer in packed.model.layers)
    prompts = random_prompts([9, 26, 1], packed.config.vocab_size, seed=7)
    logits = {}
    for name, m in (("packed", packed), ("plain", plain)):
        seqs, pool, blocks = [PagedSeq(list(p)) for p in prompts], new_pool(m), BlockPool.shuffled(NUM_BLOCKS, 0)
        first = run_step(m.model, pool, blocks, [], [(s, len(s.tokens)) for s in seqs])
        for s, lg in zip(seqs, first, strict=True):
            s.tokens.append(int(lg[-1].argmax()))
        logits[name] = [*first, *run_step(m.model, pool, blocks, seqs, [])]
    for a, b in zip(logits["packed"], logits["plain"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gives_the_reference_bits(dtype: torch.dtype) -> None:
    """RMSNorm over the torch ops (one F.rms_norm call) equals the Hugging Face formula bit for bit: float32
    throughout, rounded to the weight dtype before the scale; fp32 weights also against LlamaRMSNorm itself
    (tests/test_kernels_cpu.py compares the CPU extension's version with these)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(5)
    for dim, rows, eps in ((576, 32, 1e-5), (64, 9, 1e-6), (960, 7, 1e-6), (100, 1, 1e-8), (2048, 3, 1e-5)):
        norm = RMSNorm(dim, eps, dtype, get_kernel_ops("torch", "cpu"))
        norm.weight.copy_(torch.randn(dim, generator=gen).to(dtype))
        x = torch.randn(rows, dim, generator=gen) * torch.rand(rows, 1, generator=gen) * 30  # [rows, dim] fp32
        expected = (x * x.pow(2).mean(-1, keepdim=True).add(eps).rsqrt()).to(dtype) * norm.weight
        assert torch.equal(norm(x), expected)
        assert torch.equal(norm.forward_float32(x), x * x.pow(2).mean(-1, keepdim=True).add(eps).rsqrt()
                           * norm.weight.float())
        if dtype == torch.float32:
            hf = LlamaRMSNorm(dim, eps)
            hf.weight.data.copy_(norm.weight)
            assert torch.equal(norm(x), hf(x))


# ---------------------------------------------------------------------------------------------------
# (e) sharded checkpoints, fingerprints


def _write_sharded(src: Path, dst: Path) -> Path:
    _link_dir(src, dst, skip=("model.safetensors",))
    with safe_open(src / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(dst / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return dst


def test_sharded_checkpoint_loads_the_same(pairs: dict[str, Pair], tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    single = pairs["qwen2"].ours
    sharded = load_model(_write_sharded(tiny_qwen2_dir, tmp_path / "sharded"))
    assert sharded.config == single.config
    assert sharded.config.fingerprint() == single.config.fingerprint()  # layout-independent
    for (name, a), (_, b) in zip(single.model.named_parameters(), sharded.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    hf_sharded = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    (prompt,) = random_prompts([11], single.config.vocab_size, seed=6)
    got = run_step(sharded.model, new_pool(sharded), BlockPool.shuffled(NUM_BLOCKS, 0), [], [(PagedSeq(prompt), 11)])
    assert torch.equal(hf_logits(hf_sharded, prompt), hf_logits(pairs["qwen2"].hf, prompt))  # HF reads it alike
    pairs["qwen2"].check(got[0], prompt, "sharded qwen2")


def test_fingerprint_tracks_weights_and_config(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    base = load_model_config(tiny_qwen3_dir)
    assert base.fingerprint() == load_model_config(tiny_qwen3_dir).fingerprint()
    assert len(base.fingerprint()) == 64 and hash(base) == hash(load_model_config(tiny_qwen3_dir))
    changed = _link_dir(tiny_qwen3_dir, tmp_path / "changed", skip=("model.safetensors",))
    with safe_open(tiny_qwen3_dir / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edited = tensors["model.layers.3.mlp.down_proj.weight"].clone()
    edited[100, 200] += 1e-3  # one value, deep inside one tensor
    tensors["model.layers.3.mlp.down_proj.weight"] = edited
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    assert load_model_config(changed).fingerprint() != base.fingerprint()
    eps = _edit_config(tiny_qwen3_dir, tmp_path / "eps", lambda c: c.update(rms_norm_eps=1e-5))
    assert load_model_config(eps).fingerprint() != base.fingerprint()


# ---------------------------------------------------------------------------------------------------
# (f) malformed directories name the file and the field or tensor


def _drop_tensor(src: Path, dst: Path, name: str) -> Path:
    _link_dir(src, dst, skip=("model.safetensors",))
    with safe_open(src / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != name}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_malformed_directories_raise_clear_errors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    def fails(path: Path, *fragments: str) -> None:
        with pytest.raises(ModelLoadError) as info:
            load_model(path)
        for fragment in fragments:
            assert fragment in str(info.value), (fragment, str(info.value))

    fails(_link_dir(tiny_llama_dir, tmp_path / "no_config", skip=("config.json",)), "config.json", "not found")
    fails(_edit_config(tiny_llama_dir, tmp_path / "no_hidden", lambda c: c.pop("hidden_size")),
          "config.json", "'hidden_size'")
    fails(_edit_config(tiny_llama_dir, tmp_path / "gpt2", lambda c: c.update(architectures=["GPT2LMHeadModel"])),
          "config.json", "'architectures'", "GPT2LMHeadModel")
    fails(_edit_config(tiny_llama_dir, tmp_path / "yarn", lambda c: c["rope_scaling"].update(rope_type="yarn")),
          "config.json", "rope_type", "yarn")
    fails(_edit_config(tiny_llama_dir, tmp_path / "heads", lambda c: c.update(num_key_value_heads=4)),
          "config.json", "num_key_value_heads")
    fails(_edit_config(tiny_llama_dir, tmp_path / "inter", lambda c: c.update(intermediate_size=512)),
          "model.safetensors", "model.layers.0.mlp.gate_proj.weight", "shape")
    fails(_drop_tensor(tiny_llama_dir, tmp_path / "no_tensor", "model.layers.2.mlp.down_proj.weight"),
          "model.safetensors", "model.layers.2.mlp.down_proj.weight", "missing")
    sharded = _write_sharded(tiny_llama_dir, tmp_path / "missing_shard")
    (sharded / "model-00002-of-00002.safetensors").unlink()
    fails(sharded, "model.safetensors.index.json", "model-00002-of-00002.safetensors", "missing")
    no_weights = _link_dir(tiny_llama_dir, tmp_path / "no_weights", skip=("model.safetensors",))
    fails(no_weights, "no_weights", "model.safetensors")
    broken = _link_dir(tiny_llama_dir, tmp_path / "bad_json", skip=("config.json",))
    (broken / "config.json").write_text("{not json")
    fails(broken, "config.json", "JSON")


# ---------------------------------------------------------------------------------------------------
# (g) config variants: Mistral, both rope styles


def test_mistral_variant_loads_and_caps_context(tiny_llama_dir: Path, tmp_path: Path) -> None:
    def to_mistral(c: dict[str, Any]) -> None:
        c.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=32)
        c.pop("rope_scaling")

    path = _edit_config(tiny_llama_dir, tmp_path / "mistral", to_mistral)
    loaded = load_model(path)
    assert loaded.config.arch == "MistralForCausalLM"
    assert loaded.config.sliding_window == 32 and loaded.config.max_model_len == 32
    assert loaded.config.rope_scaling is None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MistralForCausalLM"
    (prompt,) = random_prompts([30], loaded.config.vocab_size, seed=7)
    seq = PagedSeq(prompt)
    kv = new_pool(loaded)
    pool = BlockPool.shuffled(NUM_BLOCKS, 0)
    got = run_step(loaded.model, kv, pool, [], [(seq, 30)])[0]
    Pair(loaded, hf, {}, load_float64_reference(path)).check(got, prompt, "mistral")
    seq.tokens += [5, 6, 7]
    run_step(loaded.model, kv, pool, [seq], [])  # position 30
    run_step(loaded.model, kv, pool, [seq], [])  # position 31: the last one inside the window
    with pytest.raises(NotImplementedError, match="sliding window"):
        run_step(loaded.model, kv, pool, [seq], [])
    def no_window_field(c: dict[str, Any]) -> None:
        to_mistral(c)
        del c["sliding_window"]
        c["max_position_embeddings"] = 8192

    absent = _edit_config(tiny_llama_dir, tmp_path / "mistral_default", no_window_field)
    assert load_model_config(absent).sliding_window == 4096  # transformers' default when the field is absent


def test_rope_config_styles_agree(tiny_llama_dir: Path, tmp_path: Path) -> None:
    def to_v5(c: dict[str, Any]) -> None:
        c["rope_parameters"] = {**c.pop("rope_scaling"), "rope_theta": c.pop("rope_theta")}

    old = load_model_config(tiny_llama_dir)
    new = load_model_config(_edit_config(tiny_llama_dir, tmp_path / "v5", to_v5))
    assert old.rope_scaling is not None and old.rope_scaling["rope_type"] == "llama3"
    assert new == old and new.fingerprint() == old.fingerprint()
    legacy_key = _edit_config(tiny_llama_dir, tmp_path / "type_key", lambda c: c["rope_scaling"].update(
        type=c["rope_scaling"].pop("rope_type")))
    assert load_model_config(legacy_key) == old


def test_model_config_fields(pairs: dict[str, Pair]) -> None:
    llama, qwen2, qwen3 = (pairs[a].ours.config for a in ARCHS)
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim, llama.num_layers) == (6, 2, 64, 4)
    assert llama.bos_token_id == 0 and llama.eos_token_ids == (1, 3) and not llama.tie_word_embeddings
    assert qwen2.tie_word_embeddings and qwen2.attention_bias and not qwen2.o_proj_bias
    assert qwen2.model_type == "qwen2" and qwen2.eos_token_ids == (2,)
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.eos_token_ids == (0, 2)
    assert qwen2.kv_cache_shape(10, 16) == (4, 2, 10, 16, 2, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        llama.hidden_size = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="num_attention_heads"):
        dataclasses.replace(llama, num_kv_heads=4)


# ---------------------------------------------------------------------------------------------------
# (h) tokenizer and chat template against transformers

TEXTS = (
    "Hello world",
    "def f(x):\n    return x + 1  # 12345",
    "你好，世界！今天天气很好。",
    "emoji 🚀✨👍🏽 and 😀",
    "  leading spaces\tand tabs\n\n",
    "Café naïve ﬁ résumé",
    "<|im_start|>user\nhi<|im_end|>",
    "",
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "你好 🚀 <b>&'"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "again", "name": None},
]


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_matches_transformers(tiny_model_dir: Callable[[str], Path], arch: str) -> None:
    path = tiny_model_dir(arch)
    ours = Tokenizer(path)
    auto = AutoTokenizer.from_pretrained(path)
    plain = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    assert ours.vocab_size == len(auto) == 4096
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special), (text, special)
            if not special:
                assert ids == plain.encode(text, add_special_tokens=False), text
        ids = ours.encode(text)
        assert ours.decode(ids) == auto.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == auto.decode(ids, skip_special_tokens=False)
        if "<|" not in text:  # byte-level BPE round-trips any text without special tokens
            assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    for gen in (True, False):
        rendered = ours.apply_chat_template(MESSAGES, add_generation_prompt=gen)
        assert rendered == auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
    hf_ids = auto.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.encode_chat(MESSAGES) == list(hf_ids)


def test_tokenizer_special_tokens(tiny_llama_dir: Path, tiny_qwen2_dir: Path, tiny_qwen3_dir: Path) -> None:
    llama, qwen2, qwen3 = Tokenizer(tiny_llama_dir), Tokenizer(tiny_qwen2_dir), Tokenizer(tiny_qwen3_dir)
    bos = llama.token_to_id("<|begin_of_text|>")
    assert llama.bos_token_id == bos and llama.encode("hi")[0] == bos and llama.encode("hi", False)[0] != bos
    chat = llama.encode_chat(MESSAGES)
    assert chat[0] == bos and chat.count(bos) == 1  # the template writes BOS; no second one is added
    im_end, eot = qwen2.token_to_id("<|im_end|>"), qwen2.token_to_id("<|endoftext|>")
    assert qwen2.bos_token_id is None and qwen2.eos_token_ids == frozenset({im_end, eot})
    assert llama.eos_token_ids == frozenset({llama.token_to_id("<|endoftext|>"), llama.token_to_id("<|im_end|>")})
    assert qwen3.eos_token_id == qwen3.token_to_id("<|im_end|>")
    assert {im_end, eot, qwen2.token_to_id("<|im_start|>")} <= qwen2.all_special_ids
    assert qwen2.decode(qwen2.encode("<|im_start|>x<|im_end|>")) == "x"


def test_chat_template_sources_and_errors(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    # The template inside tokenizer_config.json (older layout) renders the same, for us and transformers.
    legacy = _link_dir(tiny_qwen3_dir, tmp_path / "legacy", skip=("chat_template.jinja", "tokenizer_config.json"))
    cfg = json.loads((tiny_qwen3_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (tiny_qwen3_dir / "chat_template.jinja").read_text()
    (legacy / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(legacy).apply_chat_template(MESSAGES) == Tokenizer(tiny_qwen3_dir).apply_chat_template(MESSAGES)
    assert Tokenizer(legacy).apply_chat_template(MESSAGES) == AutoTokenizer.from_pretrained(legacy).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match="Unknown role"):
        Tokenizer(tiny_qwen3_dir).apply_chat_template([{"role": "robot", "content": "x"}])
    # tojson keeps <, >, & and ' as they are, and strftime_now exists, like transformers' environment.
    custom = _link_dir(tiny_qwen3_dir, tmp_path / "custom", skip=("chat_template.jinja",))
    (custom / "chat_template.jinja").write_text(
        "{{ messages | tojson }}{% if strftime_now('%Y') | length == 4 %}!{% endif %}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    )
    ours = Tokenizer(custom).apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert ours == AutoTokenizer.from_pretrained(custom).apply_chat_template(MESSAGES, tokenize=False)
    assert "<b>&'" in ours and ours.endswith("!system")


# ---------------------------------------------------------------------------------------------------
# Tiny models: determinism and the race-safe cache


def test_make_tiny_model_is_deterministic(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", "qwen3", seed=0)
    b = make_tiny_model(tmp_path / "b", "qwen3", seed=0)
    names = sorted(p.name for p in a.iterdir())
    assert names == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = make_tiny_model(tmp_path / "c", "qwen3", seed=1)
    assert (c / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()
    assert (c / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


def test_default_model_dir_survives_a_race(tmp_path: Path) -> None:
    futures = [start_thread(default_model_dir, "qwen2", 3, tmp_path) for _ in range(2)]
    results = [f.result(timeout=120) for f in futures]
    assert results[0] == results[1]
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no temp dirs left behind
    assert load_model_config(results[0]).arch == "Qwen2ForCausalLM"
    shutil.rmtree(results[0])
