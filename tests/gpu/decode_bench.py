"""Decode micro-benchmark on GPU: eager vs CUDA graphs, tokens/s at batch 1, 8, 32 and 64, against
the same model's eager HF `generate`; optionally a small HTTP load against the FastAPI app of one
engine (uvicorn, no Ray). Prints and writes JSON.

    python tests/gpu/decode_bench.py --out $OUT/decode_bench.json [--http] [--model PATH]

Per mode the engine is built with the `tpserve serve` defaults (max_model_len = the model's,
max_num_seqs 64, bf16) and `enforce_eager` on or off. Per batch size B: B requests of 32 prompt
tokens, prefill, 16 warm-up decode steps, then `--steps` timed decode steps through
`LLMEngine.step()` (schedule + execute + sampling + detokenize). Reported:
  step_tokens_per_s     B * steps / wall time of the timed steps;
  forward_tokens_per_s  B / mean runner time (input prep + forward + sampling, the engine's
                        forward_duration), i.e. without scheduler and detokenizer overhead.
HF generate (transformers, eager, the same weights and dtype, greedy, B prompts of 32 tokens):
  decode_tokens_per_s   B * (N - 1) / (time of N new tokens - time of 1 new token), N = --steps.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_helpers import model_kind, random_prompts, smollm2_path  # noqa: E402

PROMPT_LEN = 32
WARMUP_STEPS = 16


def make_engine(path: str, enforce_eager: bool, dtype: str, **config_overrides):
    from deployments.config import TpserveConfig
    from deployments.engine.engine import LLMEngine

    config = TpserveConfig(model=path, dtype=dtype, gpu_memory_utilization=0.3, enforce_eager=enforce_eager,
                           **config_overrides)
    return config, LLMEngine(config)


def graph_runner(engine):
    return engine.executor.worker.runner.graph_runner


def bench_batch(engine, batch_size: int, steps: int, seed: int) -> dict:
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=WARMUP_STEPS + steps + 4, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch_size}-{i}" for i in range(batch_size)]
    for rid, prompt in zip(ids, random_prompts(batch_size, seed, PROMPT_LEN, PROMPT_LEN)):
        engine.add_request(rid, prompt, params)
    generated = dict.fromkeys(ids, 0)
    while min(generated.values()) == 0:  # prefill (one or more steps)
        for out in engine.step():
            generated[out.request_id] += len(out.new_token_ids)
    for _ in range(WARMUP_STEPS):
        engine.step()
    runner = graph_runner(engine)
    replays = runner.stats.num_replays
    forward_times = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
        forward_times.append(engine.last_iteration.forward_duration)
    elapsed = time.perf_counter() - start
    engine.abort_requests(ids)
    mean_forward = statistics.fmean(forward_times)
    return {
        "batch_size": batch_size,
        "steps": steps,
        "step_time_ms": 1e3 * elapsed / steps,
        "step_tokens_per_s": batch_size * steps / elapsed,
        "forward_time_ms": 1e3 * mean_forward,
        "forward_tokens_per_s": batch_size / mean_forward,
        "graph_replays": runner.stats.num_replays - replays,
    }


def bench_prefill(engine, prompt_len: int, repeats: int = 3) -> dict:
    """One request alone, max_tokens 1: wall time from add_request to its first token through
    `LLMEngine.step()` (the in-process TTFT; with graphs, prefill steps replay token-row graphs
    up to max_cuda_graph_tokens and the context-read cap, else run eagerly)."""
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for r in range(repeats + 1):  # the first is a warm-up
        prompt = random_prompts(1, seed=1000 + r, min_len=prompt_len, max_len=prompt_len)[0]
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.add_request(f"p{prompt_len}-{r}", prompt, params)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        times.append(time.perf_counter() - start)
    return {"prompt_len": prompt_len, "steps": steps, "ttft_ms": 1e3 * statistics.median(times[1:])}


def bench_mode(path: str, enforce_eager: bool, dtype: str, batch_sizes: list[int], steps: int,
               prefill_lens: list[int] = ()) -> dict:
    start = time.perf_counter()
    _, engine = make_engine(path, enforce_eager, dtype)
    runner = graph_runner(engine)
    result = {
        "startup_s": time.perf_counter() - start,
        "attention_backend": runner.backend.name,
        "capture": None if enforce_eager else {
            "num_graphs": runner.stats.num_graphs,
            "capture_sizes": runner.capture_sizes,
            "block_table_widths": runner.block_buckets,
            "time_s": runner.stats.capture_time,
            "memory_mib": runner.stats.capture_memory / (1 << 20),
        },
        "batches": {},
    }
    for b in batch_sizes:
        result["batches"][str(b)] = bench_batch(engine, b, steps, seed=b)
        print(f"  {'eager ' if enforce_eager else 'graphs'} batch {b:3d}: "
              f"{result['batches'][str(b)]['step_tokens_per_s']:9.1f} tok/s (step), "
              f"{result['batches'][str(b)]['forward_tokens_per_s']:9.1f} tok/s (runner)", flush=True)
    result["prefill"] = {}
    for n in prefill_lens:
        result["prefill"][str(n)] = bench_prefill(engine, n)
        print(f"  {'eager ' if enforce_eager else 'graphs'} prefill {n:5d} tokens alone: "
              f"{result['prefill'][str(n)]['ttft_ms']:8.2f} ms to the first token", flush=True)
    engine.shutdown()
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return result


def bench_hf_generate(path: str, dtype: str, batch_sizes: list[int], new_tokens: int) -> dict:
    """The same weights through transformers' eager generate (greedy, no CUDA graphs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to("cuda").eval()
    result = {}
    for b in batch_sizes:
        ids = torch.tensor(random_prompts(b, seed=b, min_len=PROMPT_LEN, max_len=PROMPT_LEN), device="cuda")

        def timed(n: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        timed(4)  # warm-up
        one, many = timed(1), timed(new_tokens)
        result[str(b)] = {"batch_size": b, "new_tokens": new_tokens, "generate_s": many,
                          "decode_tokens_per_s": b * (new_tokens - 1) / max(many - one, 1e-9)}
        print(f"  hf generate batch {b:3d}: {result[str(b)]['decode_tokens_per_s']:9.1f} tok/s (decode)", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


# ---- a small HTTP load ------------------------------------------------------------------------
async def http_load(path: str, dtype: str, enforce_eager: bool, num_requests: int, concurrency: int,
                    max_tokens: int) -> dict:
    import httpx
    import uvicorn

    from deployments.http.api_server import make_api
    from deployments.engine.async_engine import AsyncEngine

    config, engine = make_engine(path, enforce_eager, dtype)
    app = make_api(AsyncEngine(config, engine=engine))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serve_task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    base = f"http://127.0.0.1:{port}/v1"
    prompts = random_prompts(num_requests, seed=1, min_len=32, max_len=128)
    semaphore = asyncio.Semaphore(concurrency)
    ttfts, itls, out_tokens, failures = [], [], 0, 0

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        nonlocal out_tokens, failures
        body = {"model": engine.served_model_name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with semaphore:
            sent = time.perf_counter()
            last = None
            try:
                async with client.stream("POST", f"{base}/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        now = time.perf_counter()
                        if chunk.get("choices") and chunk["choices"][0].get("text"):
                            if last is None:
                                ttfts.append(now - sent)
                            else:
                                itls.append(now - last)
                            last = now
                        if chunk.get("usage"):
                            out_tokens += chunk["usage"]["completion_tokens"]
            except httpx.HTTPError:
                failures += 1

    async with httpx.AsyncClient(timeout=120) as client:
        await one(client, prompts[0])  # warm-up
        ttfts.clear(), itls.clear()
        out_tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        elapsed = time.perf_counter() - start
    server.should_exit = True
    await serve_task
    engine.shutdown()
    return {
        "enforce_eager": enforce_eager,
        "num_requests": num_requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "failures": failures,
        "duration_s": elapsed,
        "requests_per_s": num_requests / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "ttft_ms_mean": 1e3 * statistics.fmean(ttfts) if ttfts else None,
        "ttft_ms_p50": 1e3 * statistics.median(ttfts) if ttfts else None,
        "itl_ms_mean": 1e3 * statistics.fmean(itls) if itls else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: gpu_helpers.smollm2_path())")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--http", action="store_true", help="also run a small HTTP load (needs uvicorn)")
    parser.add_argument("--http-requests", type=int, default=64)
    parser.add_argument("--http-concurrency", default="16", help="comma-separated: one HTTP load each")
    parser.add_argument("--modes", default="eager,graphs", help="eager, graphs or both")
    parser.add_argument("--prefill-lens", default="32,128,512,2048",
                        help="prompt lengths whose in-process time to first token is measured alone")
    parser.add_argument("--skip-hf", action="store_true", help="no HF generate baseline")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_bench needs CUDA (torch.cuda.is_available() is False)")
    path = args.model or smollm2_path()
    if path is None:
        raise SystemExit("no model: pass --model, set TPSERVE_GPU_MODEL, or carry .gpu_assets")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": model_kind(path),
        "dtype": args.dtype,
        "modes": {},
    }

    def save() -> None:  # after every stage: a run cut short still leaves its figures
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))

    modes = [(name, name == "eager") for name in args.modes.split(",")]
    prefill_lens = [int(n) for n in args.prefill_lens.split(",") if n]
    for name, eager in modes:
        print(f"{name}:", flush=True)
        report["modes"][name] = bench_mode(path, eager, args.dtype, batch_sizes, args.steps, prefill_lens)
        save()
    if args.http:
        report["http"] = {}
        for name, eager in modes:
            for concurrency in (int(c) for c in args.http_concurrency.split(",")):
                # 16 streams keep the plain mode name that device_check.sh's summary reads.
                key = name if concurrency == 16 else f"{name}-c{concurrency}"
                report["http"][key] = asyncio.run(http_load(path, args.dtype, eager, args.http_requests,
                                                            concurrency, max_tokens=64))
                print(f"  http {key}: {json.dumps(report['http'][key])}", flush=True)
                save()
                gc.collect()
                torch.cuda.empty_cache()
    if len(modes) < 2:
        print(json.dumps(report, indent=1))
        return
    report["graph_speedup"] = {
        str(b): {
            "step": report["modes"]["graphs"]["batches"][str(b)]["step_tokens_per_s"]
            / report["modes"]["eager"]["batches"][str(b)]["step_tokens_per_s"],
            "runner": report["modes"]["graphs"]["batches"][str(b)]["forward_tokens_per_s"]
            / report["modes"]["eager"]["batches"][str(b)]["forward_tokens_per_s"],
        }
        for b in batch_sizes
    }
    save()
    if not args.skip_hf:
        print("hf generate:", flush=True)
        report["hf_generate"] = bench_hf_generate(path, args.dtype, batch_sizes, args.steps)
        report["graphs_vs_hf_generate"] = {
            str(b): report["modes"]["graphs"]["batches"][str(b)]["step_tokens_per_s"]
            / report["hf_generate"][str(b)]["decode_tokens_per_s"]
            for b in batch_sizes
        }
        save()
    print(json.dumps(report, indent=1))

if __name__ == "__main__":
    main()
