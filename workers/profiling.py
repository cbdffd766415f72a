"""Activation-peak profiling for GPU KV sizing: one forward at the largest token budget."""

from __future__ import annotations

import torch

from workers.attention import AttentionMetadata, PrefillChunk


def profile_activation_peak(model, device: torch.device, config) -> int:
    """Run a throwaway prefill of max_model_len tokens (capped) into a one-block-per-16 scratch
    cache and return the peak bytes allocated beyond what was allocated before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    num_tokens = min(config.max_model_len, 8192)
    bs = config.block_size
    num_blocks = -(-num_tokens // bs) + 1
    spec_layer = model.layers[0].self_attn
    shape = (num_blocks, bs, spec_layer.num_kv_heads, spec_layer.head_dim)
    scratch = [(torch.zeros(shape, dtype=config.dtype, device=device),
                torch.zeros(shape, dtype=config.dtype, device=device)) for _ in model.layers]
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    pos = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(bs, bs + num_tokens, device=device),
        num_decodes=0, decode_block_tables=None, decode_mask=None,
        prefills=[PrefillChunk(0, num_tokens, num_tokens, torch.arange(1, num_blocks, device=device), None)],
    )
    with torch.inference_mode():
        hidden = model(ids, pos, scratch, meta)
        model.compute_logits(hidden[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del scratch, hidden
    torch.cuda.empty_cache()
    return int(peak)
