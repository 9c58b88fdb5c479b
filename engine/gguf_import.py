"""Imports a GGUF checkpoint (llama.cpp's single-file format) as a Hugging Face model directory.

`import_gguf(FILE.gguf, DIR)` writes what the engine (and transformers) load: config.json rebuilt from
the GGUF metadata, model.safetensors (sharded past MAX_SHARD_BYTES) with every tensor dequantized by
the `gguf` package (`gguf.quants.dequantize`) to plain float32 or bfloat16, tokenizer.json through
transformers' GGUF tokenizer conversion (so the ids equal `AutoTokenizer.from_pretrained(...,
gguf_file=...)`), tokenizer_config.json and chat_template.jinja with the file's chat template, and
generation_config.json with its EOS ids.

The steps live in sibling modules: `engine.gguf_scan` reads and checks the file (`scan_gguf`),
`engine.gguf_config` rebuilds the config files from the metadata (llama3 RoPE recovery included),
`engine.gguf_plan` maps every tensor (and which llama Q/K rows to un-interleave). This module writes
the directory and re-exports their public names. A bad file fails with a GGUFImportError naming the
file and the field or tensor, before anything is written. The directory appears atomically: it is built
beside DIR and renamed into place at the end.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from pdserve.engine.gguf_config import (
    ARCHITECTURES,
    ROPE_FREQS,
    GGUFMetadata,
    llama3_factors,
    llama3_rope_scaling,
)
from pdserve.engine.gguf_plan import Plan, make_plan, unpermute_rows
from pdserve.engine.gguf_scan import SUPPORTED_TYPES, GGUFFile, GGUFImportError, GGUFTensorEntry, scan_gguf
from pdserve.engine.model_config import GGUF_WEIGHTS

__all__ = [
    "ARCHITECTURES", "MAX_SHARD_BYTES", "OUTPUT_DTYPES", "ROPE_FREQS", "SUPPORTED_TYPES", "GGUFFile",
    "GGUFImportError", "GGUFTensorEntry", "ImportProgress", "StderrProgress", "import_gguf", "llama3_factors",
    "llama3_rope_scaling", "scan_gguf", "unpermute_rows",
]

OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# safetensors.save_file holds a second copy of a shard while it writes, so shards stay modest.
MAX_SHARD_BYTES = 2 * 1024**3


class ImportProgress(Protocol):
    """Receives progress reports from `import_gguf`."""

    def stage(self, text: str) -> None: ...

    def tensors(self, done: int, total: int) -> None: ...


class StderrProgress:
    """A line per stage on stderr, and a tensor progress bar when stderr is a terminal."""

    def __init__(self, prefix: str = "pdserve") -> None:
        self.prefix = prefix
        self._bar: Any = None
        self._task: Any = None

    def stage(self, text: str) -> None:
        self._close_bar()
        print(f"[{self.prefix}] {text}", file=sys.stderr, flush=True)

    def tensors(self, done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self._bar = Progress("  tensors", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("tensors", total=total)
        self._bar.update(self._task, completed=done)
        if done >= total:
            self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class _Silent:
    def stage(self, text: str) -> None:
        pass

    def tensors(self, done: int, total: int) -> None:
        pass


# -- tensors -------------------------------------------------------------------------------------------


def _shards(plan: Plan, gguf_file: GGUFFile, itemsize: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for hf, name in plan.tensors.items():
        nbytes = math.prod(gguf_file.tensors[name].shape) * itemsize
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(hf)
        size += nbytes
    return shards


def _write_weights(plan: Plan, gguf_file: GGUFFile, out: Path, dtype: torch.dtype,
                   progress: ImportProgress) -> None:
    shards = _shards(plan, gguf_file, torch.finfo(dtype).bits // 8)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total, done = len(plan.tensors), 0
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for shard, file_name in zip(shards, names, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for hf in shard:
            name = plan.tensors[hf]
            t = torch.from_numpy(gguf_file.values(name))
            if name in plan.permute_heads:
                t = unpermute_rows(t, plan.permute_heads[name])
            tensors[hf] = t.to(dtype).contiguous()
            weight_map[hf] = file_name
            total_bytes += tensors[hf].numel() * tensors[hf].element_size()
            done += 1
            progress.tensors(done, total)
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)


def _check_blocks(plan: Plan, gguf_file: GGUFFile) -> None:
    """Every quantized matrix must be servable as blocks (raises GGUFImportError naming the tensor)."""
    from pdserve.kernels.quant_format import QUANT_TYPES, QuantFormatError, QuantWeight

    for name in plan.tensors.values():
        entry = gguf_file.tensors[name]
        if entry.type_name in QUANT_TYPES and len(entry.shape) == 2:
            try:
                QuantWeight.from_raw(name, entry.type_name, (entry.shape[0], entry.shape[1]),
                                     gguf_file.data[entry.offset : entry.offset + entry.nbytes])
            except QuantFormatError as e:
                raise GGUFImportError(f"{gguf_file.path}: {e}") from e


def _place_file(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


# -- tokenizer -----------------------------------------------------------------------------------------


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    # The GGUF tokenizer conversion logs a line per step at INFO/WARNING; the importer reports its own.
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _write_tokenizer(gguf_path: Path, meta: GGUFMetadata, config: dict[str, Any], out: Path) -> None:
    """tokenizer.json through transformers' GGUF tokenizer conversion; tokenizer_config.json and
    chat_template.jinja with the file's chat template and BOS/EOS flags."""
    kind = meta.get("tokenizer.ggml.model", str, None)
    try:
        from transformers import AutoTokenizer

        with _quiet_transformers():
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            tok.save_pretrained(str(out))
    except Exception as e:  # transformers raises several types for tokenizers it cannot convert
        raise GGUFImportError(f"{gguf_path}: cannot build a tokenizer for metadata field 'tokenizer.ggml.model' = "
                              f"{kind!r} ({type(e).__name__}: {e})") from e
    for leftover in ("special_tokens_map.json", "added_tokens.json", "chat_template.json"):
        with suppress(FileNotFoundError):
            (out / leftover).unlink()
    cfg_path = out / "tokenizer_config.json"
    saved = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    keep = ("added_tokens_decoder", "bos_token", "eos_token", "unk_token", "pad_token", "clean_up_tokenization_spaces")
    tok_cfg: dict[str, Any] = {k: saved[k] for k in keep if saved.get(k) is not None}
    tok_cfg |= {"model_max_length": config["max_position_embeddings"], "tokenizer_class": "PreTrainedTokenizerFast"}
    for flag in ("add_bos_token", "add_eos_token"):
        value = meta.get(f"tokenizer.ggml.{flag}", bool, None)
        if value is not None:
            tok_cfg[flag] = value
    template = meta.get("tokenizer.chat_template", str, None)
    with suppress(FileNotFoundError):
        (out / "chat_template.jinja").unlink()
    if template is not None:
        tok_cfg["chat_template"] = template
        # transformers 5 (and the engine) read chat_template.jinja first; older ones tokenizer_config.json.
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    _write_json(cfg_path, tok_cfg)


# -- entry point ---------------------------------------------------------------------------------------


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


WEIGHTS = ("gguf", "float")


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32",
                progress: ImportProgress | None = None, weights: str = "float") -> Path:
    """Writes the Hugging Face directory `out_dir` (which must not exist, or be empty) from `gguf_path`
    and returns it. `weights`: "float" dequantizes every tensor into model.safetensors in `dtype`
    ("float32" | "bfloat16"); "gguf" places the file itself in the directory as model.gguf (a hard link
    when the filesystem allows, else a copy), whose blocks the engine serves as they are
    (engine.gguf_weights; `dtype` is then the activations', float32). The file is checked completely
    before anything is written; the directory is built beside `out_dir` and renamed into place, so it
    either appears complete or not at all. Raises GGUFImportError (see `scan_gguf`, and: unsupported
    architecture, missing or misshapen tensors, metadata the engine cannot serve, no tokenizer)."""
    src, out = Path(gguf_path), Path(out_dir)
    report = progress or _Silent()
    if dtype not in OUTPUT_DTYPES:
        raise GGUFImportError(f"dtype must be one of {', '.join(OUTPUT_DTYPES)}, got {dtype!r}")
    if weights not in WEIGHTS:
        raise GGUFImportError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "gguf":
        dtype = "float32"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: already exists and is not an empty directory")
    started = time.perf_counter()
    report.stage(f"reading {src.name}")
    gguf_file = scan_gguf(src)
    plan = make_plan(gguf_file, GGUFMetadata(gguf_file), dtype)
    types = sorted({gguf_file.tensors[n].type_name for n in plan.tensors.values()})
    report.stage(f"{plan.config['architectures'][0]}: {plan.config['num_hidden_layers']} layers, "
                 f"{len(plan.tensors)} tensors ({', '.join(types)}) -> "
                 f"{'served as they are' if weights == 'gguf' else dtype}")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if weights == "gguf":
            _check_blocks(plan, gguf_file)
            report.stage(f"placing {src.name} as {GGUF_WEIGHTS}")
            _place_file(src, tmp / GGUF_WEIGHTS)
        else:
            report.stage("dequantizing the weights")
            _write_weights(plan, gguf_file, tmp, OUTPUT_DTYPES[dtype], report)
        report.stage("converting the tokenizer")
        _write_tokenizer(src, GGUFMetadata(gguf_file), plan.config, tmp)
        _write_json(tmp / "config.json", plan.config)
        _write_json(tmp / "generation_config.json", plan.generation)
        for file in tmp.iterdir():
            file.chmod(0o644)  # safetensors creates its files owner-only
        tmp.chmod(0o755)
        os.rename(tmp, out)  # atomic; replaces `out` only when it is an empty directory
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    report.stage(f"wrote {out} in {time.perf_counter() - started:.1f}s")
    return out
