"""Every instruction-set path of tpserve's CPU kernels against its own bound, on this CPU.

tpserve builds one kernel library per variant (workers/cpu/kernels.py: amx, avx512_bf16, avx512,
avx2, x86_64) and loads the best the CPU runs; a Xeon with AMX runs all of them. Each variant runs
here in its own process, with the library capped to it (`kernels.load(max_variant=...)`, the name
passed in VARIANT_ENV) and torch and oneDNN capped to the same instructions (ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA), in the dtype tpserve's `auto` picks on a CPU with only that variant's flags,
on the default model (30 layers, dummy weights at its real shapes), through the engine's own code:
the worker's load (prepacking and the small-batch kernel choice), each projection module's forward
(workers/cpu/linear.py's dispatch) and workers/attention/paged.py's paged_attention. Measured:

- the bounds: memory read bandwidth (a torch sum over a buffer several times the LLC, best of 5)
  and the peak of each instruction kind the build has (torch.ops.tpserve_cpu.peak_probe);
- a decode step's projections at 1, 16 and 64 rows (the 30 layers and the LM head: what one step
  reads), and a 512-row prefill chunk's (the 30 layers);
- decode attention over 64 x 450-token contexts in 30 layers' caches (scattered blocks);
- prefill attention of one 1,024-token prompt, 30 layers.

Each figure is set against its roofline: the longer of bytes / bandwidth and FLOPs / peak (the
widest instruction kind of the run's dtype) names the bound, and "% of bound" is that time over
the measured one. The path column is what ran: the op torch's profiler saw, and in brackets the
implementation oneDNN's verbose log named. Weights are not flushed between passes: a step reads
more than the LLC between two uses of a weight, these passes read the same 135M parameters.

    .venv/bin/python -m bench.kernels.isa_paths                    # every variant this CPU runs
    .venv/bin/python -m bench.kernels.isa_paths --variants avx2,amx --quick

Prints one JSON object, then a markdown table (one row per variant x kernel).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

import torch

# The variant a child process loads (read here only: the server has no such setting).
VARIANT_ENV = "TPSERVE_BENCH_KERNEL_VARIANT"
# Per variant, torch's CPU capability and oneDNN's ISA cap: the torch ops a path still runs
# (oneDNN's GEMMs, SDPA) then use the same instructions as the variant's own kernels.
TORCH_ISA_CAPS = {
    "amx": ("avx512", "AVX512_CORE_AMX"),
    "avx512_bf16": ("avx512", "AVX512_CORE_BF16"),
    "avx512": ("avx512", "AVX512_CORE"),
    "avx2": ("avx2", "AVX2"),
    "x86_64": ("default", "SSE41"),
}
# Decode steps' rows (requests) and a prefill chunk's.
DECODE_ROWS = (1, 16, 64)
PREFILL_ROWS = 512
# Decode attention: requests and their context length; prefill attention: one prompt's length.
DECODE_CONTEXTS, DECODE_CONTEXT_LEN = 64, 450
PREFILL_PROMPT_LEN = 1024
BLOCK_SIZE = 16
# The bandwidth buffer: this many times the LLC, within these bytes.
LLC_MULTIPLE, MIN_BUFFER_BYTES, MAX_BUFFER_BYTES = 4, 1 << 30, 2 << 30
# Seconds one peak probe call should take (long enough for the OpenMP start to vanish).
PROBE_SECONDS = 0.1
# A child that runs longer than this is stopped (each should take well under a minute).
CHILD_TIMEOUT_S = 300


@dataclass
class Figure:
    # What was measured ("projections, 16 rows (+ LM head)", "decode attention", ...).
    kernel: str
    # Milliseconds of the best pass.
    ms: float
    # Bytes the pass reads from memory (weights, or K/V; activations are negligible) and FLOPs it does.
    bytes: float
    flops: float
    # Those over the time: GB/s and GFLOP/s.
    gbs: float
    gflops: float
    # What ran: profiled ops, oneDNN implementations in brackets.
    path: str
    # The process's CPU time over threads x wall time in the best pass (best_pass): below ~0.9,
    # other processes held the cores and the figure understates the kernel.
    cpu_share: float
    # The least CPU time over threads of any pass, in ms: about what the pass takes on cores of
    # its own (a thread spinning at a barrier while its sibling waits for a core still counts).
    cpu_ms: float
    # The roofline's bound: "memory", or "compute (<probe kind>)".
    bound: str = ""
    # The roofline time in ms: the longer of bytes / bandwidth and FLOPs / peak (for one row of
    # projections, the single-stream floor).
    bound_ms: float = 0.0
    # bound_ms over ms, in %.
    percent_of_bound: float = 0.0
    # The same against cpu_ms, with the bandwidth measured the same way (VariantReport's).
    percent_of_bound_at_cpu_time: float = 0.0


def make_figure(kernel: str, timing: tuple[float, float, float], bytes_read: float, flops: float,
                path: str) -> Figure:
    """A figure from best_pass's (seconds, CPU share, CPU seconds) and what the pass reads and computes."""
    seconds, share, cpu_seconds = timing
    return Figure(kernel, round(1e3 * seconds, 2), bytes_read, flops, round(bytes_read / seconds / 1e9, 1),
                  round(flops / seconds / 1e9, 1), path, share, round(1e3 * cpu_seconds, 2))


@dataclass
class VariantReport:
    # The kernel library that loaded (kernels.loaded_variant()).
    variant: str
    # The model dtype `auto` picks on a CPU with this variant's flags.
    dtype: str
    # torch's CPU capability as torch reports it, and the oneDNN cap the process ran under.
    aten_capability: str
    onednn_max_isa: str
    # torch's intra-op threads (every core this process may run on).
    threads: int
    # Memory read bandwidth, GB/s (best of the repeats), that pass's CPU share, and the rate at
    # the least CPU time (Figure's cpu_share and cpu_ms).
    bandwidth_gbs: float
    bandwidth_cpu_share: float
    bandwidth_gbs_at_cpu_time: float
    # FLOP/s (in GFLOP/s) per instruction kind of this build's peak probe.
    peaks_gflops: dict[str, float]
    # Every kernel's figure, placed on its roofline.
    figures: list[Figure] = field(default_factory=list)
    # Wall seconds of the child process's measurements (model load included).
    seconds: float = 0.0


# ---- the bounds ------------------------------------------------------------------------------
def best_pass(fn, repeats: int) -> tuple[float, float, float]:
    """(seconds, CPU share, CPU seconds) over `repeats` timed calls, after one untimed warm-up:
    the fastest call's wall time and its CPU share (the process's CPU time over threads x wall
    time: near 1 when it had its cores, lower when other processes took them), and the least
    CPU time over threads of any call (what a call takes on cores of its own, spin waits included)."""
    fn()
    best, share, least_cpu = float("inf"), 0.0, float("inf")
    threads = torch.get_num_threads()
    for _ in range(repeats):
        cpu, start = time.process_time(), time.perf_counter()
        fn()
        seconds, cpu = time.perf_counter() - start, (time.process_time() - cpu) / threads
        least_cpu = min(least_cpu, cpu)
        if seconds < best:
            best, share = seconds, cpu / seconds
    return best, round(share, 2), least_cpu


def bandwidth_buffer_bytes(cache_root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """LLC_MULTIPLE x the largest cache sysfs lists, kept within [MIN, MAX]_BUFFER_BYTES."""
    sizes = []
    for size_file in Path(cache_root).glob("index*/size"):
        text = size_file.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return min(MAX_BUFFER_BYTES, max(MIN_BUFFER_BYTES, LLC_MULTIPLE * max(sizes, default=0)))


def read_bandwidth(repeats: int) -> tuple[float, float, float]:
    """A torch sum over a float32 buffer several times the LLC: (GB/s at the best time, its CPU
    share, GB/s at the least CPU time)."""
    buffer = torch.ones(bandwidth_buffer_bytes() // 4)  # written once: every page is mapped
    seconds, share, cpu_seconds = best_pass(buffer.sum, repeats)
    gigabytes = buffer.numel() * 4 / 1e9
    return round(gigabytes / seconds, 1), share, round(gigabytes / cpu_seconds, 1)


def probe_peaks_gflops(repeats: int) -> dict[str, float]:
    """Each instruction kind of the loaded build on every thread, GFLOP/s (best of repeats; the
    probe charges each thread its own CPU time, so other processes' load does not lower it)."""
    ops = torch.ops.tpserve_cpu
    peaks = {}
    for kind in ops.peak_probe_kinds():
        steps = 1 << 14
        flops_per_s, flops = ops.peak_probe(kind, steps)[:2]
        # Scaled so that each thread computes for about PROBE_SECONDS.
        steps = max(steps, int(steps * PROBE_SECONDS * flops_per_s / flops))
        best = 0.0
        for _ in range(repeats):
            flops_per_s, flops, _, checksum, _ = ops.peak_probe(kind, steps)
            # One product per FLOP pair lands in the accumulators: a loop cut short shows here.
            if checksum != flops / 2:
                raise RuntimeError(f"peak_probe {kind}: checksum {checksum} != {flops / 2}, the loop did not run")
            best = max(best, flops_per_s)
        peaks[kind] = round(best / 1e9, 1)
    return peaks


def compute_bound(peaks_gflops: dict[str, float], dtype: torch.dtype) -> tuple[str, float]:
    """(kind, GFLOP/s) of the fastest probe kind usable for the dtype's arithmetic: float32 runs
    on the fp32 kinds only; bf16 on any (its products are exact in float32 as well)."""
    usable = {k: v for k, v in peaks_gflops.items() if dtype == torch.bfloat16 or k.startswith("fp32_")}
    return max(usable.items(), key=lambda kv: kv[1])


def on_the_roofline(figure: Figure, bandwidth_gbs: float, peak: tuple[str, float],
                    bandwidth_gbs_at_cpu_time: float | None = None) -> Figure:
    """The figure with its bound and % of bound, from its bytes, FLOPs and times (wall time against
    bandwidth_gbs; CPU time against bandwidth_gbs_at_cpu_time, where given)."""
    memory_s = figure.bytes / (bandwidth_gbs * 1e9)
    compute_s = figure.flops / (peak[1] * 1e9)
    figure.bound = "memory" if memory_s >= compute_s else f"compute ({peak[0]})"
    figure.bound_ms = round(1e3 * max(memory_s, compute_s), 2)
    figure.percent_of_bound = round(100 * figure.bound_ms / figure.ms, 1)
    if bandwidth_gbs_at_cpu_time:
        at_cpu_ms = 1e3 * max(figure.bytes / (bandwidth_gbs_at_cpu_time * 1e9), compute_s)
        figure.percent_of_bound_at_cpu_time = round(100 * at_cpu_ms / figure.cpu_ms, 1)
    return figure


# ---- what ran --------------------------------------------------------------------------------
@contextlib.contextmanager
def captured_stdout():
    """The process's stdout (file descriptor 1, where oneDNN prints) into a list of lines."""
    lines: list[str] = []
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield lines
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().splitlines())


def path_of(fn) -> str:
    """The compute ops one call of fn ran (torch's profiler; tpserve's small_batch_linear only
    dispatches to a kernel op, which is named instead), and in brackets the implementations
    oneDNN's verbose log named ("brg_matmul:avx10_1_512_amx"; "ukernel brgemm", whose ISA it
    does not log, for torch's own kernels built on oneDNN's micro-kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    interesting = ("tpserve_cpu::", "mkldnn::", "aten::_scaled_dot_product", "aten::mm", "aten::addmm",
                   "aten::bmm", "aten::linear")
    ops = sorted({e.key for e in prof.key_averages() if e.key.startswith(interesting)})
    dispatchers = {"tpserve_cpu::small_batch_linear", "aten::linear"}
    ops = [op for op in ops if op not in dispatchers] or ops
    with captured_stdout() as lines, torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        fn()
    impls = sorted({onednn_implementation(line) for line in lines} - {""})
    return " + ".join(ops) + (f" [{', '.join(impls)}]" if impls else "")


def onednn_implementation(line: str) -> str:
    """The implementation an "onednn_verbose,v1,<kind>,exec,cpu,<primitive>,<impl>,..." line
    names ("" for other lines); "<kind> <primitive>" where it names none."""
    fields = line.split(",")
    if not line.startswith("onednn_verbose") or "exec" not in fields[:4] or len(fields) < fields.index("exec") + 4:
        return ""
    at = fields.index("exec")
    return fields[at + 3] or f"{fields[at - 1]} {fields[at + 2]}"


# ---- the model and its kernels ---------------------------------------------------------------
def auto_dtype(variant: str) -> torch.dtype:
    """What `dtype: auto` resolves to on a CPU that has only this variant's flags (the rule of
    workers/runtime.py, run on those flags instead of this CPU's)."""
    from workers import runtime
    from workers.cpu import kernels

    flags = set(next(v for v in kernels.VARIANTS if v.name == variant).requires)
    with mock.patch.object(runtime, "cpu_flags", lambda *args: flags):
        return runtime.resolve_dtype("auto", "cpu")


def load_default_model(dtype: torch.dtype):
    """The default model through the worker's own load (kernels on, prepacking, the small-batch
    kernel choice), with dummy weights; no KV cache (the attention measures make their own)."""
    from workers.distributed.parallel_state import SINGLE_RANK
    from workers.model.default_model import ensure_default_model
    from workers.worker import WorkerConfig, WorkerCore

    config = WorkerConfig(model_path=str(ensure_default_model()), dtype=dtype, block_size=BLOCK_SIZE,
                          max_model_len=2048, kv_cache_memory_gib=0.0, gpu_memory_utilization=0.9, device="cpu",
                          load_format="dummy", cpu_kernels="on")
    core = WorkerCore(config, SINGLE_RANK)
    core.load_model()
    return core


def projection_pass(model, rows: int, with_head: bool):
    """(pass function, weight bytes, FLOPs): every projection of the 30 layers (and the LM head)
    on `rows` rows through its module, as a step calls them."""
    from workers.model.tp_layers import RowParallelLinear

    cfg, dtype = model.cfg, model.lm_head.weight.dtype
    modules = [m for m in model.layers.modules() if hasattr(m, "packed_weight")]
    # K is what a module takes; its plain weight may be gone (a packed copy replaced it).
    in_features = [m.local_input if isinstance(m, RowParallelLinear) else cfg.hidden_size for m in modules]
    gen = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in set(in_features) | {cfg.hidden_size}}
    calls = [(lambda m=m, k=k: m(xs[k])) for m, k in zip(modules, in_features)]
    if with_head:
        calls.append(lambda: model.lm_head.compute_logits(xs[cfg.hidden_size]))
    # N from one row's output: each call's weight is N x K.
    one_row = {k: x[:1] for k, x in xs.items()}
    out_features = [m(one_row[k]).shape[-1] for m, k in zip(modules, in_features)]
    weights = sum(n * k for n, k in zip(out_features, in_features))
    if with_head:
        weights += cfg.vocab_size * cfg.hidden_size

    def run():
        for call in calls:
            call()

    return run, weights * dtype.itemsize, 2.0 * rows * weights


def measure_projections(model, rows: int, with_head: bool, repeats: int) -> Figure:
    run, weight_bytes, flops = projection_pass(model, rows, with_head)
    timing = best_pass(run, repeats)
    what = f"projections, {rows} row{'s' if rows > 1 else ''}" + (" + LM head" if with_head else "")
    return make_figure(what, timing, weight_bytes, flops, path_of(run))


def shuffled_tables(rows: int, blocks_per_row: int, seed: int = 0) -> list[list[int]]:
    """Block tables over blocks 1.. (0 is the null block) in a random order, as a server's cache
    hands them out after a while."""
    ids = list(range(1, rows * blocks_per_row + 1))
    random.Random(seed).shuffle(ids)
    return [ids[r * blocks_per_row:(r + 1) * blocks_per_row] for r in range(rows)]


def attention_shapes(core) -> tuple[int, int, int, float]:
    """(query heads, KV heads, head_dim, softmax scale) of the model's layers."""
    attn = core.model.layers[0].self_attn
    return attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale


def measure_decode_attention(core, repeats: int) -> Figure:
    """paged_attention for DECODE_CONTEXTS decodes of DECODE_CONTEXT_LEN tokens, once per layer's
    cache (the engine's cache layout; every layer's K/V is read once per pass)."""
    from workers.attention.paged import AttentionMetadata, paged_attention
    from workers.runner.kv_cache import allocate_kv_cache

    heads, kv_heads, head_dim, scale = attention_shapes(core)
    per_request = -(-DECODE_CONTEXT_LEN // BLOCK_SIZE)
    caches = allocate_kv_cache(core.kv_spec, DECODE_CONTEXTS * per_request + 1, torch.device("cpu"))
    for k_cache, v_cache in caches:  # the values do not change the work
        k_cache.fill_(0.5)
        v_cache.fill_(0.25)
    dtype = core.config.dtype
    q = torch.randn(DECODE_CONTEXTS, heads, head_dim).to(dtype)
    new_kv = torch.zeros(DECODE_CONTEXTS, kv_heads, head_dim, dtype=dtype)  # already in the cache
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=DECODE_CONTEXTS,
                             decode_block_tables=torch.tensor(shuffled_tables(DECODE_CONTEXTS, per_request)),
                             decode_mask=None, prefills=[],
                             decode_context_lens=torch.full((DECODE_CONTEXTS,), DECODE_CONTEXT_LEN, dtype=torch.int32))

    def run():
        for k_cache, v_cache in caches:
            paged_attention(q, new_kv, new_kv, k_cache, v_cache, meta, scale)

    tokens = len(caches) * DECODE_CONTEXTS * DECODE_CONTEXT_LEN
    kv_bytes = 2.0 * tokens * kv_heads * head_dim * dtype.itemsize
    flops = 4.0 * tokens * heads * head_dim  # q.k and p.v per query head and key
    timing = best_pass(run, repeats)
    return make_figure(f"decode attention, {DECODE_CONTEXTS} x {DECODE_CONTEXT_LEN} tokens", timing, kv_bytes,
                       flops, path_of(lambda: paged_attention(q, new_kv, new_kv, *caches[0], meta, scale)))


def measure_prefill_attention(core, repeats: int) -> Figure:
    """paged_attention for one PREFILL_PROMPT_LEN-token prompt at position 0, once per layer, by the
    path the backend picks (the kernel's flash attention in float32, SDPA in bf16)."""
    from workers.attention.paged import AttentionMetadata, PrefillChunk, paged_attention
    from workers.runner.kv_cache import allocate_kv_cache

    heads, kv_heads, head_dim, scale = attention_shapes(core)
    n, dtype = PREFILL_PROMPT_LEN, core.config.dtype
    table = shuffled_tables(1, -(-n // BLOCK_SIZE))[0]
    caches = allocate_kv_cache(core.kv_spec, len(table) + 1, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)])
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=0, decode_block_tables=None, decode_mask=None,
                             prefills=[PrefillChunk(0, n, n, torch.tensor(table), None)],
                             prefill_chunk_info=torch.tensor([[0, n, n]], dtype=torch.int32),
                             prefill_block_tables=torch.tensor([table], dtype=torch.int32),
                             prefill_kernel=core.backend.prefill_attention)
    for k_cache, v_cache in caches:
        core.backend.write_kv(k, v, k_cache, v_cache, slots)

    def run():
        for k_cache, v_cache in caches:
            paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    # q.k and p.v: 2 FLOPs x head_dim each per (query, key) pair the causal mask keeps, per query head.
    flops = len(caches) * 4.0 * heads * head_dim * n * (n + 1) / 2
    timing = best_pass(run, repeats)
    return make_figure(f"prefill attention, one {n}-token prompt", timing, 0.0, flops,
                       path_of(lambda: paged_attention(q, k, v, *caches[0], meta, scale)))


# ---- one variant (the child process) ---------------------------------------------------------
def measure_variant(quick: bool) -> VariantReport:
    """Everything above for the variant VARIANT_ENV names, in this process."""
    from workers.cpu import kernels
    from workers.runtime import set_cpu_threads

    start = time.perf_counter()
    kernels.load("on", max_variant=os.environ[VARIANT_ENV])
    set_cpu_threads(None)  # as a server does: every core this process may run on
    repeats = 3 if quick else 5
    dtype = auto_dtype(kernels.loaded_variant())
    report = VariantReport(kernels.loaded_variant(), str(dtype).removeprefix("torch."),
                           torch.backends.cpu.get_cpu_capability(), os.environ.get("ONEDNN_MAX_CPU_ISA", "(not set)"),
                           torch.get_num_threads(), *read_bandwidth(repeats), probe_peaks_gflops(repeats))
    core = load_default_model(dtype)
    # The compute-bound passes take the longest: fewer of them.
    few = max(2, repeats - 2)
    figures = [measure_projections(core.model, rows, True, repeats) for rows in DECODE_ROWS]
    figures.append(measure_projections(core.model, PREFILL_ROWS, False, few))
    figures.append(measure_decode_attention(core, repeats))
    figures.append(measure_prefill_attention(core, few))
    peak = compute_bound(report.peaks_gflops, dtype)
    report.figures = [on_the_roofline(f, report.bandwidth_gbs, peak, report.bandwidth_gbs_at_cpu_time)
                      for f in figures]
    report.seconds = round(time.perf_counter() - start, 1)
    return report


# ---- every variant (the parent) --------------------------------------------------------------
def variant_env(name: str) -> dict[str, str]:
    """This process's environment with the child's variant and torch's and oneDNN's caps."""
    env = {**os.environ, VARIANT_ENV: name}
    if name in TORCH_ISA_CAPS:
        env["ATEN_CPU_CAPABILITY"], env["ONEDNN_MAX_CPU_ISA"] = TORCH_ISA_CAPS[name]
    return env


def run_variant(name: str, quick: bool) -> dict:
    """One variant in its own process: its report as a dict, or {"variant", "error"}."""
    command = [sys.executable, "-m", "bench.kernels.isa_paths", "--child"] + (["--quick"] if quick else [])
    root = Path(__file__).resolve().parents[2]
    try:
        result = subprocess.run(command, env=variant_env(name), cwd=root, capture_output=True, text=True,
                                timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"variant": name, "error": f"over {CHILD_TIMEOUT_S} s"}
    if result.returncode != 0:
        return {"variant": name, "error": result.stderr[-3000:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def markdown_table(reports: list[dict]) -> str:
    """One row per variant x kernel, the bounds first."""
    lines = ["| variant (dtype) | kernel | figure | ms (bound ms) | bound | % of bound | CPU share | "
             "% of bound at CPU time | path |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in reports:
        if "error" in r:
            lines.append(f"| {r['variant']} | - | failed: {r['error'].splitlines()[-1] if r['error'] else ''} | | | | | | |")
            continue
        who = f"{r['variant']} ({r['dtype']})"
        peaks = ", ".join(f"{k} {v:g}" for k, v in r["peaks_gflops"].items())
        lines.append(f"| {who} | bounds | read {r['bandwidth_gbs']:g} GB/s ({r['bandwidth_gbs_at_cpu_time']:g} at "
                     f"CPU time); peaks GFLOP/s: {peaks} | | | | {r['bandwidth_cpu_share']:g} | | "
                     f"torch sum; peak_probe (ATen {r['aten_capability']}, oneDNN {r['onednn_max_isa']}) |")
        for f in r["figures"]:
            rates = [f"{f['gbs']:g} GB/s" if f["bytes"] else "", f"{f['gflops']:g} GFLOP/s" if f["flops"] else ""]
            lines.append(f"| {who} | {f['kernel']} | {'; '.join(x for x in rates if x)} | {f['ms']:g} "
                         f"({f['bound_ms']:g}) | {f['bound']} | {f['percent_of_bound']:g}% | {f['cpu_share']:g} | "
                         f"{f['percent_of_bound_at_cpu_time']:g}% | {f['path']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from workers.cpu import kernels

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runnable = [v.name for v in kernels.runnable_variants() if v in kernels.variants_for()]
    p.add_argument("--variants", default=",".join(runnable), help=f"comma-separated, of {runnable}")
    p.add_argument("--quick", action="store_true", help="3 timed passes instead of 5 (2 instead of 3 for prefill)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(asdict(measure_variant(args.quick))))
        return 0
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in runnable]
    if unknown:
        p.error(f"this CPU cannot run {unknown} (it runs {runnable})")
    load_before = os.getloadavg()
    reports = []
    for name in names:
        kernels.build(next(v for v in kernels.VARIANTS if v.name == name))  # not inside the child's time
        print(f"{name}...", file=sys.stderr, flush=True)
        reports.append(run_variant(name, args.quick))
    print(json.dumps({"cpu": kernels.cpuinfo_field("model name"), "load_average_before_after": [
        load_before[0], os.getloadavg()[0]], "variants": reports}, indent=2))
    print(markdown_table(reports))
    return 0 if all("error" not in r for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
