"""`load_format: dummy`: random weights in place of a checkpoint, from config.json alone.

Any architecture tpserve builds can then be served and benchmarked at its real shapes (Llama-3-8B
on a GPU, say) with no weight files to download or carry. The values are scaled as the HF models
initialise themselves (`initializer_range`, 0.02 for Llama and Qwen): projections and embeddings
N(0, 0.02), norms at their identity, biases zero. With those scales the residual stream grows
slowly through 32 layers and every activation stays finite in bf16 (vLLM's dummy loader draws
U(-1e-3, 1e-3), which is as safe but makes every logit nearly equal; the tokens here vary with
the context, so a dummy model's outputs still differ between requests).

Deterministic: each parameter draws from its own generator seeded with (seed, its name, the TP
rank), so a run is reproducible and no parameter's values depend on the order others were filled
in. Ranks draw their shards independently: the sharded model is not a slice of one unsharded
model, which a benchmark does not need.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

# Standard deviation of projections and embeddings (HF's default `initializer_range`).
INIT_STD = 0.02
# Seed used when the caller gives none.
DEFAULT_SEED = 0


def _is_norm(name: str, param: torch.Tensor) -> bool:
    """RMSNorm weights (per layer, final, and the per-head q/k norms): one vector, "norm" in the name."""
    leaf = name.rsplit(".", 2)[-2] if "." in name else name
    return param.dim() == 1 and "norm" in leaf


def _generator(seed: int, name: str, rank: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    # crc32, not hash(): Python salts str hashes per process.
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) * 131 + rank) % (1 << 63))
    return gen


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = DEFAULT_SEED, rank: int = 0,
                       norm_weight_offset: float = 0.0) -> int:
    """Fill every parameter of `model` in place; returns the bytes of its parameters.

    `norm_weight_offset`: Gemma's norms multiply by (1 + weight), so their identity is weight 0.
    Tied parameters (the LM head sharing the embedding) are filled once.
    """
    for name, param in model.named_parameters():  # remove_duplicate: a tied weight once
        if name.endswith("bias"):
            param.zero_()
        elif _is_norm(name, param):
            param.fill_(1.0 - norm_weight_offset)
        else:
            gen = _generator(seed, name, rank, param.device)
            # Drawn in float32 and cast, so a seed gives the same values in every weight dtype.
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            values.normal_(0.0, INIT_STD, generator=gen)
            param.copy_(values)
    return sum(p.numel() * p.element_size() for p in model.parameters())
