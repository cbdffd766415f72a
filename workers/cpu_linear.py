"""Linear layers on CPU through oneDNN with prepacked weights (issue 11, lever 5).

`F.linear` on CPU re-lays the weight out for oneDNN's GEMM on every call; packing it once after
loading (`mkldnn._reorder_linear_weight`, the route inductor's weight freezing takes) and calling
`mkldnn._linear_pointwise` skips that. Measured on this 2-core AVX512-BF16 machine with the
default model's 30 layers of distinct (cache-cold) weights, bf16, per pass over all projections:
16 rows 22.0 -> 14.1 ms, 64 rows 28.9 -> 19.5 ms, 256 rows 58.5 -> 38.4 ms. bf16 results are
bit-identical to `F.linear`; float32 ones agree to 1e-5 (F.linear sums a single row in another
order). Checked in tests/test_cpu_linear.py, with an engine's greedy tokens equal either way.

A layer holds `packed_weight` (None = plain `F.linear`); `linear()` dispatches on it.

Few rows (a decode step at low concurrency) go to one of tpserve's kernels instead, on the
layer's `small_batch_weight`, up to `small_batch_rows` rows (0 = never, and no such weight):
- float32: `skinny_linear` (workers/csrc/skinny_linear.cpp) on the plain weight. 1-8 rows are
  bound by how fast the weights stream from memory, which oneDNN's GEMM does at about two thirds
  of the speed that kernel reaches (1.3-1.8x slower, measured on 2-core AMD EPYCs, Zen 1 and
  Zen 3, over the default model's projections). 9-48 rows are bound by FMAs, and there the CPU
  decides: on Zen 1 (256-bit FMAs split in two) its register tiles beat oneDNN by 1.05-1.16x, on
  Zen 3 oneDNN beat them by 1.2-1.5x (12-48 rows, 30 layers cache-cold). So above 8 rows the two
  are timed against each other once per process at load (`calibrate_skinny_rows`). That costs a
  second copy of each projection weight (the plain one is kept beside the packed one; an LM head
  tied to the embedding shares the table it already keeps).
- bf16 with AMX (a Xeon since Sapphire Rapids): `amx_linear` (workers/csrc/amx_linear.cpp) on a
  copy of the weight in AMX tile order, 1-64 rows: 1.3-1.9x oneDNN's speed at 1-32 rows, 1.0-1.2x
  at 48-64 (the file says how); the plain weight is then dropped like in the packed-only case.
- bf16 with AVX512-BF16 but no AMX: `skinny_linear`'s one-pass loop of AVX512-BF16 dot products
  on the plain weight for 1-8 rows (on a Xeon, before amx_linear, it took an in-process decode
  step of the default model from 39.1 to 24.0 ms at 1 request, 36.0 to 25.8 at 4).
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# oneDNN blocks the packed layout for a typical row count; any count works with it, and a hint
# below 16 rows was measured to round bf16 results differently from F.linear.
PACK_BATCH_HINT = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed_weight: torch.Tensor | None, small_batch_rows: int = 0,
           small_batch_weight: torch.Tensor | None = None) -> torch.Tensor:
    if packed_weight is None:
        return F.linear(x, weight, bias)
    if small_batch_weight is not None and x.dim() == 2 and 0 < x.size(0) <= small_batch_rows:
        return small_batch_linear(x, small_batch_weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def small_batch_linear(x: torch.Tensor, small_batch_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel the small-batch weight is laid out for: AMX tile order is 4-D
    ([N/16, K/32, 16, 32], amx_linear), a plain weight 2-D (skinny_linear)."""
    if small_batch_weight.dim() == 4:
        return torch.ops.tpserve_cpu.amx_linear(x, small_batch_weight, bias)
    return torch.ops.tpserve_cpu.skinny_linear(x, small_batch_weight, bias)


# Rows up to which skinny_linear runs its one-pass loop (workers/csrc/skinny_linear.cpp): bound by
# streaming the weights, where it led oneDNN on every CPU measured, so it is never timed.
SKINNY_ONE_PASS_ROWS = 8
# Row counts at which skinny_linear's register tiles are timed against oneDNN at load.
SKINNY_TILE_PROBES = (12, 16, 24, 32, 48)
# Timed calls per kernel and probe (alternated; the fastest of each counts).
CALIBRATION_REPEATS = 5


def choose_skinny_rows(skinny_faster: dict[int, bool], max_rows: int) -> int:
    """The largest probed row count up to which skinny_linear was faster at every probe, at
    least the one-pass rows, at most max_rows (what the kernel serves)."""
    rows = min(SKINNY_ONE_PASS_ROWS, max_rows)
    for probe in sorted(skinny_faster):
        if probe > max_rows or not skinny_faster[probe]:
            break
        rows = probe
    return rows


@functools.lru_cache(maxsize=None)
def calibrate_skinny_rows(out_features: int, in_features: int, max_rows: int) -> tuple[int, tuple]:
    """skinny_linear's row limit on this CPU for float32 weights of [out_features, in_features]
    (a model's largest projection): both kernels timed at each probe row count on a random
    weight. Returns (rows, ((probe, skinny s, oneDNN s), ...)). Once per shape and process."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    faster, timings = {}, []
    for probe in SKINNY_TILE_PROBES:
        if probe > max_rows:
            break
        x = torch.randn(probe, in_features, generator=gen)
        kernels = {"skinny": lambda: torch.ops.tpserve_cpu.skinny_linear(x, weight, None),
                   "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
        best = dict.fromkeys(kernels, float("inf"))
        for repeat in range(CALIBRATION_REPEATS + 1):  # the first of each is a warm-up
            for name in (kernels if repeat % 2 else reversed(list(kernels))):
                start = time.perf_counter()
                kernels[name]()
                if repeat:
                    best[name] = min(best[name], time.perf_counter() - start)
        faster[probe] = best["skinny"] <= best["onednn"]
        timings.append((probe, best["skinny"], best["onednn"]))
    rows = choose_skinny_rows(faster, max_rows)
    logger.info("skinny_linear takes float32 batches of up to %d rows, oneDNN above (timed at load on a %d x %d "
                "weight, rows: skinny / oneDNN ms: %s)", rows, out_features, in_features,
                ", ".join(f"{m}: {1e3 * a:.2f} / {1e3 * b:.2f}" for m, a, b in timings))
    return rows, tuple(timings)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing exists for CPU float32 always, bf16 where the CPU has the instructions."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def prepack_linears(model: nn.Module, small_batch_rows: int = 0, amx: bool = False) -> int:
    """Pack the weight of every layer that has a `packed_weight` slot; returns how many.

    small_batch_rows > 0 (tpserve's CPU kernels loaded, the dtype one of theirs: the caller
    checks): batches of up to that many rows run a small-batch kernel on `small_batch_weight`:
    with `amx` (bf16 weights on a CPU with AMX) a copy in AMX tile order for amx_linear, else the
    plain weight for skinny_linear, which is then kept. A weight no small-batch kernel reads and no
    other module uses is dropped (the packed copy replaces it); one that is shared (an LM head tied
    to the embedding table) is kept for its other user."""
    layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
    packable_ids = {id(m) for m in layers}
    shared = {p.data_ptr() for m in model.modules() if id(m) not in packable_ids
              for p in m.parameters(recurse=False)}
    extra_bytes = 0
    for layer in layers:
        weight = layer.weight
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        layer.small_batch_rows = small_batch_rows
        if small_batch_rows > 0 and amx:
            layer.small_batch_weight = torch.ops.tpserve_cpu.amx_pack_weight(weight.detach())
            extra_bytes += layer.small_batch_weight.numel() * layer.small_batch_weight.element_size()
        elif small_batch_rows > 0:
            layer.small_batch_weight = weight.detach()
            if weight.data_ptr() not in shared:
                extra_bytes += weight.numel() * weight.element_size()
        if weight.data_ptr() not in shared and (small_batch_rows == 0 or amx):
            # Keep the parameter (its dtype and name stay visible) but free its storage.
            weight.data = torch.empty(0, dtype=weight.dtype)
    if extra_bytes:
        logger.info("kept a copy of each projection weight beside the packed one for batches of up to %d rows "
                    "(%s): %.0f MiB more", small_batch_rows, "amx_linear" if amx else "skinny_linear",
                    extra_bytes / 2**20)
    return len(layers)


def amx_packable(model: nn.Module) -> bool:
    """Whether amx_pack_weight takes every projection of the model: output features a multiple
    of 16 (all the supported models' are, TP shards included)."""
    return all(m.weight.size(0) % 16 == 0 for m in model.modules() if hasattr(m, "packed_weight"))
