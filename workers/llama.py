"""Llama-family decoder (Llama 2/3, SmolLM, TinyLlama, Mistral without sliding window).

The forward takes one flat batch of tokens from many requests (prefill chunks and decode tokens
mixed), addressed through AttentionMetadata; layers are tensor-parallel and own their shards.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from workers.attention import AttentionMetadata, paged_attention
from workers.model_config import ModelConfig
from workers.parallel_state import TPGroup
from workers.rotary import RotaryEmbedding
from workers.tp_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, tp, cfg.attention_bias, dtype)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, tp,
                                        cfg.attention_bias, dtype)
        self.rotary = rotary
        self.scale = cfg.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp, cfg.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, cfg.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, tp, rotary, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, tp, dtype)

    def forward(self, positions, x, kv_cache, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# checkpoint name suffix -> (our module path suffix, shard id)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                 cfg.rope_theta, cfg.rope_scaling, dtype)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp, rotary, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(positions, x, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.compute_logits(hidden)

    # ---- weights ------------------------------------------------------------------------
    def load_weights(self, folder: str | Path) -> int:
        """Copy this rank's slices from every *.safetensors file; returns bytes read into params."""
        params = dict(self.named_parameters(remove_duplicate=False))
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        loaded_names: set[str] = set()
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    target = self._target(name)
                    if target is None:
                        continue
                    param_name, shard_id = target
                    param = params[param_name]
                    module = self.get_submodule(param_name.rsplit(".", 1)[0])
                    loader = getattr(module, "weight_loader", None)
                    sliced = f.get_slice(name)
                    if loader is not None:
                        loader(param, sliced, shard_id)
                    else:
                        param.data.copy_(sliced[:])
                    loaded_names.add(param_name)
        missing = {n for n in params if n not in loaded_names}
        if self.cfg.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint in {folder} lacks weights for: {sorted(missing)[:5]}")
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def _target(self, name: str) -> tuple[str, int] | None:
        if "rotary_emb" in name:
            return None
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None
        for ckpt, (ours, shard_id) in _STACKED.items():
            if f".{ckpt}." in name:
                return name.replace(ckpt, ours), shard_id
        return name, 0
