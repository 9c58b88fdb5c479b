"""Loads a Hugging Face model directory as it ships (config.json + safetensors, single or sharded)
into the engine's own `CausalLM`."""

from __future__ import annotations

import dataclasses
import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdserve.engine.dtype import resolve_dtype
from pdserve.engine.model import CausalLM
from pdserve.engine.model_config import (
    GGUF_WEIGHTS,
    SAFETENSORS_INDEX,
    ModelConfig,
    ModelLoadError,
    dtype_name,
    load_model_config,
    weight_files,
)
from pdserve.kernels import KernelOps, get_kernel_ops

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig  # dtype is the dtype the weights are held in
    model: CausalLM
    path: Path


class CheckpointReader:
    """Hands out checkpoint tensors by HF name, checking shapes. Open files stay mapped until `close`."""

    def __init__(self, root: Path, files: dict[str, Path]) -> None:
        self.root = root
        self.files = files
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    def _listing(self) -> Path:
        # Where a missing tensor "should" have been: the index for sharded checkpoints, else the one file.
        index = self.root / SAFETENSORS_INDEX
        return index if index.exists() else next(iter(set(self.files.values())), self.root)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Returns tensor `name` on CPU in its stored dtype. Raises ModelLoadError naming the file and tensor
        when it is missing or its shape differs from `shape`."""
        tensor = self.tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ModelLoadError(
                f"{self.files[name]}: tensor '{name}' has shape {list(tensor.shape)}, but config.json implies "
                f"{list(shape)}"
            )
        return tensor

    def _handle(self, name: str) -> tuple[Path, Any]:
        file = self.files.get(name)
        if file is None:
            raise ModelLoadError(f"{self._listing()}: tensor '{name}' is missing from the checkpoint")
        if file not in self._handles:
            try:
                self._handles[file] = self._stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises its own error types for corrupt files
                raise ModelLoadError(f"{file}: unreadable safetensors file ({e})") from e
        return file, self._handles[file]

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` as stored, whatever its shape (ModelLoadError when missing or unreadable)."""
        file, handle = self._handle(name)
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"{file}: tensor '{name}' is not readable ({e})") from e

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor `name`'s shape from the file's header, its data left unread."""
        file, handle = self._handle(name)
        try:
            return tuple(handle.get_slice(name).get_shape())
        except Exception as e:
            raise ModelLoadError(f"{file}: tensor '{name}' is not readable ({e})") from e

    def close(self) -> None:
        """Unmaps every opened file."""
        self._stack.close()
        self._handles.clear()


def load_model(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    *,
    ops: KernelOps | None = None,
    pack_weights: bool = True,
) -> LoadedModel:
    """Builds the model of a Hugging Face directory with its weights, in `dtype` (default: the config's
    dtype; "auto": see `engine.dtype.resolve_dtype`, logged) on `device`. `ops` defaults to the kernels `get_kernel_ops("auto", device)` picks.
    `pack_weights`: pack the linear weights for oneDNN where `CausalLM.pack_cpu_weights` can (the same
    output bits, faster GEMMs).
    Raises ModelLoadError naming the file and field/tensor for a directory that cannot be served."""
    root = Path(path)
    config = load_model_config(root)
    quantized = bool(config.weight_format)
    if dtype == "auto":
        choice = resolve_dtype("auto", config.dtype_name, str(device), quantized=quantized)
        log.info("dtype %s", choice.reason)
        config = dataclasses.replace(config, dtype_name=choice.name)
    elif dtype is not None:
        config = dataclasses.replace(config, dtype_name=dtype_name(dtype))
    if quantized and (config.dtype_name != "float32" or torch.device(device).type != "cpu"):
        raise ModelLoadError(f"{root}: quantized weights ({config.weight_format}) are served on CPU with float32 "
                             f"activations, not {config.dtype_name} on {device}")
    ops = ops if ops is not None else get_kernel_ops("auto", str(device))
    with torch.device(device):
        model = CausalLM(config, ops, quantized=quantized)
    if quantized:
        _load_quantized(model, root, config)
    else:
        reader = CheckpointReader(root, weight_files(root))
        try:
            model.load_hf_weights(reader.get)
        finally:
            reader.close()
    model.eval()
    if pack_weights and model.pack_cpu_weights():
        log.info("linear weights packed for oneDNN (bfloat16 on CPU)")
    return LoadedModel(config=config, model=model, path=root)


def _load_quantized(model: CausalLM, root: Path, config: ModelConfig) -> None:
    """Fills `model` from the directory's GGUF blocks, run by the quantized kernels this CPU is best at."""
    from pdserve.engine.gguf_weights import GGUFWeights
    from pdserve.kernels.quant_ops import QuantOps

    qops = QuantOps.create()
    reader = GGUFWeights(root / GGUF_WEIGHTS, config)
    released = 0

    def loaded() -> None:
        nonlocal released
        released += reader.release_copied(model.quant_tensors())

    model.load_quantized_weights(reader.get, reader.get_weight, qops, loaded)
    log.info("weights %s served quantized: kernels %s; %.0f MiB of copied blocks' file pages released",
             config.weight_format, qops.isa.reason, released / 2**20)
