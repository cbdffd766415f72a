"""The decoder-only causal LM every supported family runs through (Llama 2/3, SmolLM, Mistral,
Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 text); the family switches live in `ModelConfig`.

The forward takes one flat batch of tokens from many requests (prefill chunks and decode tokens
mixed), addressed through AttentionMetadata; layers are tensor-parallel and own their shards.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from workers import load_choices
from workers.attention.paged import AttentionMetadata
from workers.model.backend import TORCH, TorchBackend
from workers.model.cpu_layer_stack import CpuLayerStack, unsupported_reason
from workers.model.greedy_lm_head import GreedyLmHead
from workers.model.layers import DecoderLayer, make_norm
from workers.model.config import ModelConfig
from workers.distributed.parallel_state import TPGroup
from workers.model.rotary import RotaryEmbedding
from workers.model.tp_layers import ParallelLMHead, VocabParallelEmbedding

logger = logging.getLogger(__name__)

# checkpoint name suffix -> (our module path suffix, shard id)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None, backend: TorchBackend = TORCH) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        # How every layer computes its norms, rotary, activation and attention (chosen at load).
        self.backend = backend
        positions = max_positions or cfg.max_position_embeddings
        rotary = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        # Gemma 3's sliding layers rotate with their own base and no scaling.
        local_rotary = rotary if cfg.local_rope_theta is None else RotaryEmbedding(
            cfg.head_dim, positions, cfg.local_rope_theta, None, dtype)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        layers = []
        for i in range(cfg.num_hidden_layers):
            window = cfg.sliding_window_of(i)
            layers.append(DecoderLayer(cfg, tp, local_rotary if window is not None else rotary, dtype, window,
                                       backend))
        self.layers = nn.ModuleList(layers)
        self.norm = make_norm(cfg, cfg.hidden_size, dtype, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Gemma scales embeddings by sqrt(hidden) rounded to the model dtype, as HF does.
        self.embedding_multiplier = (None if cfg.embedding_multiplier is None
                                     else float(torch.tensor(cfg.embedding_multiplier, dtype=dtype)))
        # The layer loop as one call into the CPU kernels (build_layer_stack); None: Python.
        self.layer_stack: CpuLayerStack | None = None
        # Greedy tokens of small batches from an int8 copy of the LM head first
        # (build_greedy_lm_head); None: every batch computes its full logits.
        self.greedy_lm_head: GreedyLmHead | None = None

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        if self.layer_stack is not None and self.layer_stack.accepts(meta):
            x, residual = self.layer_stack(x, positions, kv_caches, meta)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm.add_and_norm(x, residual)[0]

    def build_layer_stack(self) -> bool:
        """Run the layer loop as one call into the CPU kernels where the backend asks for it and
        this model allows it (after any prepacking: the stack keeps the weights it finds now).
        Returns whether it does; why not is logged."""
        if not self.backend.layer_stack:
            return False
        reason = unsupported_reason(self.layers, self.backend.name, self.tp.world_size)
        if reason is not None:
            logger.info(load_choices.LAYER_STACK_OFF + ": %s", reason)
            return False
        self.layer_stack = CpuLayerStack(self.layers, self.backend.name, self.tp.world_size)
        return True

    def build_greedy_lm_head(self) -> bool:
        """Keep an int8 copy of the LM head for greedy batches of a few rows (after prepacking: it
        reads the head's panels or AMX tiles). Not with a final logit soft cap, whose tanh could
        round two logits to one. Returns whether it does."""
        if self.backend.name != "cpu_kernels" or self.cfg.final_logit_softcap is not None:
            return False
        self.greedy_lm_head = GreedyLmHead.build(self.lm_head, self.cfg.vocab_size, self.cfg.hidden_size,
                                                 self.tp.world_size)
        if self.greedy_lm_head is not None:
            logger.info(load_choices.GREEDY_HEAD + ": an int8 copy (%.1f MB) answers greedy batches of up to "
                        "%d rows first", self.greedy_lm_head.nbytes / 1e6, self.greedy_lm_head.max_rows)
        return self.greedy_lm_head is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head.compute_logits(hidden)
        cap = self.cfg.final_logit_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

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
                    if param_name not in params:
                        raise ValueError(f"checkpoint weight {name!r} has no place in {self.cfg.architecture} "
                                         f"as tpserve builds it (expected names like {next(iter(params))!r})")
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

    def load_dummy_weights(self, seed: int = 0) -> int:
        """`load_format: dummy`: random weights scaled like the model's own init, no files read
        (workers/model/dummy_weights.py); returns bytes of the parameters."""
        from workers.model.dummy_weights import fill_dummy_weights

        return fill_dummy_weights(self, seed=seed, rank=self.tp.rank, norm_weight_offset=self.cfg.norm_weight_offset)

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


def build_model(cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype = torch.float32,
                max_positions: int | None = None, backend: TorchBackend = TORCH) -> DecoderForCausalLM:
    """The model for cfg.architecture (every supported family is the one decoder with its options)."""
    logger.info("building %s with the %s backend", cfg.describe(), backend.name)
    return DecoderForCausalLM(cfg, tp, dtype, max_positions, backend)
