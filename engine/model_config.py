"""What the engine needs to know about a Hugging Face model directory, parsed once and validated.

Reads ``config.json`` (both the older ``rope_theta`` + ``rope_scaling`` style and the transformers-5
``rope_parameters`` style), ``generation_config.json`` for the EOS ids, and the safetensors tensors for
the weights digest that ``ModelConfig.fingerprint()`` folds in. Nothing here builds a model.

Importing this module and parsing a config do not import torch (the frontend reads configs for their
context length); only ``ModelConfig.dtype``, ``parse_dtype`` and the weights digest do, when called.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Accepted spellings -> the canonical name (also the torch attribute name) of the weights' dtype.
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
}
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
GGUF_WEIGHTS = "model.gguf"  # a directory holding it serves its quantized blocks (engine.gguf_weights)
# Checkpoints up to this size are hashed completely; larger ones are sampled (see `weights_digest`).
FULL_HASH_LIMIT_BYTES = 256 * 1024 * 1024
SAMPLED_ROWS_PER_TENSOR = 8


class ModelLoadError(ValueError):
    """A model directory that cannot be served; the message names the file and the field or tensor."""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one model as the engine runs it. `dtype` is the dtype the weights are (or
    will be) held in, so two configs of the same checkpoint loaded in different dtypes differ."""

    arch: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain RoPE; else has "rope_type" ("linear" | "llama3")
    max_position_embeddings: int
    sliding_window: int | None  # contexts are capped at this many tokens (see `max_model_len`)
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE
    dtype_name: str  # canonical dtype name ("float32" | "bfloat16" | "float16"); see `dtype`
    eos_token_ids: tuple[int, ...]  # sorted; generation_config.json's when it has them, else config.json's
    bos_token_id: int | None
    weights_digest: str = ""  # hex digest of the tensors (see `weights_digest`); "" when not computed
    # "" for float weights in `dtype_name`; "gguf:Q4_1+Q8_0" for a directory serving its GGUF's blocks
    # (engine.gguf_weights; activations then run in float32)
    weight_format: str = ""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"field '{name}' must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"field 'num_attention_heads' ({self.num_heads}) must be a multiple of "
                f"'num_key_value_heads' ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"field 'head_dim' must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"field 'rms_norm_eps' must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"field 'rope_theta' must be > 0, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"field 'sliding_window' must be positive or null, got {self.sliding_window}")
        if self.dtype_name not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype_name!r}")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.arch!r} is not one of {SUPPORTED_ARCHITECTURES}")
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"eos_token_id {list(self.eos_token_ids)} outside the vocabulary ({self.vocab_size})")

    def __hash__(self) -> int:
        # `rope_scaling` is a dict, so the generated field hash would fail; the fingerprint is stable.
        return hash(self.fingerprint())

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype the weights are held in (imports torch)."""
        return parse_dtype(self.dtype_name)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest context served. Sliding-window models are capped at their window, inside which full
        causal attention equals windowed attention exactly."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int, int]:
        """Shape of the paged KV cache for this model: [L, 2, NB, BS, Hkv, D]."""
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def fingerprint(self) -> str:
        """Stable hex digest over every field, including the weights digest and the held dtype. Two nodes
        may exchange KV blocks only when their fingerprints agree."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["dtype"] = fields.pop("dtype_name")
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def dtype_name(value: object) -> str:
    """The canonical name of "bfloat16"/"bf16"/torch.bfloat16 (and the float32/float16 spellings).
    Raises ValueError for anything else. Needs no torch."""
    key = str(value).removeprefix("torch.").lower()
    if key not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {value!r}; use one of float32, bfloat16, float16")
    return DTYPE_NAMES[key]


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Maps "bfloat16"/"bf16"/torch.bfloat16 (and the float32/float16 spellings) to a torch dtype."""
    import torch

    return getattr(torch, dtype_name(value))


def read_json(path: Path) -> dict[str, Any]:
    """Reads a JSON object, turning unreadable or non-object files into a ModelLoadError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path}: file not found") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not readable as JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _field(raw: dict[str, Any], key: str, kind: type | tuple[type, ...], source: Path, default: Any = ...) -> Any:
    if key not in raw or raw[key] is None:
        if default is ...:
            raise ModelLoadError(f"{source}: missing required field '{key}'")
        return default
    value = raw[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ModelLoadError(f"{source}: field '{key}' has type {type(value).__name__}, expected {kind}")
    return value


def _token_ids(value: Any, key: str, source: Path) -> set[int]:
    if value is None:
        return set()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise ModelLoadError(f"{source}: field '{key}' must be an int or a list of ints, got {value!r}")
    return set(items)


def _rope(raw: dict[str, Any], source: Path) -> tuple[float, dict[str, Any] | None]:
    """Returns (rope_theta, rope_scaling) from either config style; rope_scaling is None for plain RoPE."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per-layer-type form; these architectures have one type
    if params is not None and not isinstance(params, dict):
        raise ModelLoadError(f"{source}: field 'rope_parameters' must be an object, got {params!r}")
    scaling = raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: field 'rope_scaling' must be an object or null, got {scaling!r}")
    merged: dict[str, Any] = {**(scaling or {}), **(params or {})}
    theta = merged.pop("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float) or isinstance(theta, bool):
        raise ModelLoadError(f"{source}: field 'rope_theta' must be a number, got {theta!r}")
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    key = "rope_parameters.rope_type" if params else "rope_scaling.rope_type"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{source}: field '{key}' is {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if float(merged.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{source}: field 'partial_rotary_factor' != 1 is not supported")
    if rope_type == "default":
        return float(theta), None
    needed = ("factor",) if rope_type == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    for name in needed:
        if not isinstance(merged.get(name), int | float):
            raise ModelLoadError(f"{source}: rope type {rope_type!r} needs numeric field '{name}'")
    return float(theta), {"rope_type": rope_type, **{name: merged[name] for name in needed}}


def _architecture(raw: dict[str, Any], source: Path) -> str:
    archs = _field(raw, "architectures", list, source)
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: field 'architectures' is {archs!r}; unsupported architecture "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: field 'hidden_act' is {act!r}; only 'silu' is supported")
    return str(archs[0])


def _sliding_window(raw: dict[str, Any], arch: str, num_layers: int, source: Path) -> int | None:
    """The attention window in tokens, or None when there is none (or it never binds)."""
    sliding_window: int | None = None
    if arch == "MistralForCausalLM":
        # Mistral applies a 4096-token window when the field is absent; an explicit null disables it.
        sliding_window = _field(raw, "sliding_window", int, source, None) if "sliding_window" in raw else 4096
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and raw.get("use_sliding_window", False):
        layer_types = raw.get("layer_types")
        if isinstance(layer_types, list):
            windowed = "sliding_attention" in layer_types
        else:  # transformers' rule: layers from max_window_layers on use the window
            windowed = int(raw.get("max_window_layers", 28)) < num_layers
        if windowed:
            sliding_window = _field(raw, "sliding_window", int, source, 4096)
    if sliding_window is not None and sliding_window >= _field(raw, "max_position_embeddings", int, source, 2048):
        sliding_window = None  # the window never binds
    return sliding_window


def _special_ids(raw: dict[str, Any], generation: dict[str, Any] | None, source: Path) -> tuple[set[int], Any]:
    """(EOS ids, BOS id as given): generation_config.json decides the stop ids when it names them, as in
    transformers' generate."""
    gen = generation or {}
    if gen.get("eos_token_id") is not None:
        eos = _token_ids(gen["eos_token_id"], "eos_token_id", source.with_name("generation_config.json"))
    else:
        eos = _token_ids(raw.get("eos_token_id"), "eos_token_id", source)
    return eos, gen.get("bos_token_id", raw.get("bos_token_id"))


def parse_model_config(
    raw: dict[str, Any], generation: dict[str, Any] | None, source: Path, weights_digest: str = ""
) -> ModelConfig:
    """Builds a validated ModelConfig from parsed config.json (and generation_config.json) contents.
    `source` only names the file in error messages."""
    arch = _architecture(raw, source)
    hidden = _field(raw, "hidden_size", int, source)
    heads = _field(raw, "num_attention_heads", int, source)
    if heads <= 0:
        raise ModelLoadError(f"{source}: field 'num_attention_heads' must be positive, got {heads}")
    # Qwen3's own default head_dim is 128; the others derive it from the hidden size.
    default_head_dim = 128 if arch == "Qwen3ForCausalLM" else hidden // heads
    theta, scaling = _rope(raw, source)
    # Qwen2 has q/k/v biases but none on o_proj, whatever config.json says.
    attention_bias = arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
    o_proj_bias = arch != "Qwen2ForCausalLM" and attention_bias
    num_layers = _field(raw, "num_hidden_layers", int, source)
    eos, bos = _special_ids(raw, generation, source)
    try:
        dtype = dtype_name(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    except ValueError as e:
        raise ModelLoadError(f"{source}: field 'dtype': {e}") from e
    try:
        return ModelConfig(
            arch=arch,
            model_type=str(raw.get("model_type", "")),
            vocab_size=_field(raw, "vocab_size", int, source),
            hidden_size=hidden,
            intermediate_size=_field(raw, "intermediate_size", int, source),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=_field(raw, "num_key_value_heads", int, source, heads),
            head_dim=_field(raw, "head_dim", int, source, default_head_dim),
            rms_norm_eps=_field(raw, "rms_norm_eps", float, source, 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_field(raw, "max_position_embeddings", int, source, 2048),
            sliding_window=_sliding_window(raw, arch, num_layers, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            dtype_name=dtype,
            eos_token_ids=tuple(sorted(eos)),
            bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
            weights_digest=weights_digest,
        )
    except ValueError as e:
        raise ModelLoadError(f"{source}: {e}") from e


def weight_files(path: Path) -> dict[str, Path]:
    """Maps every tensor name to the safetensors file holding it, from the index when the checkpoint is
    sharded. Raises ModelLoadError for a missing file, a shard listed but absent, or an unreadable header."""
    index_path = path / SAFETENSORS_INDEX
    single = path / SAFETENSORS_SINGLE
    if index_path.exists():
        index = read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: missing required field 'weight_map'")
        files = {name: path / str(shard) for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ModelLoadError(f"{index_path}: shard '{shard.name}' listed in field 'weight_map' is missing")
        return files
    if single.is_file():
        try:
            with safe_open(single, framework="pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"{single}: unreadable safetensors header ({e})") from e
    raise ModelLoadError(f"{path}: no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} found")


def weights_digest(files: dict[str, Path]) -> str:
    """Hex digest of the tensors, independent of how they are split into shards. Checkpoints up to
    FULL_HASH_LIMIT_BYTES are hashed completely, so any changed value changes the digest; larger ones hash
    every tensor's name, dtype and shape plus SAMPLED_ROWS_PER_TENSOR evenly spaced rows, which keeps it
    cheap (a few MB read) at the cost of missing edits confined to unsampled rows."""
    total = sum(p.stat().st_size for p in set(files.values()))
    full = total <= FULL_HASH_LIMIT_BYTES
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    per_tensor: dict[str, str] = {}
    for file, names in by_file.items():
        name = ""
        try:
            with safe_open(file, framework="pt") as f:
                for name in names:
                    per_tensor[name] = _tensor_digest(f, name, full)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{file}: cannot read tensor '{name}' ({e})") from e
    h = hashlib.sha256()
    for name in sorted(per_tensor):
        h.update(f"{name}={per_tensor[name]};".encode())
    return h.hexdigest()


def _tensor_digest(f: Any, name: str, full: bool) -> str:
    sl = f.get_slice(name)
    shape = list(sl.get_shape())
    h = hashlib.sha256(f"{sl.get_dtype()}{shape}".encode())
    rows = shape[0] if shape else 1
    if full or rows <= SAMPLED_ROWS_PER_TENSOR:
        chunks = [f.get_tensor(name)]
    else:
        step = rows / SAMPLED_ROWS_PER_TENSOR
        chunks = [sl[int(i * step) : int(i * step) + 1] for i in range(SAMPLED_ROWS_PER_TENSOR)]
    import torch  # safe_open(framework="pt") hands out torch tensors

    for t in chunks:
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_model_config(path: str | Path) -> ModelConfig:
    """Parses config.json + generation_config.json of a model directory and digests its weights.
    Raises ModelLoadError naming the file and field when the directory cannot be served."""
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(f"{root}: not a directory")
    config_path = root / "config.json"
    raw = read_json(config_path)
    gen_path = root / "generation_config.json"
    generation = read_json(gen_path) if gen_path.exists() else None
    config = parse_model_config(raw, generation, config_path)  # config errors first, before the weights
    gguf = root / GGUF_WEIGHTS
    if gguf.is_file():
        from pdserve.engine.gguf_scan import gguf_weight_format, gguf_weights_digest

        return dataclasses.replace(config, weights_digest=gguf_weights_digest(gguf),
                                   weight_format=gguf_weight_format(gguf))
    return dataclasses.replace(config, weights_digest=weights_digest(weight_files(root)))
