"""The building blocks of the decoder, with the options that tell the families apart.

Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 differ only in switches here: biases on the
projections, per-head q/k norms, the MLP activation, Gemma's (1 + w) norms, the softmax scale,
attention soft-capping and a per-layer sliding window (all read from `ModelConfig`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.cpu import kernels as cpu_ops
from workers.attention.paged import AttentionMetadata, paged_attention
from workers.model.config import ModelConfig
from workers.distributed.parallel_state import TPGroup
from workers.model.rotary import RotaryEmbedding
from workers.model.tp_layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + w). Llama: offset 0, scaled in the input dtype; Gemma: offset 1
    (checkpoints store w - 1), scaled in float32 before the cast back, as HF does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        init = torch.zeros(size, dtype=dtype) if offset else torch.ones(size, dtype=dtype)
        self.weight = nn.Parameter(init, requires_grad=False)
        # tpserve's CPU kernel for [tokens, size] inputs (workers/cpu/kernels.py); set by
        # DecoderForCausalLM.use_cpu_kernels.
        self.cpu_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel and x.dim() == 2:
            return cpu_ops.ops().rms_norm(x, self.weight, self.eps, self.offset)
        if not self.offset:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        scaled = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * (self.offset + self.weight.float())
        return scaled.to(x.dtype)


def make_norm(cfg: ModelConfig, size: int, dtype: torch.dtype) -> RMSNorm:
    return RMSNorm(size, cfg.rms_norm_eps, dtype, cfg.norm_weight_offset)


class DecoderAttention(nn.Module):
    """QKV projection (heads split across ranks) -> optional q/k norms -> RoPE -> paged attention
    (with this layer's window and soft cap) -> row-parallel output projection."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, rotary: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, tp, cfg.qkv_bias, dtype)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, tp,
                                        cfg.o_proj_bias, dtype)
        # Per-head norms act on head_dim, so every rank holds them whole.
        self.q_norm = make_norm(cfg, cfg.head_dim, dtype) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim, dtype) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.softmax_scale
        self.sliding_window = sliding_window
        self.soft_cap = cfg.attn_logit_softcap
        # CPU kernels for the rotary embedding and the KV write (set by use_cpu_kernels).
        self.cpu_kernel = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cpu_kernel:
            # In place on this layer's fresh qkv buffer (or on the q/k norms' outputs).
            cpu_ops.ops().rotary_(q, k, positions, self.rotary.cos, self.rotary.sin)
        else:
            q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                              sliding_window=self.sliding_window, soft_cap=self.soft_cap,
                              cpu_kernels=self.cpu_kernel)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu-tanh."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"MLP activation {cfg.hidden_act!r} is not supported ({', '.join(_ACTIVATIONS)} are)")
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp, cfg.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, cfg.mlp_bias, dtype)
        # The CPU kernel's fused SiLU-and-multiply (SwiGLU only; set by use_cpu_kernels).
        self.silu_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu_kernel:
            return self.down_proj(cpu_ops.ops().silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block. Llama-style: x += attn(norm(x)); x += mlp(norm(x)).
    Gemma's sandwich: x += post_attn_norm(attn(norm(x))); x += post_ff_norm(mlp(pre_ff_norm(x))).
    Module names follow the checkpoints (Gemma's post_attention_layernorm is after attention,
    Llama's is before the MLP)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, rotary: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.sandwich = cfg.sandwich_norms
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, dtype)
        self.self_attn = DecoderAttention(cfg, tp, rotary, dtype, sliding_window)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, dtype)
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, dtype)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, dtype)
        self.mlp = GatedMLP(cfg, tp, dtype)

    def forward(self, positions, x, kv_cache, meta):
        attn = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        if not self.sandwich:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def forward_fused_residual(layer: DecoderLayer, positions: torch.Tensor, x: torch.Tensor,
                           residual: torch.Tensor | None, kv_cache, meta: AttentionMetadata
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A Llama-style layer with the CPU kernels' add + RMSNorm (vLLM's residual passing): the
    layer returns its MLP output and the residual stream apart, and the next layer's input norm
    adds them in the same pass. residual None: x is the embedding (the first layer).
    Same roundings as `DecoderLayer.forward`: residual = x + branch in the model dtype, then norm."""
    ops = cpu_ops.ops()
    norm = layer.input_layernorm
    if residual is None:
        residual, h = x, norm(x)
    else:
        residual, h = ops.add_rms_norm(residual, x, norm.weight, norm.eps, norm.offset)
    attn = layer.self_attn(positions, h, kv_cache, meta)
    post = layer.post_attention_layernorm
    residual, h = ops.add_rms_norm(residual, attn, post.weight, post.eps, post.offset)
    return layer.mlp(h), residual
