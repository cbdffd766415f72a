"""Prompt logprobs with tensor parallelism (TP=2 Ray workers; rank 0 gathers the vocabulary
shards) and with preemption, on a tiny random Llama against HF transformers: chunked prefill
(16-token steps) and a KV cache too small for every request, so requests are preempted and their
prompts recomputed, yet each still gets every prompt position exactly once, with HF's values.
"""

from __future__ import annotations

import pytest

from deployments.config import TpserveConfig
from deployments.engine.engine import LLMEngine
from model_fixtures import make_tiny_llama
from scheduler.sampling_params import SamplingParams
from test_engine_prompt_logprobs import assert_prompt_logprobs_match, hf_prompt_logprobs, run_collecting
from test_tp_engine import BLOCK_SIZE, CHUNK_BUDGET, SMALL_KV_BLOCKS, kv_gib_for_blocks, prompts_for

NUM_TOP = 2


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-plp"), num_heads=8, num_kv_heads=4)


def check_prompt_logprobs(model_path: str, tensor_parallel_size: int) -> None:
    prompts = prompts_for(model_path)
    config = TpserveConfig(
        model=model_path, tensor_parallel_size=tensor_parallel_size, block_size=BLOCK_SIZE, max_model_len=256,
        kv_cache_memory_gib=kv_gib_for_blocks(model_path, tensor_parallel_size, SMALL_KV_BLOCKS),
        max_num_batched_tokens=CHUNK_BUDGET, dtype="float32", cpu_threads=1,
    )
    engine = LLMEngine(config)
    try:
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, prompt_logprobs=NUM_TOP)
        requests = {f"req-{i}": (prompt, params) for i, prompt in enumerate(prompts)}
        preemptions = 0
        original_step = engine.step

        def counting_step():
            nonlocal preemptions
            outputs = original_step()
            stats = engine.last_iteration.scheduler
            preemptions += stats.num_preemptions_decode + stats.num_preemptions_prefill
            return outputs

        engine.step = counting_step
        _, prompt_lps, _ = run_collecting(engine, requests)
    finally:
        engine.shutdown()
    assert preemptions > 0, "the small KV cache did not force any preemption"
    for i, prompt in enumerate(prompts):
        (entries,) = prompt_lps[f"req-{i}"]
        assert_prompt_logprobs_match(entries, prompt, hf_prompt_logprobs(model_path, prompt), NUM_TOP)


def test_prompt_logprobs_with_preemption_tp1(tiny_model):
    check_prompt_logprobs(tiny_model, 1)


def test_prompt_logprobs_tp2(ray_cluster, tiny_model):
    check_prompt_logprobs(tiny_model, 2)
