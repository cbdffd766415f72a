"""The building blocks of the decoder, with the options that tell the families apart.

Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 differ only in switches here: biases on the
projections, per-head q/k norms, the MLP activation, Gemma's (1 + w) norms, the softmax scale,
attention soft-capping and a per-layer sliding window (all read from `ModelConfig`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention.paged import AttentionMetadata
from workers.distributed.parallel_state import TPGroup
from workers.model.backend import TORCH, TorchBackend
from workers.model.config import ModelConfig
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

    def __init__(self, size: int, eps: float, dtype: torch.dtype, offset: float = 0.0,
                 backend: TorchBackend = TORCH) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        init = torch.zeros(size, dtype=dtype) if offset else torch.ones(size, dtype=dtype)
        self.weight = nn.Parameter(init, requires_grad=False)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(self, x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's pre-norms: (norm(residual + x), residual + x); residual None: x starts
        the stream (the embedding)."""
        return self.backend.add_rms_norm(self, residual, x)


def make_norm(cfg: ModelConfig, size: int, dtype: torch.dtype, backend: TorchBackend = TORCH) -> RMSNorm:
    return RMSNorm(size, cfg.rms_norm_eps, dtype, cfg.norm_weight_offset, backend)


class DecoderAttention(nn.Module):
    """QKV projection (heads split across ranks) -> optional q/k norms -> RoPE -> paged attention
    (with this layer's window and soft cap) -> row-parallel output projection."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, rotary: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window: int | None, backend: TorchBackend = TORCH) -> None:
        super().__init__()
        self.backend = backend
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, tp, cfg.qkv_bias, dtype)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, tp,
                                        cfg.o_proj_bias, dtype)
        # Per-head norms act on head_dim, so every rank holds them whole.
        self.q_norm = make_norm(cfg, cfg.head_dim, dtype, backend) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim, dtype, backend) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.softmax_scale
        self.sliding_window = sliding_window
        self.soft_cap = cfg.attn_logit_softcap

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
        out = self.backend.rope_attention(self.rotary, positions, q, k, v, kv_cache[0], kv_cache[1], meta,
                                          self.scale, self.sliding_window, self.soft_cap)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu-tanh."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, backend: TorchBackend = TORCH) -> None:
        super().__init__()
        self.backend = backend
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"MLP activation {cfg.hidden_act!r} is not supported ({', '.join(_ACTIVATIONS)} are)")
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp, cfg.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, cfg.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.act_and_mul(self.act, self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block with the residual stream passed apart (vLLM's residual passing):
    the layer returns its last branch's output and the stream, and the next pre-norm adds them.
    Llama-style: x += attn(norm(x)); x += mlp(norm(x)).
    Gemma's sandwich: x += post_attn_norm(attn(norm(x))); x += post_ff_norm(mlp(pre_ff_norm(x))).
    Module names follow the checkpoints (Gemma's post_attention_layernorm is after attention,
    Llama's is before the MLP)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, rotary: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window: int | None, backend: TorchBackend = TORCH) -> None:
        super().__init__()
        self.sandwich = cfg.sandwich_norms
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, dtype, backend)
        self.self_attn = DecoderAttention(cfg, tp, rotary, dtype, sliding_window, backend)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, dtype, backend)
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, dtype, backend)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, dtype, backend)
        self.mlp = GatedMLP(cfg, tp, dtype, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, kv_cache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's branch output (or the embedding, with residual None)."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn = self.self_attn(positions, h, kv_cache, meta)
        if not self.sandwich:
            h, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
            return self.mlp(h), residual
        h, residual = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(attn), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual
