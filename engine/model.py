"""The decoder-only transformer the engine runs (Llama / Mistral / Qwen2 / Qwen3), over a paged KV cache.

Every op is batched over the T packed tokens of a step; attention goes through `engine.attention`.
Numerics follow the Hugging Face reference so fp32 greedy outputs agree token for token: RMSNorm in
float32 then cast back, RoPE tables in float32 with the rotate-half convention, SiLU-gated MLP. q/k/v and
gate/up are fused into one matmul each at load time; bf16 weights on a CPU are then packed for oneDNN
(`CausalLM.pack_cpu_weights`, the same output bits).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionMetadata, paged_attention
from pdserve.engine.model_config import ModelConfig
from pdserve.kernels import KernelOps

# Returns the named Hugging Face tensor after checking it has the given shape (the loader owns the files).
WeightGetter = Callable[[str, tuple[int, ...]], torch.Tensor]

DEFAULT_ROPE_TABLE_LEN = 32768
# Logits recomputed in float32 per row when the LM head runs in half precision (see compute_logits).
REFINE_TOP = 16


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialized: every parameter is overwritten by load_hf_weights, so skip nn.Linear's random init.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


# Batch size the CPU weight packing is tuned for (any batch size works; outputs do not depend on it).
PACK_BATCH_HINT = 32


def cpu_weight_packing(dtype: torch.dtype) -> bool:
    """Whether linear weights of `dtype` on this CPU can be packed once into oneDNN's blocked layout
    (bfloat16 with oneDNN: a plain bf16 GEMM repacks its weight on every call, at a decode step's small
    batch a large part of its time). Checked by packing one small weight and comparing with F.linear,
    which must agree bit for bit. Changes nothing."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.linspace(-1, 1, 24 * 40).reshape(24, 40).to(dtype)  # [out, in]
        x = torch.linspace(-2, 2, 3 * 40).reshape(3, 40).to(dtype)  # [M, in]
        b = torch.linspace(-3, 3, 24).to(dtype)  # [out]
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        return all(
            torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""), F.linear(x, w, bias))
            for bias in (None, b)
        )
    except (RuntimeError, AttributeError):
        return False


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias: through the packed weight when the model was packed (`CausalLM.pack_cpu_weights`;
    the same bits as F.linear), else F.linear."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:  # [D/2] float32
    """Inverse RoPE frequencies, including linear and llama3 frequency scaling."""
    d = cfg.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    old_len = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(in_between, blended, scaled)


class Rope(NamedTuple):
    cos: torch.Tensor  # [P, D] table, or [T, 1, D] gathered for a step
    sin: torch.Tensor  # the same, with its first half negated (rotate-half's sign, see KernelOps.rotary)


def rope_tables(inv_freq: torch.Tensor, length: int) -> Rope:  # [P, D] float32 each
    """cos/sin for positions [0, length), in the layout rotate-half expects (frequencies repeated twice),
    the sin table's first half negated."""
    pos = torch.arange(length, device=inv_freq.device, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    sin = emb.sin()
    sin[:, : freqs.shape[1]].neg_()
    return Rope(emb.cos(), sin)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        self.eps = eps
        self.weight = _param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:  # [..., dim], weight's dtype
        """Rounded to the weight dtype before the scale, as transformers does (KernelOps.rms_norm). `add`:
        added into x (the float32 residual stream) first, in the same call."""
        return self.ops.rms_norm(x, self.weight, self.eps, add)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> same shape, float32
        """The same norm kept in float32 throughout (equal to `forward` for float32 weights). F.rms_norm without
        a weight is x * rsqrt(mean(x^2) + eps) in float32, the Hugging Face reference's ops in one call (a
        fresh tensor: x is never changed)."""
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).mul_(self.weight.float())


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        dt = cfg.dtype
        self.qkv_weight = _param(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, dtype=dt)  # rows: q | k | v
        self.qkv_bias = _param(cfg.q_size + 2 * cfg.kv_size, dtype=dt) if cfg.attention_bias else None
        self.o_weight = _param(cfg.hidden_size, cfg.q_size, dtype=dt)
        self.o_bias = _param(cfg.hidden_size, dtype=dt) if cfg.o_proj_bias else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt, ops) if cfg.qk_norm else None
        self.qkv_packed: torch.Tensor | None = None  # oneDNN-packed weights (CausalLM.pack_cpu_weights)
        self.o_packed: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = _linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed).view(t, hq + 2 * hkv, self.head_dim)  # [T, Hq+2Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = qkv.split((hq, hkv, hkv), dim=1)
            q = self.ops.rotary(self.q_norm(q), cos, sin)  # [T, Hq, D]
            k = self.ops.rotary(self.k_norm(k), cos, sin)  # [T, Hkv, D]
        else:  # q and k heads side by side: one rotation for both
            qk, v = qkv.split((hq + hkv, hkv), dim=1)  # [T, Hq+Hkv, D], [T, Hkv, D]
            q, k = self.ops.rotary(qk, cos, sin).split((hq, hkv), dim=1)
        out = paged_attention(self.ops, q, k, v, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return _linear(out.reshape(t, self.q_size), self.o_weight, self.o_bias, self.o_packed)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        dt = cfg.dtype
        self.gate_up_weight = _param(2 * cfg.intermediate_size, cfg.hidden_size, dtype=dt)  # rows: gate | up
        self.gate_up_bias = _param(2 * cfg.intermediate_size, dtype=dt) if cfg.mlp_bias else None
        self.down_weight = _param(cfg.hidden_size, cfg.intermediate_size, dtype=dt)
        self.down_bias = _param(cfg.hidden_size, dtype=dt) if cfg.mlp_bias else None
        self.gate_up_packed: torch.Tensor | None = None  # oneDNN-packed weights (CausalLM.pack_cpu_weights)
        self.down_packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = _linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_packed)  # [T, 2I]
        act = self.ops.silu_mul(gate_up)  # [T, I]
        return _linear(act, self.down_weight, self.down_bias, self.down_packed)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, ops)
        self.self_attn = Attention(cfg, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, ops)
        self.mlp = MLP(cfg, ops)

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden] float32, changed in place
        pending: torch.Tensor | None,  # [T, hidden]: the previous layer's MLP output, not yet in h
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    ) -> torch.Tensor:  # [T, hidden]: this layer's MLP output, for the caller to add into h
        # h is the float32 residual stream whatever the weights' dtype (a half-precision residual loses
        # about a bit per layer); each sublayer's output is added into it by the norm that reads the sum
        # (the same adds in the same order, one call fewer each)
        attn = self.self_attn(self.input_layernorm(h, add=pending), cos, sin, meta, k_cache, v_cache)
        return self.mlp(self.post_attention_layernorm(h, add=attn))


class CausalLM(nn.Module):
    """Parameters are created uninitialized in `cfg.dtype` on the current default device; fill them with
    `load_hf_weights`. `forward` writes this step's K/V into `kv_cache` and returns final-normed hidden states
    (float32 whatever the weights' dtype).
    Both run under no_grad rather than inference_mode, so callers may edit the returned logits in place."""

    def __init__(self, cfg: ModelConfig, ops: KernelOps, rope_table_len: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.embed_weight = _param(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, ops)
        self.lm_head_weight = (
            self.embed_weight if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        )
        self.lm_head_packed: torch.Tensor | None = None  # oneDNN-packed LM head (pack_cpu_weights)
        # Plain tensors, not buffers: model.to(dtype) must not round the float32 tables.
        self._inv_freq = rope_inv_freq(cfg).to(self.embed_weight.device)  # [D/2]
        self._table = rope_tables(self._inv_freq, rope_table_len or min(cfg.max_model_len, DEFAULT_ROPE_TABLE_LEN))
        self._kv_views: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def _rope(self, positions: torch.Tensor) -> Rope:  # [T, 1, D] each, in the model dtype
        # One host sync per step (positions.max) buys the window check and the lazily grown table.
        top = int(positions.max()) + 1 if positions.numel() else 0
        window = self.cfg.sliding_window
        if window is not None and top > window:
            raise NotImplementedError(
                f"position {top - 1} is past the sliding window ({window}); contexts are capped at max_model_len"
            )
        table = self._table
        if top > table.cos.shape[0]:  # grow; entries already there come out identical
            table = self._table = rope_tables(self._inv_freq, max(top, 2 * table.cos.shape[0]))
        dt = self.embed_weight.dtype
        return Rope(
            table.cos.index_select(0, positions).to(dt)[:, None, :],
            table.sin.index_select(0, positions).to(dt)[:, None, :],
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """Runs the T packed tokens of one step. Changes only the kv_cache slots in meta.slot_mapping
        (and may grow the RoPE table when a position is past it). `on_layer(i)` is called after layer i's
        ops were issued (engine.step_hook says what that means on CUDA)."""
        cos, sin = self._rope(positions)
        h = F.embedding(input_ids, self.embed_weight).float()  # [T, hidden] float32 residual stream (fresh)
        pending = None  # the last layer's MLP output, added by the next layer's first norm
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, self._layer_caches(kv_cache), strict=True)):
            pending = layer(h, pending, cos, sin, meta, k_cache, v_cache)
            if on_layer is not None:
                on_layer(i)
        if pending is not None:
            h.add_(pending)
        return self.norm.forward_float32(h)

    def _layer_caches(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (k_cache, v_cache) views of the KV cache [L, 2, NB, BS, Hkv, D], made once per KV cache
        tensor rather than 3 indexing ops per layer per step. Changes only this cache of views."""
        if self._kv_views is None or self._kv_views[0] is not kv_cache:
            self._kv_views = (kv_cache, [(layer[0], layer[1]) for layer in kv_cache])
        return self._kv_views[1]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] float32 -> [N, V] float32
        """Vocabulary logits for the selected rows of `forward`'s output. Changes nothing.

        Half-precision weights: the LM head GEMM runs in the weights' dtype, whose rounded outputs are
        0.125 apart near a logit of 25, coarser than the gap between the two best tokens at many steps.
        The REFINE_TOP best rows are recomputed in float32 from the float32 hidden state (a few
        dot products per row), so greedy picks and top logprobs see float32 logits; the rest keep the
        rounded values, which is enough for sampling."""
        w = self.lm_head_weight
        logits = _linear(hidden.to(w.dtype), w, None, self.lm_head_packed).float()  # [N, V]
        if w.dtype == torch.float32 or logits.numel() == 0:
            return logits
        top = self.ops.topk(logits, min(REFINE_TOP, logits.shape[1]))[1]  # [N, K]
        exact = torch.bmm(w[top].float(), hidden.float()[:, :, None])[:, :, 0]  # [N, K, H] x [N, H, 1]
        return logits.scatter_(1, top, exact)

    @torch.no_grad()
    def pack_cpu_weights(self) -> bool:
        """Packs every linear weight (q/k/v, o, gate/up, down, the LM head) once into oneDNN's blocked
        layout when `cpu_weight_packing` allows it for this model's dtype on a CPU. A step's outputs are
        the same bits as before; its GEMMs are 1.2-2x faster at decode batch sizes. The layers' plain
        weights are then freed (the packed copies replace them); the embedding, which the LM head may
        share, stays. Call after load_hf_weights. Returns whether it packed."""
        w0 = self.embed_weight
        if w0.device.type != "cpu" or not cpu_weight_packing(w0.dtype) or self.lm_head_packed is not None:
            return False

        def pack(w: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT)

        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_packed, attn.o_packed = pack(attn.qkv_weight), pack(attn.o_weight)
            mlp.gate_up_packed, mlp.down_packed = pack(mlp.gate_up_weight), pack(mlp.down_weight)
            for p in (attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight):
                p.data = p.data.new_empty(0)  # only the packed copy is read from now on
        self.lm_head_packed = pack(self.lm_head_weight)
        return True

    @torch.no_grad()
    def load_hf_weights(self, get: WeightGetter) -> None:
        """Copies the Hugging Face checkpoint tensors (HF names) into the fused parameters, converting to
        the parameter dtype/device. Changes every parameter; raises whatever `get` raises for a missing or
        misshapen tensor."""
        cfg = self.cfg
        hid, q, kv, inter, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
        self.embed_weight.copy_(get("model.embed_tokens.weight", (cfg.vocab_size, hid)))
        self.norm.weight.copy_(get("model.norm.weight", (hid,)))
        if not cfg.tie_word_embeddings:
            self.lm_head_weight.copy_(get("lm_head.weight", (cfg.vocab_size, hid)))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            layer.input_layernorm.weight.copy_(get(p + "input_layernorm.weight", (hid,)))
            layer.post_attention_layernorm.weight.copy_(get(p + "post_attention_layernorm.weight", (hid,)))
            spans = (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv))
            for name, lo, hi in spans:
                attn.qkv_weight[lo:hi].copy_(get(f"{p}self_attn.{name}.weight", (hi - lo, hid)))
                if attn.qkv_bias is not None:
                    attn.qkv_bias[lo:hi].copy_(get(f"{p}self_attn.{name}.bias", (hi - lo,)))
            attn.o_weight.copy_(get(p + "self_attn.o_proj.weight", (hid, q)))
            if attn.o_bias is not None:
                attn.o_bias.copy_(get(p + "self_attn.o_proj.bias", (hid,)))
            if attn.q_norm is not None and attn.k_norm is not None:
                attn.q_norm.weight.copy_(get(p + "self_attn.q_norm.weight", (d,)))
                attn.k_norm.weight.copy_(get(p + "self_attn.k_norm.weight", (d,)))
            for name, lo, hi in (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter)):
                mlp.gate_up_weight[lo:hi].copy_(get(f"{p}mlp.{name}.weight", (inter, hid)))
                if mlp.gate_up_bias is not None:
                    mlp.gate_up_bias[lo:hi].copy_(get(f"{p}mlp.{name}.bias", (inter,)))
            mlp.down_weight.copy_(get(p + "mlp.down_proj.weight", (hid, inter)))
            if mlp.down_bias is not None:
                mlp.down_bias.copy_(get(p + "mlp.down_proj.bias", (hid,)))
