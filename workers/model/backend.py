"""How a rank computes the model's elementwise ops and attention, chosen once at load.

As vLLM's `CustomOp` picks `forward_native` or `forward_cpu` once per op, a rank picks one backend
object before it builds the model, and every layer holds it: no flags on modules, no booleans
threaded through calls, no environment switches.

- `TorchBackend`: torch ops only (GPU without Triton, and CPU with `cpu_kernels: off` or where the
  kernels cannot load). Decodes attend through a mask, prefill chunks through SDPA.
- `CudaBackend`: torch ops plus Triton kernels on CUDA (workers/attention/triton_fused.py,
  triton_decode.py, triton_prefill.py): residual add + RMSNorm in one launch, RoPE on q and k with
  the K/V cache write in one, SiLU-and-multiply in one, and paged attention that reads the cache
  in place in every step (workers/attention/gpu_paged.py: the decode kernel, and varlen flash
  attention for prefill chunks). A Llama layer's decode: its 4 GEMMs, 4 fused kernels and 1-2
  attention kernels (split + merge), against ~20 more elementwise launches with torch ops
  (bench/kernels/decode_kernel_count.py counts them on a GPU).
- `CpuKernelBackend`: tpserve's C++ kernels (workers/cpu/kernels.py) for the norms (fused with the
  residual add), the rotary embedding, SiLU-and-multiply, the KV write, paged decode attention
  (the runner gives decodes context lengths instead of a mask), optionally the flash prefill
  attention, the sampler's argmax, and the C++ layer loop where the model allows it.

All give the same roundings: the residual stream is added in the model dtype, then normed (the
Triton rotary alone rounds once where torch rounds each product: workers/attention/triton_fused.py).
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F

from workers.attention.cpu_prefill_choice import DEFAULT_HEADS, prefill_kernel_serves
from workers.attention.paged import AttentionMetadata, paged_attention, write_kv
from workers.cpu import kernels
from workers.sampling.sampler import torch_row_max

logger = logging.getLogger(__name__)


class TorchBackend:
    """Torch ops for every device (forward_native)."""

    name = "torch"
    # Decodes get context lengths (the decode kernel reads blocks in place) instead of a mask.
    decode_context_lens = False
    # Prefill chunks come with an int32 chunk table (the prefill kernel and the layer stack read it).
    prefill_chunk_table = False
    # Prefill chunks go through the kernels' flash attention over the paged cache.
    prefill_attention = False
    # The decoder's layer loop may run as one C++ call (workers/model/cpu_layer_stack.py).
    layer_stack = False
    # Prefill chunks after cached context come with a dense [query_len, context_len] mask (SDPA
    # needs it); backends whose kernels take the chunk table instead go without.
    dense_prefill_masks = True

    def rms_norm(self, norm, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) * (offset + w): Llama's (offset 0) in the input dtype, Gemma's (offset 1) in
        float32 before the cast back, as HF computes them."""
        if not norm.offset:
            return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
        scaled = F.rms_norm(x.float(), (x.shape[-1],), None, norm.eps) * (norm.offset + norm.weight.float())
        return scaled.to(x.dtype)

    def add_rms_norm(self, norm, residual: torch.Tensor | None, x: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), the sum in the model dtype (vLLM's residual passing);
        residual None: x starts the stream (the embedding)."""
        residual = x if residual is None else residual + x
        return self.rms_norm(norm, residual), residual

    def rotary(self, rotary, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(positions, q, k)

    def act_and_mul(self, act, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up for the gate-up projection's [.., 2 * I] output."""
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(k_cache, v_cache, k, v, slot_mapping)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                  soft_cap: float | None = None) -> torch.Tensor:
        """Write this step's K/V into the paged cache, then attend (workers/attention/paged.py):
        q [T, H, D], k/v [T, KVH, D] -> [T, H * D]."""
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, soft_cap)

    def rope_attention(self, rotary, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                       sliding_window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
        """RoPE on q/k, then `attention` (which writes K/V): a layer's whole attention after the
        projections and q/k norms. Backends that fuse the rotary with the KV write override it."""
        q, k = self.rotary(rotary, positions, q, k)
        return self.attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, soft_cap)

    def row_max(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's max and its first index (the sampler's argmax)."""
        return torch_row_max(x)


class CudaBackend(TorchBackend):
    """Triton kernels on CUDA where they cut launches or avoid gathers; torch for the rest.

    `kernels` is the module of fused kernels (workers/attention/triton_fused.py); a test may pass a
    stand-in with the same functions to count calls."""

    name = "cuda"
    # Decodes and prefill chunks are addressed by lengths and block tables on the device (the
    # Triton decode kernel and varlen flash attention read the cache in place), never by masks.
    decode_context_lens = True
    prefill_chunk_table = True
    prefill_attention = True
    dense_prefill_masks = False

    def __init__(self, kernels=None, prefill_kernels=None) -> None:
        if kernels is None:
            from workers.attention import triton_fused as kernels
        if prefill_kernels is None:
            from workers.attention.gpu_paged import PrefillKernels

            prefill_kernels = PrefillKernels()
        self._kernels = kernels
        self._prefill = prefill_kernels

    def rms_norm(self, norm, x):
        return self._kernels.rms_norm(x, norm.weight, norm.eps, norm.offset)

    def add_rms_norm(self, norm, residual, x):
        if residual is None:
            return self.rms_norm(norm, x), x
        return self._kernels.add_rms_norm(residual, x, norm.weight, norm.eps, norm.offset)

    def rotary(self, rotary, positions, q, k):
        # In place on the layer's fresh qkv buffer (or on the q/k norms' outputs).
        self._kernels.rotary_write_kv(positions, q, k, None, rotary.cos, rotary.sin)
        return q, k

    def act_and_mul(self, act, gate_up):
        if act is not F.silu:
            return super().act_and_mul(act, gate_up)
        return self._kernels.silu_and_mul(gate_up)

    def attention(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None, soft_cap=None):
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, scale, sliding_window, soft_cap)

    def rope_attention(self, rotary, positions, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None,
                       soft_cap=None):
        # One launch: q and k rotated in place, the rotated k and v stored in their cache slots.
        self._kernels.rotary_write_kv(positions, q, k, v, rotary.cos, rotary.sin, k_cache, v_cache,
                                      meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, scale, sliding_window, soft_cap)

    def _attend(self, q, k_cache, v_cache, meta, scale, sliding_window, soft_cap):
        from workers.attention.gpu_paged import cuda_paged_attention

        return cuda_paged_attention(q, k_cache, v_cache, meta, scale, sliding_window, soft_cap, self._prefill)


class CpuKernelBackend(TorchBackend):
    """tpserve's C++ kernels on CPU (forward_cpu); what they do not take falls back to torch."""

    name = "cpu_kernels"
    decode_context_lens = True
    prefill_chunk_table = True

    def __init__(self, prefill_attention: bool, layer_stack: bool) -> None:
        self.prefill_attention = prefill_attention
        self.layer_stack = layer_stack
        self._ops = kernels.ops()

    def rms_norm(self, norm, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # per-head q/k norms: [T, H, D]
            return super().rms_norm(norm, x)
        return self._ops.rms_norm(x, norm.weight, norm.eps, norm.offset)

    def add_rms_norm(self, norm, residual, x):
        if residual is None:
            return self.rms_norm(norm, x), x
        residual, normed = self._ops.add_rms_norm(residual, x, norm.weight, norm.eps, norm.offset)
        return normed, residual

    def rotary(self, rotary, positions, q, k):
        # In place on the layer's fresh qkv buffer (or on the q/k norms' outputs).
        self._ops.rotary_(q, k, positions, rotary.cos, rotary.sin)
        return q, k

    def act_and_mul(self, act, gate_up):
        if act is not F.silu:
            return super().act_and_mul(act, gate_up)
        return self._ops.silu_and_mul(gate_up)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        self._ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)

    def row_max(self, x):
        # The kernel's row_max: the same values and indices, 5x faster again (64 rows: 3.2 -> 0.64
        # ms on a 2-core Xeon; csrc/row_max.cpp).
        if x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.size(1) > 0:
            return self._ops.row_max(x)
        return super().row_max(x)


TORCH = TorchBackend()


def select_backend(device: torch.device, dtype: torch.dtype, cpu_kernels: str = "auto",
                   prefill_attention: bool = True, layer_stack: bool = True,
                   heads: tuple[int, int, int] = DEFAULT_HEADS) -> TorchBackend:
    """The backend of a rank on `device`, decided once. cpu_kernels: the config's auto | on | off
    (on raises kernels.KernelsUnavailable where they cannot load). prefill_attention: the kernel
    where workers.attention.cpu_prefill_choice.prefill_kernel_serves says the kernel beats SDPA (float32
    always; bf16 on AMX builds, and without AMX where timed faster at the rank's `heads`: query
    heads, KV heads, head_dim).
    CUDA: `CudaBackend` where Triton is installed (CUDA builds of torch ship it), else torch ops."""
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            logger.warning("triton is not installed: GPU layers run on torch ops (more launches, gathered attention)")
            return TORCH
        return CudaBackend()
    if device.type != "cpu":
        return TORCH
    if not kernels.load(cpu_kernels):
        return TORCH
    return CpuKernelBackend(prefill_attention=prefill_attention and prefill_kernel_serves(dtype, heads),
                            layer_stack=layer_stack)
