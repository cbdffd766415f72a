"""On a GPU: the memory profile covers a real step of the worst shape, and dummy weights serve
Llama-3-8B's layer shapes. (CPU versions: tests/test_memory_profile.py, tests/test_dummy_weights.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (model_configs)

from model_configs.scaled import LLAMA_3_8B, scaled_config  # noqa: E402
from scheduler.math_utils import cdiv  # noqa: E402
from scheduler.outputs import NewRequestData, SchedulerOutput  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available (torch.cuda.is_available() is False)")

BLOCK_SIZE = 16


def _worker(path: str, **overrides):
    from workers.distributed.parallel_state import SINGLE_RANK
    from workers.worker import WorkerConfig, WorkerCore

    base = dict(model_path=path, dtype=torch.bfloat16, block_size=BLOCK_SIZE, max_model_len=2048,
                kv_cache_memory_gib=0.0, gpu_memory_utilization=0.5, device="cuda", max_num_seqs=32,
                max_num_batched_tokens=1024, max_cuda_graph_tokens=0, load_format="dummy")
    return WorkerCore(WorkerConfig(**{**base, **overrides}), SINGLE_RANK)


def test_a_real_worst_shape_step_stays_inside_the_profiled_peak(tmp_path):
    """A Llama-3-8B-shaped (4 layers) dummy model: the worst step on real, distinct blocks (the
    profile ran it on one aliased block) allocates no more than the profile reserved."""
    from workers.runner.profiling import profile_memory, worst_step_shape

    worker = _worker(scaled_config("llama-3-8b", tmp_path / "m", hidden_size=4096, num_hidden_layers=4,
                                   num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                                   vocab_size=128256, max_position_embeddings=8192))
    report = worker.load_model()
    profile = profile_memory(worker.model, worker.device, worker.config, report.param_bytes)
    cfg = worker.config
    shape = worst_step_shape(cfg)
    per_request = cdiv(cfg.max_model_len, BLOCK_SIZE)
    worker.init_kv_cache(1 + (shape.num_decodes + 1) * per_request)
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.95, top_k=50, logprobs=5)
    reqs, scheduled = [], {}
    for i in range(shape.num_decodes + 1):
        rid = f"r{i}"
        prefill = i == shape.num_decodes
        cached = shape.prefill_cached_tokens if prefill else cfg.max_model_len - 1
        reqs.append(NewRequestData(rid, torch.randint(100, 128000, (cfg.max_model_len,)).tolist(), params,
                                   list(range(1 + i * per_request, 1 + (i + 1) * per_request)), cached))
        scheduled[rid] = shape.prefill_tokens if prefill else 1
    out = SchedulerOutput(scheduled_new_reqs=reqs, num_scheduled_tokens=scheduled,
                          total_num_scheduled_tokens=shape.num_tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    worker.execute_model(out)
    torch.cuda.synchronize()
    step_peak = torch.cuda.max_memory_allocated() - before
    assert step_peak <= profile.activation_peak + (16 << 20), (step_peak, profile)
    worker.release()


def test_llama3_8b_layer_shapes_run_with_dummy_weights(tmp_path):
    """Full Llama-3-8B widths (2 of its 32 layers): finite logits that differ between tokens."""
    published = json.loads((LLAMA_3_8B / "config.json").read_text())
    widths = {k: published[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                        "intermediate_size", "vocab_size", "max_position_embeddings")}
    worker = _worker(scaled_config("llama-3-8b", tmp_path / "m", **widths, num_hidden_layers=2))
    report = worker.load_model()
    worker.init_kv_cache(min(report.num_blocks, 256))
    prompt = torch.randint(100, 128000, (100,)).tolist()
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("r", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5),
                                           list(range(1, 1 + cdiv(101, BLOCK_SIZE))), 0)],
        num_scheduled_tokens={"r": 100}, total_num_scheduled_tokens=100)
    result = worker.execute_model(out)
    (logprobs,) = result.logprobs["r"]
    values = [lp for _, lp in logprobs.top]
    assert all(v == v and v > float("-inf") for v in values) and len(set(values)) > 1
    worker.release()
