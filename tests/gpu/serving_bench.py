"""The GPU check's serving figures at real model shapes, with dummy weights (no weight files):

  copy_bandwidth     device-to-device copy, GB/s (read + write), the HBM yardstick of this run;
  llama3_8b_decode   Llama-3-8B (bf16) decode steps at batch 1, 64, 256: tok/s, and batch 1's
                     step time against the HBM floor (weight bytes / copy bandwidth; goal <= 1.25x);
  paged_attention    64 decodes over 4k-token contexts: the attention's share of the step (the step
                     minus the same batch over 32-token contexts) as bandwidth, vs copy (goal >= 70%);
  prefill_attention  a 2k-token chunk after 2k cached tokens vs one at position 0: the attention's
                     extra work over its extra time, TFLOP/s, and the whole step's TFLOP/s;
  mixed_workload     512 requests, prompts of 200-4,000 tokens, 128 output tokens, max_model_len
                     8,192, through the real scheduler: no OOM, p99 step time vs the median decode
                     step (goal <= 5x), output tok/s;
  smollm2_streams    SmolLM2-135M shapes at 16 and 64 concurrent streams (prompts 32-128 tokens, 64
                     output tokens): output tok/s in-process (the HTTP figures are decode_bench.py's).

Everything goes through the stable entry points a server uses: `WorkerCore` (load, profile, KV
cache, graphs) and `ModelRunner.execute_model`, fed by the scheduler or by SchedulerOutputs made
here, so whatever kernels the runner picks are what is measured. Step sizes on GPU are the derived
GPU defaults (workers/runtime.py, gpu_step_defaults).

    python tests/gpu/serving_bench.py --out $OUT/serving_bench.json        # GPU
    python tests/gpu/serving_bench.py --dry-run --out /tmp/sb.json         # CPU, tiny shapes, seconds

`--dry-run` runs the same code on CPU with scaled-down configs (tests/model_configs/scaled.py),
short contexts and a few requests, so CI keeps this script working (tests/test_device_check.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (model_configs)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from model_configs.scaled import LLAMA_3_8B, SMOLLM2_135M, scaled_config  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.math_utils import cdiv  # noqa: E402
from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from scheduler.request import Request  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402
from workers.distributed.parallel_state import SINGLE_RANK  # noqa: E402
from workers.model.config import ModelConfig  # noqa: E402
from workers.runtime import StepSizes, gpu_step_defaults, resolve_step_sizes  # noqa: E402
from workers.worker import WorkerConfig, WorkerCore  # noqa: E402

GB = 1e9


@dataclass(frozen=True)
class BenchShapes:
    """What one run measures (the GPU run, or the dry run's tiny version of it)."""

    # "cuda" or "cpu".
    device: str
    dtype: str
    # Context cap of every engine here (the mixed workload's max_model_len).
    max_model_len: int
    # Decode batches timed on Llama-3-8B, their context and timed steps.
    decode_batches: tuple[int, ...]
    decode_context: int
    decode_steps: int
    # Paged attention: batch x context, and the short context subtracted.
    attention_batch: int
    attention_context: int
    attention_short_context: int
    # Prefill: chunk tokens, after as many cached.
    prefill_chunk: int
    # Mixed workload: requests, prompt length range, output tokens, wall-clock cap (s).
    workload_requests: int
    workload_prompt: tuple[int, int]
    workload_output: int
    workload_time_cap_s: float
    # SmolLM2 streams and their output tokens.
    smollm2_streams: tuple[int, ...]
    smollm2_output: int
    # Bytes of the copy-bandwidth buffer.
    copy_bytes: int
    # Scaled-down configs (dry run) instead of the published shapes.
    tiny: bool
    # CPU only: KV cache GiB.
    kv_cache_memory_gib: float = 0.0


GPU_SHAPES = BenchShapes(
    device="cuda", dtype="bfloat16", max_model_len=8192, decode_batches=(1, 64, 256), decode_context=128,
    decode_steps=48, attention_batch=64, attention_context=4096, attention_short_context=32, prefill_chunk=2048,
    workload_requests=512, workload_prompt=(200, 4000), workload_output=128, workload_time_cap_s=120.0,
    smollm2_streams=(16, 64), smollm2_output=64, copy_bytes=2 << 30, tiny=False)
DRY_SHAPES = BenchShapes(
    device="cpu", dtype="float32", max_model_len=256, decode_batches=(1, 4, 8), decode_context=16, decode_steps=3,
    attention_batch=4, attention_context=128, attention_short_context=16, prefill_chunk=32, workload_requests=10,
    workload_prompt=(10, 60), workload_output=4, workload_time_cap_s=120.0, smollm2_streams=(2, 4), smollm2_output=4,
    copy_bytes=16 << 20, tiny=True, kv_cache_memory_gib=0.05)
BLOCK_SIZE = 16


# ---- timing -----------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(shapes: BenchShapes, repeats: int = 10) -> dict:
    """Device-to-device copy: bytes read + written per second (what a memory-bound kernel can reach)."""
    n = shapes.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=shapes.device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(shapes.device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(shapes.device)
        times.append(time.perf_counter() - start)
    best = min(times)
    del src, dst
    return {"bytes": n, "seconds_best": best, "gb_per_s": 2 * n / best / GB}


# ---- workers ----------------------------------------------------------------------------------
def model_folder(config_dir: Path, shapes: BenchShapes, scratch: Path) -> str:
    """The published config, or (dry run) its scaled-down copy: a folder with config.json only."""
    if not shapes.tiny:
        return str(config_dir)
    return scaled_config(config_dir.name, scratch / config_dir.name, max_position_embeddings=shapes.max_model_len)


def step_sizes(path: str, shapes: BenchShapes, max_num_seqs: int) -> StepSizes:
    """The derived GPU defaults (nothing set by a user); the dry run sizes itself."""
    if shapes.device != "cuda":
        return StepSizes(max_num_seqs, 64, max_num_seqs, 64, "dry run")
    cfg = ModelConfig.from_pretrained(path)
    configured = StepSizes(64, 2048, 256, 2048)
    return resolve_step_sizes(configured, set(), "cuda",
                              lambda: gpu_step_defaults(torch.cuda.mem_get_info()[0], cfg, 2, 1, 0.9))


def make_worker(path: str, shapes: BenchShapes, sizes: StepSizes) -> WorkerCore:
    cfg = WorkerConfig(
        model_path=path, dtype=getattr(torch, shapes.dtype), block_size=BLOCK_SIZE, max_model_len=shapes.max_model_len,
        kv_cache_memory_gib=shapes.kv_cache_memory_gib, gpu_memory_utilization=0.9, device=shapes.device,
        max_num_seqs=sizes.max_num_seqs, max_num_batched_tokens=sizes.max_num_batched_tokens,
        max_cuda_graph_batch_size=sizes.max_cuda_graph_batch_size, max_cuda_graph_tokens=sizes.max_cuda_graph_tokens,
        load_format="dummy", cpu_prepack_linear=False,
    )
    core = WorkerCore(cfg, SINGLE_RANK)
    core.init_kv_cache(core.load_model().num_blocks)
    return core


def release(core: WorkerCore) -> None:
    core.release()
    gc.collect()


# ---- steps made here (no scheduler): decodes at a chosen context ----------------------------------
class DirectSteps:
    """SchedulerOutputs for requests whose earlier tokens count as cached (their K/V are whatever
    the cache holds: timing only), each on blocks of its own."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        self.num_blocks = core.load_report.num_blocks
        self._next_id = 0

    def _blocks(self, count: int, per_request: int) -> list[list[int]]:
        if 1 + count * per_request > self.num_blocks:
            raise MemoryError(f"{count} requests of {per_request} blocks exceed the {self.num_blocks}-block cache")
        return [list(range(1 + i * per_request, 1 + (i + 1) * per_request)) for i in range(count)]

    def timed_decodes(self, batch: int, context: int, steps: int, warmup: int = 3) -> list[float]:
        """Seconds of each of `steps` decode steps of `batch` requests at ~`context` tokens."""
        vocab = self.core.model_config.vocab_size
        per_request = cdiv(context + steps + warmup + 1, BLOCK_SIZE)
        tables = self._blocks(batch, per_request)
        params = SamplingParams(max_tokens=steps + warmup + 1, temperature=0.0, ignore_eos=True)
        ids = [f"d{self._next_id}-{i}" for i in range(batch)]
        self._next_id += 1
        prompts = torch.randint(100, vocab - 1, (batch, context)).tolist()
        out = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(rid, p, params, t, context - 1) for rid, p, t in zip(ids, prompts, tables)],
            num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=batch)
        times = []
        for step in range(steps + warmup):
            _sync(self.core.config.device)
            start = time.perf_counter()
            result = self.core.execute_model(out)
            _sync(self.core.config.device)
            if step >= warmup:
                times.append(time.perf_counter() - start)
            out = SchedulerOutput(
                scheduled_cached_reqs=[CachedRequestData(rid, False, [result.sampled_token_ids[rid][0]], [],
                                                         context + step) for rid in ids],
                num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=batch)
        self.core.execute_model(SchedulerOutput(finished_req_ids=set(ids)))
        return times

    def timed_prefill(self, chunk: int, cached: int, repeats: int = 3) -> float:
        """Median seconds of one step prefilling `chunk` tokens of one request after `cached`."""
        vocab = self.core.model_config.vocab_size
        times = []
        for r in range(repeats + 1):
            (table,) = self._blocks(1, cdiv(cached + chunk + 1, BLOCK_SIZE))
            rid = f"p{self._next_id}"
            self._next_id += 1
            prompt = torch.randint(100, vocab - 1, (cached + chunk,)).tolist()
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            out = SchedulerOutput(scheduled_new_reqs=[NewRequestData(rid, prompt, params, table, cached)],
                                  num_scheduled_tokens={rid: chunk}, total_num_scheduled_tokens=chunk)
            _sync(self.core.config.device)
            start = time.perf_counter()
            self.core.execute_model(out)
            _sync(self.core.config.device)
            if r:
                times.append(time.perf_counter() - start)
            self.core.execute_model(SchedulerOutput(finished_req_ids={rid}))
        return statistics.median(times)


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)


def llama_figures(core: WorkerCore, shapes: BenchShapes, bandwidth_gb_s: float, report: dict, save) -> None:
    """Decode batches vs the HBM floor, paged decode attention, prefill attention (into report)."""
    steps = DirectSteps(core)
    cfg = core.model_config
    weight_bytes = core.load_report.param_bytes
    decode = {"weight_bytes": weight_bytes, "context": shapes.decode_context, "batches": {}}
    report["llama3_8b_decode"] = decode
    for batch in shapes.decode_batches:
        if batch > core.config.max_num_seqs:
            decode["batches"][str(batch)] = {"skipped": f"max_num_seqs is {core.config.max_num_seqs} here"}
            continue
        median = statistics.median(steps.timed_decodes(batch, shapes.decode_context, shapes.decode_steps))
        decode["batches"][str(batch)] = {"step_ms": _ms(median), "tokens_per_s": round(batch / median, 1)}
        print(f"  llama decode batch {batch:3d}: {_ms(median):8.3f} ms/step  {batch / median:9.1f} tok/s", flush=True)
        save()
    if "1" in decode["batches"] and "step_ms" in decode["batches"]["1"]:
        floor = weight_bytes / (bandwidth_gb_s * GB)
        decode["hbm_floor_ms"] = _ms(floor)
        decode["batch1_vs_floor"] = round(decode["batches"]["1"]["step_ms"] / 1e3 / floor, 3)
        decode["batch1_goal"] = "<= 1.25"
        save()

    # Paged decode attention: the same batch over long and short contexts; the difference is the
    # attention reading (context - short) more tokens of K and V in every layer.
    kv_per_token = 2 * cfg.num_hidden_layers * core.model.num_local_kv_heads * cfg.head_dim * \
        torch.empty((), dtype=core.config.dtype).element_size()
    b, long, short = shapes.attention_batch, shapes.attention_context, shapes.attention_short_context
    t_long = statistics.median(steps.timed_decodes(b, long, shapes.decode_steps))
    t_short = statistics.median(steps.timed_decodes(b, short, shapes.decode_steps))
    extra_bytes = b * (long - short) * kv_per_token
    attention_s = t_long - t_short
    resolved = attention_s > 0  # below the timing noise (tiny shapes) there is nothing to divide by
    report["paged_attention"] = {
        "batch": b, "context": long, "short_context": short, "step_ms": _ms(t_long), "short_step_ms": _ms(t_short),
        "kv_bytes_read": b * long * kv_per_token,
        "attention_gb_per_s": round(extra_bytes / attention_s / GB, 1) if resolved else None,
        "vs_copy_bandwidth": round(extra_bytes / attention_s / GB / bandwidth_gb_s, 3) if resolved else None,
        "goal": ">= 0.70",
    }
    print(f"  paged attention {b} x {long}: {report['paged_attention']}", flush=True)
    save()

    # Prefill attention: a chunk after as many cached tokens vs the same chunk at position 0.
    q = shapes.prefill_chunk
    t_deep = steps.timed_prefill(q, q)
    t_first = steps.timed_prefill(q, 0)
    per_key = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers  # QK^T and PV, 2 flops a MAC
    extra_flops = per_key * q * q  # each of q queries reads q more keys
    deep_attention_flops = per_key * (q * q + q * (q + 1) // 2)
    report["prefill_attention"] = {
        "chunk": q, "cached": q, "step_ms": _ms(t_deep), "first_chunk_step_ms": _ms(t_first),
        "attention_tflop_per_s": round(extra_flops / (t_deep - t_first) / 1e12, 2) if t_deep > t_first else None,
        "step_tflop_per_s": round((2 * weight_bytes / core.config.dtype.itemsize * q + deep_attention_flops)
                                  / t_deep / 1e12, 2),
    }
    print(f"  prefill attention: {report['prefill_attention']}", flush=True)
    save()


# ---- the scheduler-driven workloads --------------------------------------------------------------
def run_workload(core: WorkerCore, prompts: list[list[int]], output_tokens: int, time_cap_s: float,
                 concurrency: int | None = None) -> dict:
    """Requests through the real scheduler and this worker until all finish (or the time cap).
    With `concurrency`, at most that many requests are in the engine at once (streams)."""
    cfg = core.config
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=core.max_model_len, block_size=cfg.block_size, num_blocks=core.load_report.num_blocks))
    params = SamplingParams(max_tokens=output_tokens, temperature=0.8, top_p=0.95, ignore_eos=True)
    # A rank whose cache (or worst step) capped max_model_len below a prompt + its output: the
    # prompt is cut to fit (and counted) rather than refused, so the workload keeps its size.
    longest = core.max_model_len - output_tokens
    truncated = sum(len(p) > longest for p in prompts)
    pending = [Request(f"w{i}", p[:longest], params, eos_token_ids=None) for i, p in enumerate(prompts)]
    pending.reverse()
    in_engine = 0
    step_times, decode_times, output = [], [], 0
    error = None
    start = time.perf_counter()
    try:
        while pending or scheduler.has_unfinished_requests():
            while pending and (concurrency is None or in_engine < concurrency):
                scheduler.add_request(pending.pop())
                in_engine += 1
            out = scheduler.schedule()
            _sync(cfg.device)
            t0 = time.perf_counter()
            result = core.execute_model(out)
            _sync(cfg.device)
            dt = time.perf_counter() - t0
            if not out.is_empty:
                step_times.append(dt)
                if all(n == 1 for n in out.num_scheduled_tokens.values()):
                    decode_times.append(dt)
            for update in scheduler.update_from_output(out, result):
                output += len(update.new_token_ids)
                if update.request.status.is_finished:
                    in_engine -= 1
            if time.perf_counter() - start > time_cap_s:
                error = f"cut short at the {time_cap_s:.0f} s cap"
                break
    except torch.cuda.OutOfMemoryError as exc:
        error = f"OOM: {exc}"
    elapsed = time.perf_counter() - start
    figures = {"requests": len(prompts), "truncated_prompts": truncated, "max_model_len": core.max_model_len,
               "output_tokens": output, "seconds": round(elapsed, 2),
               "output_tokens_per_s": round(output / elapsed, 1), "steps": len(step_times), "error": error}
    if step_times:
        ordered = sorted(step_times)
        figures["step_ms_p50"] = _ms(statistics.median(ordered))
        figures["step_ms_p99"] = _ms(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))])
    if decode_times:
        figures["decode_step_ms_p50"] = _ms(statistics.median(decode_times))
        if step_times:
            figures["p99_vs_decode_p50"] = round(figures["step_ms_p99"] / figures["decode_step_ms_p50"], 2)
    return figures


def random_prompts(num: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (num,), generator=gen).tolist()
    return [torch.randint(100, vocab - 1, (n,), generator=gen).tolist() for n in lengths]


# ---- the run ----------------------------------------------------------------------------------
def llama_stage(path: str, shapes: BenchShapes, report: dict, save) -> None:
    """Llama-3-8B: decode, attention and prefill figures, then the mixed workload, on one worker."""
    sizes = step_sizes(path, shapes, max(shapes.decode_batches))
    report["llama3_8b_step_sizes"] = asdict(sizes)
    core = make_worker(path, shapes, sizes)
    try:
        report["llama3_8b_load"] = {"param_bytes": core.load_report.param_bytes,
                                    "num_blocks": core.load_report.num_blocks,
                                    "kv_budget": core.load_report.budget_note, "max_model_len": core.max_model_len}
        bandwidth = report.get("copy_bandwidth", {}).get("gb_per_s", float("nan"))
        llama_figures(core, shapes, bandwidth, report, save)
        prompts = random_prompts(shapes.workload_requests, *shapes.workload_prompt, core.model_config.vocab_size,
                                 seed=0)
        report["mixed_workload"] = run_workload(core, prompts, shapes.workload_output, shapes.workload_time_cap_s)
        report["mixed_workload"]["goal"] = "no OOM, p99_vs_decode_p50 <= 5"
        print(f"  mixed workload: {report['mixed_workload']}", flush=True)
    finally:
        release(core)


def smollm2_stage(path: str, shapes: BenchShapes, report: dict, save) -> None:
    """SmolLM2-135M shapes at each stream count: 4 x streams requests, at most `streams` at once."""
    core = make_worker(path, shapes, step_sizes(path, shapes, max(shapes.smollm2_streams)))
    try:
        # The last HTTP figures (one H200, random SmolLM2, decode_bench.py --http) for comparison.
        report["smollm2_last_http_tok_s"] = {"16": 2258, "64": 3145}
        report["smollm2_streams"] = {}
        for streams in shapes.smollm2_streams:
            prompts = random_prompts(4 * streams, 32, 128, core.model_config.vocab_size, seed=streams)
            figures = run_workload(core, prompts, shapes.smollm2_output, shapes.workload_time_cap_s / 6,
                                   concurrency=streams)
            report["smollm2_streams"][str(streams)] = figures
            print(f"  smollm2 {streams} streams: {figures}", flush=True)
            save()
    finally:
        release(core)


def run(shapes: BenchShapes, out_path: Path | None) -> dict:
    report: dict = {"shapes": asdict(shapes), "errors": {}, "torch": torch.__version__}
    if shapes.device == "cuda":
        report["device"] = torch.cuda.get_device_name()

    def save() -> None:  # after every figure: a run cut short still leaves what it measured
        if out_path is not None:
            out_path.write_text(json.dumps(report, indent=1))

    def stage(name: str, fn, *args) -> None:
        start = time.perf_counter()
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - one stage failing must not lose the others' figures
            report["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        report.setdefault("stage_seconds", {})[name] = round(time.perf_counter() - start, 1)
        print(f"{name}: {report['stage_seconds'][name]} s", flush=True)
        save()
        if shapes.device == "cuda":
            torch.cuda.empty_cache()

    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        stage("copy_bandwidth", lambda: report.__setitem__("copy_bandwidth", copy_bandwidth(shapes)))
        stage("llama3_8b", llama_stage, model_folder(LLAMA_3_8B, shapes, scratch), shapes, report, save)
        stage("smollm2", smollm2_stage, model_folder(SMOLLM2_135M, shapes, scratch), shapes, report, save)
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, a few requests (seconds)")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("serving_bench needs CUDA (or --dry-run)")
    torch.manual_seed(0)
    return run(DRY_SHAPES if args.dry_run else GPU_SHAPES, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
