"""The decoder's layer loop in one C++ call per step on CPU (workers/cpu/csrc/layer_stack.cpp).

The Python loop costs ~12 op dispatches and ~6 module calls per layer: on a 2-core AMD EPYC a
batch-1 decode step of the default model spent ~28% of its step thread in the interpreter and
torch's bindings between ops. `CpuLayerStack` hands the same ops, in the same order, to the
kernel library's `layer_stack`, which calls them through the dispatcher: the results are
bit-identical (tests/test_layer_stack.py), only the time between ops goes. The weights, caches and
shape constants go to C++ once, as a `LayerStack` object; a step passes only its batch.

It serves the layers the fused-residual CPU path serves (Llama-style: pre-norms, SwiGLU, no
per-head q/k norms) on one rank (a tensor-parallel rank all-reduces between ops, from Python),
one rotary table for every layer. A step's prefill chunks go through the prefill kernel (float32)
or, where that is off (bf16), through SDPA per chunk called from C++, the same calls as the Python
loop's. Anything else, and every step it does not accept, takes the Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention.paged import AttentionMetadata
from workers.cpu import kernels as cpu_ops


def unsupported_reason(layers: Sequence[nn.Module], backend_name: str, tp_world_size: int) -> str | None:
    """Why these decoder layers cannot run through the layer stack (None: they can). Built from
    the layers, not the model, so that the model can own a stack without an import circle."""
    if backend_name != "cpu_kernels":
        return "the layers do not run tpserve's CPU kernels"
    if tp_world_size != 1:
        return "tensor parallelism all-reduces between ops from Python"
    first = layers[0].self_attn
    for layer in layers:
        attn = layer.self_attn
        if layer.sandwich:
            return "sandwich norms (the stack passes the residual the Llama way)"
        if attn.q_norm is not None:
            return "per-head q/k norms"
        if attn.rotary is not first.rotary:
            return "layers with different rotary tables"
        if layer.mlp.act is not F.silu:
            return "an MLP activation other than SiLU"
        if attn.scale != first.scale or attn.soft_cap != first.soft_cap:
            return "layers with different softmax scales or soft caps"
    return None


class CpuLayerStack:
    """The flat weight list `layer_stack` reads, built once from a loaded (and prepacked) model,
    and the per-step call."""

    def __init__(self, layers: Sequence[nn.Module], backend_name: str, tp_world_size: int) -> None:
        reason = unsupported_reason(layers, backend_name, tp_world_size)
        if reason is not None:
            raise ValueError(f"the CPU layer stack cannot run this model: {reason}")
        ops = cpu_ops.ops()
        self._op = ops.layer_stack
        first = layers[0]
        attn = first.self_attn
        norm = first.input_layernorm
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.eps = norm.eps
        self.norm_offset = norm.offset
        self.scale = attn.scale
        self.soft_cap = attn.soft_cap or 0.0
        self.cos, self.sin = attn.rotary.cos, attn.rotary.sin
        self.windows = [layer.self_attn.sliding_window or 0 for layer in layers]
        # Rows up to which projections take their small-batch kernel (every linear of a model shares it).
        self.small_batch_rows = attn.qkv_proj.small_batch_rows
        self.weights: list[torch.Tensor | None] = []
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            self.weights += [layer.input_layernorm.weight]
            for linear in (a.qkv_proj, a.o_proj):
                self.weights += [linear.weight, linear.packed_weight, linear.small_batch_weight, linear.bias]
            self.weights += [layer.post_attention_layernorm.weight]
            for linear in (mlp.gate_up_proj, mlp.down_proj):
                self.weights += [linear.weight, linear.packed_weight, linear.small_batch_weight, linear.bias]
        slots = int(ops.layer_stack_slots_per_layer())
        if len(self.weights) != slots * len(layers):
            raise AssertionError(f"layer_stack reads {slots} tensors per layer; {len(self.weights) // len(layers)} built")
        # The C++ side's LayerStack (weights, caches, constants), built on the first call, when the
        # runner's caches exist, and again only if the runner hands over another cache list.
        self._state: torch.ScriptObject | None = None
        self._caches_of: list | None = None

    def state(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.ScriptObject:
        """The C++ LayerStack over these caches: everything a step passes but its batch, converted
        from Python objects once instead of on every step."""
        if self._caches_of is not kv_caches:
            self._state = torch.classes.tpserve_cpu.LayerStack(
                self.weights, [k for k, _ in kv_caches], [v for _, v in kv_caches], self.cos, self.sin, self.windows,
                self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.norm_offset, self.scale,
                self.soft_cap, self.small_batch_rows)
            self._caches_of = kv_caches
        return self._state

    def accepts(self, meta: AttentionMetadata) -> bool:
        """Whether a step's attention runs from C++: decodes with context lengths (the decode
        kernel), prefill chunks with their chunk table (the prefill kernel, or SDPA per chunk
        called from C++ as the Python loop calls it; not with a soft cap, which needs eager
        attention)."""
        if meta.gpu_decode is not None:
            return False
        if meta.num_decodes and meta.decode_context_lens is None:
            return False
        if not meta.prefills:
            return True
        return meta.prefill_chunk_info is not None and (meta.prefill_kernel or not self.soft_cap)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's MLP output and the residual stream (the final norm adds them)."""
        return self._op(self.state(kv_caches), x, positions, meta.slot_mapping, meta.decode_block_tables,
                        meta.decode_context_lens, meta.prefill_block_tables, meta.prefill_chunk_info,
                        meta.num_decodes, not meta.prefill_kernel)
