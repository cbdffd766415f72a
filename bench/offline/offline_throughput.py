"""Offline throughput: the tpserve engine vs HF transformers `generate`, same workload, one run.

Prints one JSON object: output tokens/s of each, their ratio, the engine's per-step overhead
(step time minus model-forward time, as a fraction of step time) at high occupancy, and the
cost of metrics (engine with stat loggers on vs off).

    python -m bench.offline.offline_throughput [--num-requests 64] [--hf-batch-size 16] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from deployments.config import TpserveConfig
from deployments.engine.engine import LLMEngine
from deployments.engine.engine_metrics import EngineMetrics, make_stat_loggers
from scheduler.sampling_params import SamplingParams


def make_workload(num_requests: int, seed: int, vocab_size: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int]) -> list[tuple[list[int], int]]:
    """Seeded random token prompts and output lengths (ignore_eos: every request runs to length)."""
    rng = random.Random(seed)
    workload = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_range)
        prompt = [rng.randrange(100, vocab_size - 100) for _ in range(prompt_len)]
        workload.append((prompt, rng.randint(*output_range)))
    return workload


def run_engine(engine: LLMEngine, workload, metrics: EngineMetrics | None) -> dict:
    for i, (prompt, num_out) in enumerate(workload):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=num_out, temperature=0.0, ignore_eos=True))
    num_tokens = 0
    overhead_fractions = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        it = engine.last_iteration
        if metrics is not None:
            metrics.on_step(outputs, it)
        num_tokens += it.num_generation_tokens
        if it.scheduler.num_running >= 32 and it.scheduler.prefill_tokens == 0:
            overhead_fractions.append((it.step_duration - it.forward_duration) / it.step_duration)
    elapsed = time.perf_counter() - start
    return {
        "output_tokens": num_tokens,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(num_tokens / elapsed, 2),
        "step_overhead_fraction_at_32_running": (
            round(statistics.median(overhead_fractions), 4) if overhead_fractions else None
        ),
    }


def run_hf(model_path: str, workload, batch_size: int) -> dict:
    """HF generate in static, left-padded batches of `batch_size` (the usual offline baseline)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    useful = 0
    start = time.perf_counter()
    for b in range(0, len(workload), batch_size):
        batch = workload[b : b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        max_new = max(n for _, n in batch)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False, pad_token_id=0)
        useful += sum(n for _, n in batch)  # tokens each request asked for; padding work is waste
    elapsed = time.perf_counter() - start
    return {"output_tokens": useful, "seconds": round(elapsed, 2), "output_tokens_per_s": round(useful / elapsed, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-memory-gib", type=float, default=4.0)
    parser.add_argument("--dtype", default="float32", help="engine dtype (HF always runs float32)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-metrics-cost", action="store_true")
    args = parser.parse_args()

    config = TpserveConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           kv_cache_memory_gib=args.kv_cache_memory_gib, enable_prefix_caching=False)
    engine = LLMEngine(config)
    workload = make_workload(args.num_requests, args.seed, engine.model_config.vocab_size,
                             tuple(args.prompt_len), tuple(args.output_len))
    run_engine(engine, workload[:16], None)  # warm-up: kernels for the shapes that follow
    result = {"workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                           "output_len": args.output_len, "seed": args.seed},
              "torch_threads": torch.get_num_threads(), "dtype": args.dtype}
    result["tpserve"] = run_engine(engine, workload, None)
    if not args.skip_metrics_cost:
        metrics = EngineMetrics(make_stat_loggers("bench", config, engine.max_model_len),
                                timeline_capacity=1000, frontend_finalizes=False)
        with_metrics = run_engine(engine, workload, metrics)
        result["tpserve_with_metrics"] = with_metrics
        result["metrics_cost_fraction"] = round(
            1 - with_metrics["output_tokens_per_s"] / result["tpserve"]["output_tokens_per_s"], 4)
    if not args.skip_hf:
        result["hf_generate"] = run_hf(engine.model_config.path, workload, args.hf_batch_size)
        result["tpserve_over_hf"] = round(
            result["tpserve"]["output_tokens_per_s"] / result["hf_generate"]["output_tokens_per_s"], 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
