"""Linear layers on CPU through oneDNN with prepacked weights (issue 11, lever 5).

`F.linear` on CPU re-lays the weight out for oneDNN's GEMM on every call; packing it once after
loading (`mkldnn._reorder_linear_weight`, the route inductor's weight freezing takes) and calling
`mkldnn._linear_pointwise` skips that. Measured on this 2-core AVX512-BF16 machine with the
default model's 30 layers of distinct (cache-cold) weights, bf16, per pass over all projections:
16 rows 22.0 -> 14.1 ms, 64 rows 28.9 -> 19.5 ms, 256 rows 58.5 -> 38.4 ms. bf16 results are
bit-identical to `F.linear`; float32 ones agree to 1e-5 (F.linear sums a single row in another
order). Checked in tests/test_cpu_linear.py, with an engine's greedy tokens equal either way.

A layer holds `packed_weight` (None = plain `F.linear`, or no batch reaches oneDNN); `linear()`
dispatches on it.

Batches of up to `small_batch_rows` rows (0 = never, and no such weight) go to one of tpserve's
kernels instead, on the layer's `small_batch_weight`, a copy of the weight laid out for it:
- float32: `panel_linear` (workers/cpu/csrc/panel_linear.cpp) on a copy packed in panels of 16 output
  features. On a 2-core AMD EPYC Zen 3, over the default model's 30 layers of projections
  (cache-cold), it ran 1.5-1.65x oneDNN's speed at 1-8 rows (bound by the weight stream), 1.69x at
  16, 1.28x at 64 and 1.17x at 512-2048 rows. The CPU decides how far that holds, so the two are
  timed against each other once per process at load (`calibrate_panel_rows`); where the kernel
  wins every probe it takes every batch, and no oneDNN copy is made (513 MiB less for the default
  model). The plain weight is dropped as in the packed-only case.
- bf16 with AMX (a Xeon since Sapphire Rapids): `amx_linear` (workers/cpu/csrc/amx_linear.cpp) on a
  copy of the weight in AMX tile order, 1-64 rows: 1.46x oneDNN's speed at 16 rows, 1.20x at 64
  over the default model's 30 layers (the file says how, and why not above 64); the plain weight
  is then dropped like in the packed-only case.
- bf16 with AVX512-BF16 but no AMX (AMD Zen 4, Intel before Sapphire Rapids): `panel_linear` on a
  copy packed in bf16 panels, each weight widened to float32 as it loads, float32 FMAs (oneDNN's
  bf16 GEMM on such CPUs runs on `vdpbf16ps`, which a Xeon issues at half the FLOP rate of its
  FMAs). On a Xeon running the avx512_bf16 build, oneDNN capped to the same instructions, the
  default model's 30 layers cold, one thread's CPU time: 1.4x oneDNN at 1 row, 1.6-1.7x at 8-64,
  1.4x at 256, and 1.0-1.4x `skinny_linear` at 1-8 rows. Its limit is timed at load like the
  float32 one. Where that finds oneDNN faster even at 4 rows (or the build has no AVX512-BF16
  panels), `skinny_linear`'s one-pass loop of AVX512-BF16 dot products takes 1-8 rows on the plain
  weight (on a Xeon, before amx_linear, it took an in-process decode step of the default model
  from 39.1 to 24.0 ms at 1 request, 36.0 to 25.8 at 4), which is then kept.
  Where vdpbf16ps issues at its full rate (AMD Zen 4: twice the FLOPs of its 512-bit FMAs), the
  panels are packed as k-pairs instead (LAYOUT_PAIRS, [N/16, K/2, 32]) and multiplied by vdpbf16ps
  without widening anything: on a 2-core Zen 4 over 9 layers of the default model's projections
  (64 MB, cache-cold, 2 threads) 298 / 401 / 435 GFLOP/s at 16 / 64 / 256 rows, against 155 / 184 /
  188 for the widened panels and 202 / 323 / 394 for oneDNN. Which form serves is timed at load
  (`pair_panels_win`), then its row limit against oneDNN as for the widened one.
- bf16 on AVX2 without AVX-512 (AMD Zen 1-3): `panel_linear`'s 256-bit tiles on either form, float32
  FMAs on weights widened in registers (k-pairs split by a shift and a mask), for every batch:
  oneDNN has no bf16 GEMM there, and torch's F.linear in bf16 ran 9.4x slower than the panels at
  256 rows (19 vs 182 GFLOP/s, 4 layers), 1.7x at 1 row. Against float32 panels on a 2-core Zen 3,
  the default model's 30 layers cold (`bench.kernels.projection_kernels --dtype bfloat16`): 1 row
  1.83-1.87x (9.3 vs 17.3 ms: half the bytes), 16 rows 1.17-1.21x, 64 rows even, 256 rows
  0.93-0.97x (compute-bound: the widening costs FMA issue slots).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from workers import load_choices
from workers.cpu import huge_pages
from workers.cpu.timing import fastest_alternated

logger = logging.getLogger(__name__)

# oneDNN blocks the packed layout for a typical row count; any count works with it, and a hint
# below 16 rows was measured to round bf16 results differently from F.linear.
PACK_BATCH_HINT = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed_weight: torch.Tensor | None, small_batch_rows: int = 0,
           small_batch_weight: torch.Tensor | None = None) -> torch.Tensor:
    if small_batch_weight is not None and x.numel() <= small_batch_rows * x.size(-1):
        return small_batch_linear(x, small_batch_weight, bias)
    if packed_weight is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def small_batch_linear(x: torch.Tensor, small_batch_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel the small-batch weight is laid out for (amx_linear, panel_linear or
    skinny_linear), chosen in one place, csrc/layer_stack.cpp's small_batch_linear, which the layer
    stack calls too. The kernels take [M, K]: leading dims are flattened."""
    rows = x.reshape(-1, x.size(-1))
    y = torch.ops.tpserve_cpu.small_batch_linear(rows, small_batch_weight, bias)
    return y.view(*x.shape[:-1], y.size(-1))


# Layouts of the small-batch weight, by kernel (prepack_linears' `layout`): plain (skinny_linear),
# panels of 16 features (panel_linear, float32 or bf16 widened as it loads), bf16 k-pair panels
# (panel_linear on vdpbf16ps), AMX tile order (amx_linear).
LAYOUT_PLAIN, LAYOUT_PANEL, LAYOUT_PAIRS, LAYOUT_AMX = "plain", "panel", "pairs", "amx"

# Row counts at which panel_linear is timed against oneDNN at load: decode batches (4, 16, 64) and
# a prefill chunk (256).
PANEL_PROBES = (4, 16, 64, 256)
# small_batch_rows when panel_linear won every probe: every batch takes it (measured on a Zen 3 EPYC
# to hold at 512-2048 rows too, 1.1-1.2x oneDNN's speed).
PANEL_ALL_ROWS = 2**62
# Timed passes per kernel and probe (alternated; the fastest of each counts).
CALIBRATION_REPEATS = 3
# Bytes of distinct weights one timed pass reads: more than a server CPU's L3, so that the weights
# come from memory as a model's 30 layers do in a step. On one warm 3072 x 576 weight oneDNN won
# at 1024 rows, where over the model's layers (cold) the kernel ran 1.16x faster.
CALIBRATION_BYTES = 64 * 2**20
# At most this many copies (a tiny test model's layer is a few KB: its passes stay short).
CALIBRATION_MAX_COPIES = 16


def choose_panel_rows(panel_faster: dict[int, bool]) -> int:
    """Rows up to which panel_linear serves: the largest probe before the first it lost (0 if it
    lost the first), or every batch if it won them all."""
    rows = 0
    for probe in sorted(panel_faster):
        if not panel_faster[probe]:
            return rows
        rows = probe
    return PANEL_ALL_ROWS if rows else 0


# Rows at which the two bf16 panel forms are timed against each other at load: a 64-request decode
# batch, where the FLOP rate of their instructions, not the weight stream, sets the pace.
PAIR_PROBE = 64


def _calibration_weights(shapes: tuple[tuple[int, int], ...], dtype: torch.dtype,
                         gen: torch.Generator) -> tuple[int, list[torch.Tensor]]:
    """Copies of random weights of one layer's [out, in] shapes that add up to CALIBRATION_BYTES (at
    most CALIBRATION_MAX_COPIES): (copies, the weights in `shapes` order, repeated copies times)."""
    layer_bytes = dtype.itemsize * sum(n * k for n, k in shapes)
    copies = max(1, min(CALIBRATION_MAX_COPIES, CALIBRATION_BYTES // max(1, layer_bytes)))
    return copies, [torch.randn(n, k, generator=gen).to(dtype) for _ in range(copies) for n, k in shapes]


# The last dim of k-pair panels ([N/16, K/2, PAIR_PANEL_WIDTH]): 16 features x 2 k values.
PAIR_PANEL_WIDTH = 32


def _panel_pass(panels: list[torch.Tensor], xs: dict[int, torch.Tensor]):
    """One pass of panel_linear over packed panels, each given the probe rows of its K."""
    def run():
        for w in panels:
            k = w.size(1) * (2 if w.size(2) == PAIR_PANEL_WIDTH else 1)
            torch.ops.tpserve_cpu.panel_linear(xs[k], w, None)
    return run


@functools.lru_cache(maxsize=None)
def pair_panels_win(shapes: tuple[tuple[int, int], ...]) -> bool:
    """Whether bf16 pair panels (vdpbf16ps) beat the widened bf16 panels (float32 FMAs) on this CPU
    for projections of the given [out, in] shapes (even K): both timed at PAIR_PROBE rows over the
    calibration weights. Once per set of shapes and process."""
    gen = torch.Generator().manual_seed(0)
    copies, weights = _calibration_weights(shapes, torch.bfloat16, gen)
    forms = {"pairs": [torch.ops.tpserve_cpu.panel_pack_weight(w, True) for w in weights],
             "widened": [torch.ops.tpserve_cpu.panel_pack_weight(w) for w in weights]}
    del weights
    xs = {k: torch.randn(PAIR_PROBE, k, generator=gen).bfloat16() for k in {k for _, k in shapes}}
    best = fastest_alternated({name: _panel_pass(panels, xs) for name, panels in forms.items()}, CALIBRATION_REPEATS)
    logger.info(load_choices.PANEL_FORM + " %d rows over %d copies of %s: pairs %.2f ms, widened %.2f ms",
                PAIR_PROBE, copies, list(shapes), 1e3 * best["pairs"], 1e3 * best["widened"])
    return best["pairs"] < best["widened"]


@functools.lru_cache(maxsize=None)
def calibrate_panel_rows(shapes: tuple[tuple[int, int], ...], dtype: torch.dtype = torch.float32,
                         pairs: bool = False) -> tuple[int, tuple]:
    """panel_linear's row limit on this CPU for projections of the given [out, in] shapes (one
    layer's) in `dtype` (float32, or bf16 on AVX512-BF16 builds; `pairs`: bf16 pair panels, even
    K): both kernels timed at each probe row count, a pass running every shape over the calibration
    weights; a probe the kernel loses is timed again, and only a second loss counts. Returns (rows,
    ((probe, panel s, oneDNN s), ...)), the timing each decision stands on. Once per set of shapes,
    dtype, form and process."""
    gen = torch.Generator().manual_seed(0)
    copies, weights = _calibration_weights(shapes, dtype, gen)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in weights]
    panels = [torch.ops.tpserve_cpu.panel_pack_weight(w, pairs) for w in weights]
    del weights
    faster, timings = {}, []
    for probe in PANEL_PROBES:
        xs = {k: torch.randn(probe, k, generator=gen).to(dtype) for k in {k for _, k in shapes}}

        def run_onednn():
            for w, (_, k) in zip(packed, shapes * copies):
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

        kernels_at_probe = {"panel": _panel_pass(panels, xs), "onednn": run_onednn}
        best = fastest_alternated(kernels_at_probe, CALIBRATION_REPEATS)
        if best["panel"] > best["onednn"]:
            # A loss ends the kernel's range for the process's life, so it is timed twice: a
            # neighbour busy through one timing (a package install beside an engine loading in
            # process, 2-core Zen 4) once cost it its panels at 4 rows, where they run ~1.5x
            # oneDNN's speed.
            best = fastest_alternated(kernels_at_probe, CALIBRATION_REPEATS)
        faster[probe] = best["panel"] <= best["onednn"]
        timings.append((probe, best["panel"], best["onednn"]))
        if not faster[probe]:
            break  # the limit is known; larger probes would only cost load time
    rows = choose_panel_rows(faster)
    logger.info(load_choices.PANEL_ROWS + " %s%s batches of %s, oneDNN %s (timed at load over %d copies of %s, rows: "
                "panel / oneDNN ms: %s)", str(dtype).removeprefix("torch."), " pair-panel" if pairs else "",
                "every size" if rows == PANEL_ALL_ROWS else f"up to {rows} rows",
                "none" if rows == PANEL_ALL_ROWS else "the rest", copies, list(shapes),
                ", ".join(f"{m}: {1e3 * a:.2f} / {1e3 * b:.2f}" for m, a, b in timings))
    return rows, tuple(timings)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing exists for CPU float32 always, bf16 where the CPU has the instructions."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def needs_onednn(small_batch_rows: int, layout: str) -> bool:
    """Whether some batch reaches oneDNN: all but where panel_linear takes every batch."""
    return not (layout in (LAYOUT_PANEL, LAYOUT_PAIRS) and small_batch_rows == PANEL_ALL_ROWS)


def prepack_linears(model: nn.Module, small_batch_rows: int = 0, layout: str = LAYOUT_PLAIN) -> int:
    """Pack the weight of every layer that has a `packed_weight` slot (for oneDNN, unless
    panel_linear takes every batch); returns how many.

    small_batch_rows > 0 (tpserve's CPU kernels loaded, the dtype one of theirs: the caller
    checks): batches of up to that many rows run a small-batch kernel on `small_batch_weight`,
    laid out per `layout`: LAYOUT_AMX (bf16 on a CPU with AMX) a copy in AMX tile order for
    amx_linear, LAYOUT_PANEL (float32, or bf16 without AMX) a copy in panels for panel_linear,
    LAYOUT_PAIRS (bf16 without AMX, even K) a copy in k-pair panels for panel_linear's vdpbf16ps
    tiles, LAYOUT_PLAIN the plain weight for skinny_linear (bf16), which is then kept. A weight no
    small-batch kernel reads and no other module uses is dropped (the packed copy replaces it); one
    that is shared (an LM head tied to the embedding table) is kept for its other user."""
    pack_small = {LAYOUT_AMX: torch.ops.tpserve_cpu.amx_pack_weight,
                  LAYOUT_PANEL: torch.ops.tpserve_cpu.panel_pack_weight,
                  LAYOUT_PAIRS: functools.partial(torch.ops.tpserve_cpu.panel_pack_weight, pairs=True),
                  LAYOUT_PLAIN: None}[layout] if small_batch_rows > 0 else None
    layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
    packable_ids = {id(m) for m in layers}
    shared = {p.data_ptr() for m in model.modules() if id(m) not in packable_ids
              for p in m.parameters(recurse=False)}
    onednn = needs_onednn(small_batch_rows, layout)
    extra_bytes = 0
    for layer in layers:
        weight = layer.weight
        if onednn:
            layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        layer.small_batch_rows = small_batch_rows
        if pack_small is not None:
            layer.small_batch_weight = pack_small(weight.detach())
            if onednn:
                extra_bytes += layer.small_batch_weight.numel() * layer.small_batch_weight.element_size()
        elif small_batch_rows > 0:
            layer.small_batch_weight = weight.detach()
            if weight.data_ptr() not in shared:
                extra_bytes += weight.numel() * weight.element_size()
        if weight.data_ptr() not in shared and (small_batch_rows == 0 or pack_small is not None):
            # Keep the parameter (its dtype and name stay visible) but free its storage.
            weight.data = torch.empty(0, dtype=weight.dtype)
    if pack_small is not None:
        # The packed copies are what every step streams through: on 2 MB pages (huge_pages.py).
        for layer, moved in zip(layers, huge_pages.move_to_huge_pages([m.small_batch_weight for m in layers])):
            layer.small_batch_weight = moved
    if extra_bytes:
        kernel = {LAYOUT_AMX: "amx_linear", LAYOUT_PANEL: "panel_linear", LAYOUT_PAIRS: "panel_linear, pairs",
                  LAYOUT_PLAIN: "skinny_linear"}[layout]
        rows = "every batch" if small_batch_rows == PANEL_ALL_ROWS else f"batches of up to {small_batch_rows} rows"
        logger.info("kept a copy of each projection weight beside the packed one for %s (%s): %.0f MiB more",
                    rows, kernel, extra_bytes / 2**20)
    elif not onednn:
        logger.info(load_choices.PANEL_ROWS + " every batch: its panel copies replace the projection weights, "
                    "no oneDNN copy")
    return len(layers)


def packable_in_sixteens(model: nn.Module, pairs: bool = False) -> bool:
    """Whether amx_pack_weight and panel_pack_weight take every projection of the model: output
    features a multiple of 16 (all the supported models' are, TP shards included); `pairs`: and an
    even number of input features, for pair panels."""
    return all(m.weight.size(0) % 16 == 0 and (not pairs or m.weight.size(1) % 2 == 0)
               for m in model.modules() if hasattr(m, "packed_weight"))
