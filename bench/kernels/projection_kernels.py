"""Projection kernels side by side: tpserve's panel_linear against oneDNN's prepacked GEMM, over the
default model's projection shapes for 30 layers of distinct random weights (cache-cold, as in a
step), alternated, fastest of `--repeats` passes per kernel and row count. float32 by default;
`--dtype bfloat16` times both bf16 panel forms, widened (`panel_linear`, float32 FMAs) and k-pairs
(`pair_panels`: vdpbf16ps on AVX512-BF16 builds, split by integer ops on the avx2 build), against
oneDNN's bf16 GEMM, or where oneDNN has none (AVX2) against float32 panels.

    .venv/bin/python -m bench.kernels.projection_kernels                      # rows 1,4,8,16,32,64,256
    .venv/bin/python -m bench.kernels.projection_kernels --rows 512,1024 --layers 6
    .venv/bin/python -m bench.kernels.projection_kernels --dtype bfloat16 --rows 1,16,64,256,512
    .venv/bin/python -m bench.kernels.projection_kernels --library OTHER.so   # another build of the kernels

Prints one JSON object: per row count each kernel's ms per pass and GFLOP/s, and oneDNN's time over
each panel form's (> 1: the panels faster). The README's panel_linear table came from this loop.
`--library` loads that library instead of building this machine's variant: e.g. the avx2 build's
256-bit tiles against the AVX-512 build's on one AVX-512 machine, each in its own process (both
register torch.ops.tpserve_cpu).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

# The default model's per-layer projections, [out, in]: fused QKV, O, fused gate-up, down.
DEFAULT_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def time_kernels(rows: list[int], layers: int, repeats: int, shapes=DEFAULT_SHAPES,
                 dtype: torch.dtype = torch.float32) -> dict:
    """Where oneDNN has no bf16 GEMM (AVX2 without AVX512-BF16), the bf16 panels are timed against
    float32 panels instead ("float32_panels"): the other dtype a user has there."""
    from workers.cpu.linear import can_prepack

    weights = [torch.randn(n, k).to(dtype) for _ in range(layers) for n, k in shapes]
    baseline = "onednn" if can_prepack(torch.device("cpu"), dtype) else "float32_panels"
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights] if baseline == "onednn" else []
    forms = {"panel_linear": [torch.ops.tpserve_cpu.panel_pack_weight(w) for w in weights]}
    if dtype == torch.bfloat16:
        forms["pair_panels"] = [torch.ops.tpserve_cpu.panel_pack_weight(w, True) for w in weights]
    if baseline == "float32_panels":
        forms[baseline] = [torch.ops.tpserve_cpu.panel_pack_weight(w.float()) for w in weights]
    in_features = [k for _ in range(layers) for _, k in shapes]
    del weights
    flops_per_row = 2 * layers * sum(n * k for n, k in shapes)
    out = {}
    for m in rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in set(in_features)}
        # float32 copies of x only for the float32 panels of a bf16 run.
        xs32 = {k: x.float() for k, x in xs.items()} if baseline == "float32_panels" and dtype != torch.float32 else xs

        def panel_pass(panels):
            x_of = xs32 if panels[0].dtype == torch.float32 else xs
            return lambda: [torch.ops.tpserve_cpu.panel_linear(x_of[k], w, None) for w, k in zip(panels, in_features)]

        kernels = {name: panel_pass(panels) for name, panels in forms.items()}
        if onednn:
            kernels["onednn"] = lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                                         for w, k in zip(onednn, in_features)]
        best = dict.fromkeys(kernels, float("inf"))
        for repeat in range(repeats + 1):  # the first pass of each is a warm-up
            for name in (list(kernels) if repeat % 2 else list(kernels)[::-1]):
                start = time.perf_counter()
                kernels[name]()
                if repeat:
                    best[name] = min(best[name], time.perf_counter() - start)
        out[str(m)] = {**{name: {"ms": round(1e3 * s, 2), "gflops": float(f"{flops_per_row * m / s / 1e9:.3g}")}
                          for name, s in best.items()},
                       f"{baseline}_over_panel_time": round(best[baseline] / best["panel_linear"], 3)}
        if "pair_panels" in best:
            out[str(m)][f"{baseline}_over_pairs_time"] = round(best[baseline] / best["pair_panels"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,8,16,32,64,256", help="comma-separated row counts")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--library", help="a built kernel library to load instead of this machine's variant")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    from workers.cpu import kernels as cpu_ops

    if args.library:
        torch.ops.load_library(args.library)
    if not (args.library or cpu_ops.load()) or not cpu_ops.ops().panel_linear_available():
        print(json.dumps({"error": "tpserve's CPU kernels with panel_linear (AVX2 + FMA) are not available here"}))
        return 1
    if dtype == torch.bfloat16 and not cpu_ops.ops().panel_linear_bf16_available():
        print(json.dumps({"error": "bf16 panels need a kernel build with AVX512-BF16, or the avx2 build"}))
        return 1
    result = time_kernels([int(r) for r in args.rows.split(",")], args.layers, args.repeats, dtype=dtype)
    print(json.dumps({"threads": torch.get_num_threads(), "layers": args.layers, "shapes": DEFAULT_SHAPES,
                      "dtype": args.dtype,
                      "library": args.library or "this machine's variant",
                      "rows": result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
