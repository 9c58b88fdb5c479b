"""The engine's one validated configuration (each process that runs an engine builds exactly one)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pdserve.engine.speculative import SPECULATIVE_METHODS
from pdserve.kernels import BACKENDS

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# KV cache element types: "auto" = the model's dtype. fp8_e5m2 is the top byte of a float16 (float16's
# exponent range, 2 mantissa bits). fp8_e4m3 (torch's float8_e4m3fn: 3 mantissa bits, |x| <= 448, subnormals
# down to 2^-9) is stored unscaled (a fixed scale of 1), values beyond +-448 saturate: K/V of the models served
# here stay far inside that range, and the extra mantissa bit halves the rounding error (bench/bf16_accuracy.py
# measures both).
KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # path to a Hugging Face model directory
    dtype: str = "auto"  # "auto" = the model config's dtype
    device: str = "cpu"  # "cpu" or "cuda[:N]"
    kernel_backend: str = "auto"  # "auto" | "cpu" | "torch" | "triton" (see kernels.get_kernel_ops)
    block_size: int = 16  # tokens per KV block; must match across a cluster
    kv_cache_memory_bytes: int = 1 << 30  # KV cache budget when num_kv_blocks is not given
    num_kv_blocks: int | None = None  # exact KV cache size; overrides the memory budget
    max_num_seqs: int = 128  # sequences per step at most
    max_num_batched_tokens: int = 2048  # tokens per step at most (chunked-prefill budget)
    max_model_len: int | None = None  # context cap; None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    prefix_hash_seed: int = 0  # shared by every node of a cluster so prefix hashes agree
    seed: int = 0  # seeds the generator used by sampled requests without their own seed
    num_threads: int | None = None  # torch intra-op threads; None = leave torch's default
    kv_cache_dtype: str = "auto"  # KV cache element type (KV_CACHE_DTYPES); must match across a cluster
    speculative: str = "off"  # draft proposer of speculative decoding: "off", "ngram" or "suffix"
    num_speculative_tokens: int = 4  # draft tokens a step at most
    speculative_min_match: int = 2  # shortest repeat (tokens) a draft is taken from: ngram's min n, suffix's min_match
    # A disk tier under the KV pool (engine.kv_tier): committed blocks kept in this directory, at most
    # kv_tier_bytes, read back on a prefix the pool has evicted (and after a restart). None: no tier.
    kv_tier_dir: str | None = None
    kv_tier_bytes: int = 8 << 30
    # Ranks the model is split over (engine.parallel): 1 runs it whole in this process; N spawns N - 1
    # worker processes holding the other shards.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        checks = [
            (bool(self.model), "model path is required"),
            (self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}"),
            (self.device == "cpu" or self.device.startswith("cuda"), f"device must be cpu or cuda[:N], got {self.device!r}"),
            (self.kernel_backend in BACKENDS, f"bad kernel_backend {self.kernel_backend!r}"),
            (self.block_size in (8, 16, 32, 64, 128), f"block_size must be one of 8/16/32/64/128, got {self.block_size}"),
            (self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes must be > 0"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks must be >= 2"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= self.block_size, "max_num_batched_tokens must be >= block_size"),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2"),
            (self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"),
            (self.kv_cache_dtype == "auto" or (self.device == "cpu" and self.kernel_backend != "triton"),
             f"kv_cache_dtype {self.kv_cache_dtype!r} is implemented for CPU KV caches and the cpu/torch kernels only "
             f"(the Triton kernels read 16/32-bit pools); use kv_cache_dtype auto with device {self.device!r} and "
             f"kernel_backend {self.kernel_backend!r}"),
            (self.speculative in SPECULATIVE_METHODS,
             f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}"),
            (1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens must be in [1, 16]"),
            (1 <= self.speculative_min_match <= 16, "speculative_min_match must be in [1, 16]"),
            (self.kv_tier_bytes > 0, "kv_tier_bytes must be > 0"),
            (self.kv_tier_dir is None or self.enable_prefix_caching, "a KV tier needs prefix caching"),
            (1 <= self.tensor_parallel_size <= 64, "tensor_parallel_size must be in [1, 64]"),
            (self.tensor_parallel_size == 1 or self.kv_tier_dir is None,
             "a KV tier runs with tensor_parallel_size 1 only (its files hold every KV head)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"EngineConfig: {msg}")
        if not os.path.isdir(self.model):
            raise ValueError(f"EngineConfig: model directory {self.model!r} does not exist")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for a configured kv_cache_dtype ("auto" = the model's dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    if kv_cache_dtype == "fp8_e4m3":
        return torch.float8_e4m3fn
    raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}")
