"""The decoder-only transformer the engine runs (Llama / Mistral / Qwen2 / Qwen3), over a paged KV cache.

Every op is batched over the T packed tokens of a step; attention goes through `engine.attention`.
Numerics follow the Hugging Face reference so fp32 greedy outputs agree token for token: RMSNorm in
float32 then cast back, RoPE tables in float32 with the rotate-half convention, SiLU-gated MLP. q/k/v and
gate/up are fused into one matmul each at load time; bf16 weights on a CPU are then packed for oneDNN
(`CausalLM.pack_cpu_weights`, the same output bits). A GGUF checkpoint's projections, LM head and embedding
may instead stay in their quantized blocks (`load_quantized_weights`, `engine.linear`), the activations in
float32.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionMetadata, paged_attention
from pdserve.engine.linear import Linear, cpu_weight_packing, empty_param
from pdserve.engine.model_config import ModelConfig
from pdserve.kernels import KernelOps
from pdserve.kernels.quant_format import QuantWeight
from pdserve.kernels.quant_ops import STACK_KV_DTYPES, DecodeStack, QuantOps, StackLayer, StackProjection

# Returns the named Hugging Face tensor after checking it has the given shape (the loader owns the files).
WeightGetter = Callable[[str, tuple[int, ...]], torch.Tensor]
# The same for a projection or embedding of a quantized checkpoint: its blocks, or float32 for other types.
QuantGetter = Callable[[str, tuple[int, int]], QuantWeight | torch.Tensor]

DEFAULT_ROPE_TABLE_LEN = 32768
# Logits recomputed in float32 per row when the LM head runs in half precision (see compute_logits).
REFINE_TOP = 16
# "0" keeps quantized models' decode steps on the per-op path (the fused step is the default).
FUSED_DECODE_ENV = "PDSERVE_FUSED_DECODE"


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
        self.weight = empty_param(dim, dtype=dtype)

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
    def __init__(self, cfg: ModelConfig, ops: KernelOps, quantized: bool) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        dt = cfg.dtype
        self.qkv = Linear(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, cfg.attention_bias, dt, quantized)  # q | k | v
        self.o = Linear(cfg.hidden_size, cfg.q_size, cfg.o_proj_bias, dt, quantized)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt, ops) if cfg.qk_norm else None

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
        qkv = self.qkv(x).view(t, hq + 2 * hkv, self.head_dim)  # [T, Hq+2Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = qkv.split((hq, hkv, hkv), dim=1)
            q = self.ops.rotary(self.q_norm(q), cos, sin)  # [T, Hq, D]
            k = self.ops.rotary(self.k_norm(k), cos, sin)  # [T, Hkv, D]
        else:  # q and k heads side by side: one rotation for both
            qk, v = qkv.split((hq + hkv, hkv), dim=1)  # [T, Hq+Hkv, D], [T, Hkv, D]
            q, k = self.ops.rotary(qk, cos, sin).split((hq, hkv), dim=1)
        out = paged_attention(self.ops, q, k, v, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, quantized: bool) -> None:
        super().__init__()
        self.ops = ops
        dt, hid, inter = cfg.dtype, cfg.hidden_size, cfg.intermediate_size
        self.gate_up = Linear(2 * inter, hid, cfg.mlp_bias, dt, quantized)  # rows: gate | up
        self.down = Linear(hid, inter, cfg.mlp_bias, dt, quantized)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down(self.ops.silu_mul(self.gate_up(x)))  # silu(gate) * up: [T, I]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, quantized: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, ops)
        self.self_attn = Attention(cfg, ops, quantized)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, ops)
        self.mlp = MLP(cfg, ops, quantized)

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


class WeightsInfo(NamedTuple):
    format: str  # "float32", "bfloat16", or the GGUF block types served, e.g. "Q4_1+Q8_0"
    kernels: str  # the quantized kernels' instruction set ("avx2", ...); "" for float weights
    reason: str  # why those kernels, one line ("" for float weights)

    def describe(self) -> str:
        if not self.kernels:
            return f"{self.format} (float weights)"
        return f"{self.format} GGUF blocks, served as they are; kernels {self.reason}"


class CausalLM(nn.Module):
    """Parameters are created uninitialized in `cfg.dtype` on the current default device; fill them with
    `load_hf_weights` (float checkpoints) or `load_quantized_weights` (GGUF blocks, when built with
    `quantized`). `forward` writes this step's K/V into `kv_cache` and returns final-normed hidden states
    (float32 whatever the weights' dtype).
    Both run under no_grad rather than inference_mode, so callers may edit the returned logits in place."""

    def __init__(self, cfg: ModelConfig, ops: KernelOps, rope_table_len: int | None = None,
                 quantized: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        vocab, hid, dt = cfg.vocab_size, cfg.hidden_size, cfg.dtype
        self.embed_weight = empty_param(*((0,) if quantized else (vocab, hid)), dtype=dt)
        self.embed_quant: QuantWeight | None = None  # the token embedding as GGUF blocks (quantized models)
        self.qops: QuantOps | None = None
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, quantized) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(hid, cfg.rms_norm_eps, dt, ops)
        tied = self.embed_weight if cfg.tie_word_embeddings else None
        self.lm_head = Linear(vocab, hid, False, dt, quantized, weight=tied)
        # Plain tensors, not buffers: model.to(dtype) must not round the float32 tables.
        self._inv_freq = rope_inv_freq(cfg).to(self.embed_weight.device)  # [D/2]
        self._table = rope_tables(self._inv_freq, rope_table_len or min(cfg.max_model_len, DEFAULT_ROPE_TABLE_LEN))
        self._kv_views: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        # Quantized models on a CPU: decode-only steps through one fused call (DecodeStack), built at the
        # first such step; False once found not to apply (fused_decode_reason says why).
        self.fused_decode = os.environ.get(FUSED_DECODE_ENV, "1") != "0"
        self._stack: DecodeStack | bool | None = None
        self.fused_decode_reason = ""

    @property
    def act_dtype(self) -> torch.dtype:
        """The dtype activations (and RoPE tables) run in: float32 for quantized weights."""
        return torch.float32 if self.embed_quant is not None else self.embed_weight.dtype

    def linears(self) -> list[Linear]:
        """Every projection, the LM head last."""
        out: list[Linear] = []
        for layer in self.layers:
            out += [layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down]
        return [*out, self.lm_head]

    def weights_info(self) -> WeightsInfo:
        """How the weights are held and which kernels run them (the node's ready line and metrics say it)."""
        if self.qops is None:
            return WeightsInfo(str(self.embed_weight.dtype).removeprefix("torch."), "", "")
        return WeightsInfo(self.cfg.weight_format.removeprefix("gguf:"), self.qops.isa.name, self.qops.isa.reason)

    def weight_bytes(self) -> int:
        """Bytes of weight a decode step reads: every projection and the LM head (the embedding rows a step
        gathers are negligible)."""
        return sum(lin.nbytes() for lin in self.linears())

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] float32 (fresh)
        if self.embed_quant is not None:
            assert self.qops is not None
            return self.qops.embedding(input_ids, self.embed_quant)
        return F.embedding(input_ids, self.embed_weight).float()

    def _rope_table(self, positions: torch.Tensor) -> Rope:  # [P, D] float32 each, P past every position
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
        return table

    def _rope(self, positions: torch.Tensor) -> Rope:  # [T, 1, D] each, in the model dtype
        table = self._rope_table(positions)
        dt = self.act_dtype
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
        ops were issued (engine.step_hook says what that means on CUDA). A quantized model's decode-only
        steps without `on_layer` run fused (`DecodeStack`)."""
        if on_layer is None and 0 < meta.num_decode_tokens == input_ids.shape[0]:
            stack = self._decode_stack(kv_cache)
            if stack is not None:
                table = self._rope_table(positions)
                assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
                return stack.run(self._embed(input_ids), positions, meta.slot_mapping, meta.decode_block_tables,
                                 meta.decode_context_lens, kv_cache, table.cos, table.sin)
        cos, sin = self._rope(positions)
        h = self._embed(input_ids)  # [T, hidden] float32 residual stream (fresh)
        pending = None  # the last layer's MLP output, added by the next layer's first norm
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, self._layer_caches(kv_cache), strict=True)):
            pending = layer(h, pending, cos, sin, meta, k_cache, v_cache)
            if on_layer is not None:
                on_layer(i)
        if pending is not None:
            h.add_(pending)
        return self.norm.forward_float32(h)

    def _decode_stack(self, kv_cache: torch.Tensor) -> DecodeStack | None:
        """The fused decode step for this model and KV cache, built at first use; None where it does not
        apply (float weights, a float row group, a KV dtype it doesn't take, turned off), the reason kept
        in fused_decode_reason. Changes only that cache."""
        if self._stack is None:
            self._stack = self._build_stack()
        if not isinstance(self._stack, DecodeStack):
            return None
        if kv_cache.dtype not in STACK_KV_DTYPES or not kv_cache.is_cpu:
            self.fused_decode_reason = f"the fused decode step takes float32 or bfloat16 KV, not {kv_cache.dtype}"
            return None
        return self._stack

    def _build_stack(self) -> DecodeStack | bool:
        cfg = self.cfg
        if not self.fused_decode:
            self.fused_decode_reason = f"turned off ({FUSED_DECODE_ENV}=0)"
            return False
        if self.qops is None:
            self.fused_decode_reason = "float weights (the fused decode step serves GGUF blocks)"
            return False

        def proj(lin: Linear) -> StackProjection | None:
            groups = [g for g in lin.groups or () if isinstance(g, QuantWeight)]
            if lin.groups is None or len(groups) != len(lin.groups):
                return None
            return StackProjection(tuple(groups), None if lin.bias is None else lin.bias.detach().float().contiguous())

        def norm(n: RMSNorm | None) -> torch.Tensor | None:
            return None if n is None else n.weight.detach().float().contiguous()

        layers: list[StackLayer] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o, gate_up, down = (proj(lin) for lin in (attn.qkv, attn.o, mlp.gate_up, mlp.down))
            if qkv is None or o is None or gate_up is None or down is None:
                self.fused_decode_reason = "a projection holds float rows (the fused step takes GGUF blocks only)"
                return False
            layers.append(StackLayer(norm(layer.input_layernorm), norm(layer.post_attention_layernorm),
                                     norm(attn.q_norm), norm(attn.k_norm), qkv, o, gate_up, down))
        self.fused_decode_reason = ""
        try:
            return DecodeStack(self.qops, layers, self.norm.weight.detach().float().contiguous(),
                               num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                               intermediate_size=cfg.intermediate_size, eps=cfg.rms_norm_eps,
                               scale=self.layers[0].self_attn.scale)
        except ValueError as e:
            self.fused_decode_reason = str(e)
            return False

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
        Quantized weights: the kernels round the activations to 8 bits per block. Either way the REFINE_TOP
        best rows are recomputed in float32 from the float32 hidden state and the weight's own rows (the
        dequantized blocks for a quantized head; a few dot products per row), so greedy picks and top
        logprobs see the logits of the float model; the rest keep the rounded values, which is enough for
        sampling."""
        head = self.lm_head
        exact_rows = self._head_rows()
        if exact_rows is None:
            return head(hidden)  # float32 weights: exact already
        logits = head(hidden.to(self.embed_weight.dtype if head.groups is None else torch.float32)).float()  # [N, V]
        if logits.numel() == 0:
            return logits
        top = self.ops.topk(logits, min(REFINE_TOP, logits.shape[1]))[1]  # [N, K]
        rows = exact_rows(top.reshape(-1)).view(*top.shape, -1)  # [N, K, H] float32
        exact = torch.bmm(rows, hidden.float()[:, :, None])[:, :, 0]  # [N, K, H] x [N, H, 1]
        return logits.scatter_(1, top, exact)

    def _head_rows(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """index [R] -> the LM head's rows as float32 [R, H], for heads whose GEMM rounds (half precision,
        quantized); None for a float32 head."""
        head = self.lm_head
        if head.groups is not None:
            group = head.groups[0]
            if len(head.groups) != 1:
                return None  # a head of mixed row types: no cheap exact rows (never written by the importers)
            if isinstance(group, torch.Tensor):
                return lambda index: group[index]
            assert self.qops is not None
            qops = self.qops
            return lambda index: qops.embedding(index, group)
        w = head.weight
        if w.dtype == torch.float32:
            return None
        return lambda index: w[index].float()

    @torch.no_grad()
    def pack_cpu_weights(self) -> bool:
        """Packs every float linear weight (q/k/v, o, gate/up, down, the LM head) once into oneDNN's blocked
        layout when `cpu_weight_packing` allows it for this model's dtype on a CPU. A step's outputs are
        the same bits as before; its GEMMs are 1.2-2x faster at decode batch sizes. The layers' plain
        weights are then freed (the packed copies replace them); the embedding, which the LM head may
        share, stays. Call after loading. Returns whether it packed."""
        w0 = self.embed_weight
        if (w0.device.type != "cpu" or self.embed_quant is not None or not cpu_weight_packing(w0.dtype)
                or self.lm_head.packed is not None):
            return False
        for lin in self.linears():
            lin.pack()
            if lin is not self.lm_head:  # the head's plain rows give the exact top logits (compute_logits)
                lin.weight.data = lin.weight.data.new_empty(0)  # only the packed copy is read from now on
        return True

    @torch.no_grad()
    def load_hf_weights(self, get: WeightGetter) -> None:
        """Copies the Hugging Face checkpoint tensors (HF names) into the fused parameters, converting to
        the parameter dtype/device. Changes every parameter; raises whatever `get` raises for a missing or
        misshapen tensor."""
        cfg = self.cfg
        self.embed_weight.copy_(get("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)))
        self._load_small(get)
        for lin, parts, biases in self._sources():
            lo = 0
            for name, shape in parts:
                lin.weight[lo : lo + shape[0]].copy_(get(name, shape))
                lo += shape[0]
            if lin.bias is not None:
                _copy_rows(lin.bias, [get(name, shape) for name, shape in biases])

    @torch.no_grad()
    def load_quantized_weights(self, get: WeightGetter, get_weight: QuantGetter, qops: QuantOps,
                               loaded: Callable[[], None] | None = None) -> None:
        """Serves the projections, the LM head and the embedding from GGUF blocks: `get_weight` hands out
        a QuantWeight (or a float32 tensor for a type the kernels don't run), `get` the small float tensors
        (norms, biases); `loaded` is called after each projection (the loader frees what it copied). Changes
        every parameter; raises what the getters raise."""
        cfg = self.cfg
        self.qops = qops
        embed = get_weight("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        if isinstance(embed, QuantWeight):
            self.embed_quant = embed
        else:
            self.embed_weight.data = embed.to(self.embed_weight.dtype)
        self._load_small(get)
        for lin, parts, biases in self._sources():
            if lin is self.lm_head and cfg.tie_word_embeddings:
                lin.set_quantized([embed if isinstance(embed, QuantWeight) else embed.float()], qops)
                continue
            lin.set_quantized([get_weight(name, shape) for name, shape in parts], qops)
            if lin.bias is not None:
                _copy_rows(lin.bias, [get(name, shape) for name, shape in biases])
            if loaded is not None:
                loaded()

    def quant_tensors(self) -> list[torch.Tensor]:
        """The block tensors the model serves from (each QuantWeight's data)."""
        blocks = [self.embed_quant.data] if self.embed_quant is not None else []
        for module in self.modules():
            for g in getattr(module, "groups", None) or ():
                if isinstance(g, QuantWeight):
                    blocks.append(g.data)
        return blocks

    def _load_small(self, get: WeightGetter) -> None:
        """The norms, whatever form the projections take."""
        cfg = self.cfg
        hid, d = cfg.hidden_size, cfg.head_dim
        self.norm.weight.copy_(get("model.norm.weight", (hid,)))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_layernorm.weight.copy_(get(p + "input_layernorm.weight", (hid,)))
            layer.post_attention_layernorm.weight.copy_(get(p + "post_attention_layernorm.weight", (hid,)))
            attn = layer.self_attn
            if attn.q_norm is not None and attn.k_norm is not None:
                attn.q_norm.weight.copy_(get(p + "self_attn.q_norm.weight", (d,)))
                attn.k_norm.weight.copy_(get(p + "self_attn.k_norm.weight", (d,)))

    def _sources(self) -> list[tuple[Linear, list[tuple[str, tuple[int, int]]], list[tuple[str, tuple[int]]]]]:
        """Each projection with the checkpoint tensors that fill its rows, in order: (linear, weights, biases)."""
        cfg = self.cfg
        hid, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        out: list[tuple[Linear, list[tuple[str, tuple[int, int]]], list[tuple[str, tuple[int]]]]] = []
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [(f"{p}self_attn.{n}", rows) for n, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))]
            mlp_in = [(f"{p}mlp.{n}", inter) for n in ("gate_proj", "up_proj")]
            for lin, srcs, cols in ((attn.qkv, qkv, hid), (attn.o, [(f"{p}self_attn.o_proj", hid)], q),
                                    (mlp.gate_up, mlp_in, hid), (mlp.down, [(f"{p}mlp.down_proj", hid)], inter)):
                out.append((lin, [(f"{n}.weight", (r, cols)) for n, r in srcs], [(f"{n}.bias", (r,)) for n, r in srcs]))
        if not cfg.tie_word_embeddings:
            out.append((self.lm_head, [("lm_head.weight", (cfg.vocab_size, hid))], []))
        else:
            out.append((self.lm_head, [], []))
        return out


def _copy_rows(dst: torch.Tensor, parts: list[torch.Tensor]) -> None:
    lo = 0
    for t in parts:
        dst[lo : lo + t.shape[0]].copy_(t)
        lo += t.shape[0]
