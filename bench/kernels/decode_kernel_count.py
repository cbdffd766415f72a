"""GPU kernels launched per decode step and per decoder layer, torch ops against CudaBackend.

Builds a model with SmolLM2-135M's shapes (30 layers, 9 query / 3 KV heads of 64, hidden 576,
MLP 1536; or any `ModelConfig` overrides) with random weights on CUDA, once per backend, and runs
one eager decode step (no CUDA graph: the point is what a graph would replay, and what an eager
step launches) of `batch` requests at `context` tokens each, under the torch profiler. Kernels are
the profiler's CUDA kernel events (device type CUDA, not memcpy/memset); per layer is
(step - the same step's kernels outside the layers) / layers, measured as (kernels at L layers -
kernels at 1 layer) / (L - 1).

    python -m bench.kernels.decode_kernel_count [--batch 8] [--context 512]   # prints JSON

Needs a CUDA GPU (the profiler counts device kernels); `count_decode_kernels` is what the GPU
check script calls.
"""

from __future__ import annotations

import argparse
import json

import torch

from workers.attention.paged import AttentionMetadata
from workers.distributed.parallel_state import SINGLE_RANK
from workers.model.backend import TORCH, CudaBackend, TorchBackend
from workers.model.config import ModelConfig
from workers.model.decoder import build_model
from workers.runner.decode_inputs import decode_mask

SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True)
BLOCK_SIZE = 16


def _config(num_layers: int, **overrides) -> ModelConfig:
    fields = {**SMOLLM2_SHAPES, **overrides}
    return ModelConfig(path="", architecture="LlamaForCausalLM", num_hidden_layers=num_layers, rope_scaling=None,
                       eos_token_id=None, eos_token_ids=(), **fields)


def _decode_step_kernels(backend: TorchBackend, num_layers: int, batch: int, context: int, dtype: torch.dtype,
                         device: torch.device, **overrides) -> int:
    """CUDA kernels of one eager decode step's forward (embedding to final norm)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = _config(num_layers, **overrides)
    with torch.device(device):
        model = build_model(cfg, SINGLE_RANK, dtype, max_positions=context + 1, backend=backend)
    model.load_dummy_weights(0)
    blocks_per_req = -(-context // BLOCK_SIZE)
    num_blocks = 1 + batch * blocks_per_req
    kv_shape = (num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(kv_shape, dtype=dtype, device=device), torch.zeros(kv_shape, dtype=dtype, device=device))
              for _ in range(num_layers)]
    tables = torch.arange(1, num_blocks, device=device).view(batch, blocks_per_req)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    positions = lens.long() - 1
    slots = tables[:, -1] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    in_place = backend.decode_context_lens
    meta = AttentionMetadata(
        slot_mapping=slots, num_decodes=batch, decode_block_tables=tables,
        decode_mask=None if in_place else decode_mask(lens, blocks_per_req * BLOCK_SIZE), prefills=[],
        decode_context_lens=lens if in_place else None)
    input_ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)
    with torch.inference_mode():
        for _ in range(2):  # compile the Triton kernels, warm cuBLAS
            model(input_ids, positions, caches, meta)
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(input_ids, positions, caches, meta)
            torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.lower().startswith(("memcpy", "memset"))]
    return len(kernels)


def count_decode_kernels(batch: int = 8, context: int = 512, dtype: torch.dtype = torch.bfloat16,
                         num_layers: int = 4, device: str = "cuda") -> dict:
    """{backend: {"per_step": kernels of a num_layers-layer step, "per_layer": kernels per decoder
    layer}} for torch ops and CudaBackend."""
    dev = torch.device(device)
    result = {"batch": batch, "context": context, "dtype": str(dtype), "layers": num_layers}
    for name, make in (("torch", lambda: TORCH), ("cuda", CudaBackend)):
        step = _decode_step_kernels(make(), num_layers, batch, context, dtype, dev)
        one = _decode_step_kernels(make(), 1, batch, context, dtype, dev)
        result[name] = {"per_step": step, "per_layer": (step - one) / (num_layers - 1)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(json.dumps(count_decode_kernels(args.batch, args.context, num_layers=args.layers)))


if __name__ == "__main__":
    main()
