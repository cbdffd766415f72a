"""Linear layers on CPU through oneDNN with prepacked weights (issue 11, lever 5).

`F.linear` on CPU re-lays the weight out for oneDNN's GEMM on every call; packing it once after
loading (`mkldnn._reorder_linear_weight`, the route inductor's weight freezing takes) and calling
`mkldnn._linear_pointwise` skips that. Measured on this 2-core AVX512-BF16 machine with the
default model's 30 layers of distinct (cache-cold) weights, bf16, per pass over all projections:
16 rows 22.0 -> 14.1 ms, 64 rows 28.9 -> 19.5 ms, 256 rows 58.5 -> 38.4 ms. bf16 results are
bit-identical to `F.linear`; float32 ones agree to 1e-5 (F.linear sums a single row in another
order). Checked in tests/test_cpu_linear.py, with an engine's greedy tokens equal either way.

A layer holds `packed_weight` (None = plain `F.linear`); `linear()` dispatches on it.

Few rows (a decode step at low concurrency, float32) go to tpserve's `skinny_linear` kernel
instead (workers/csrc/skinny_linear.cpp) on the plain weight: 1-8 rows are bound by how fast the
weights stream from memory, which oneDNN's GEMM does at about two thirds of the speed that kernel
reaches (1.3-1.5x slower, measured on a 2-core AMD EPYC over the default model's projections), and
9-48 rows by FMAs, where its register tiles beat oneDNN by 1.05-1.16x. That costs a second copy
of each projection weight (the plain one is kept beside the packed one; an LM head tied to the
embedding shares the table it already keeps):
`small_batch_rows` on the layer says up to how many rows (0 = never, and no second copy).
In bf16 the same kernel has a one-pass loop of AVX512-BF16 dot products for 1-8 rows, where
oneDNN (on AMX on a Xeon) streamed the weights at 7-11 GB/s against a plain read's 14: an
in-process bf16 decode step of the default model went 39.1 -> 24.0 ms at 1 request, 36.0 -> 25.8
at 4, 40.7 -> 34.4 at 8 on a 2-core Xeon; above 8 rows AMX wins.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# oneDNN blocks the packed layout for a typical row count; any count works with it, and a hint
# below 16 rows was measured to round bf16 results differently from F.linear.
PACK_BATCH_HINT = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed_weight: torch.Tensor | None, small_batch_rows: int = 0) -> torch.Tensor:
    if packed_weight is None:
        return F.linear(x, weight, bias)
    if x.dim() == 2 and 0 < x.size(0) <= small_batch_rows:
        return torch.ops.tpserve_cpu.skinny_linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing exists for CPU float32 always, bf16 where the CPU has the instructions."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def prepack_linears(model: nn.Module, small_batch_rows: int = 0) -> int:
    """Pack the weight of every layer that has a `packed_weight` slot; returns how many.

    small_batch_rows > 0 (float32 or, with AVX512-BF16, bf16 weights, tpserve's CPU kernels loaded:
    the caller checks): batches
    of up to that many rows run `skinny_linear` on the plain weight, which is then kept. Otherwise a
    weight no other module uses is dropped (the packed copy replaces it); one that is shared (an LM
    head tied to the embedding table) is kept for its other user."""
    layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
    packable_ids = {id(m) for m in layers}
    shared = {p.data_ptr() for m in model.modules() if id(m) not in packable_ids
              for p in m.parameters(recurse=False)}
    second_copy_bytes = 0
    for layer in layers:
        weight = layer.weight
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        layer.small_batch_rows = small_batch_rows
        if weight.data_ptr() in shared:
            continue
        if small_batch_rows > 0:
            second_copy_bytes += weight.numel() * weight.element_size()
        else:
            # Keep the parameter (its dtype and name stay visible) but free its storage.
            weight.data = torch.empty(0, dtype=weight.dtype)
    if second_copy_bytes:
        logger.info("kept the plain projection weights beside the packed ones for batches of up to %d rows "
                    "(skinny_linear): %.0f MiB more", small_batch_rows, second_copy_bytes / 2**20)
    return len(layers)
