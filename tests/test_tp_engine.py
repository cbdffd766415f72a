"""Tensor-parallel engine: greedy outputs token-identical to TP=1 and to HF transformers.

TP=2 on a tiny random Llama (8 heads, 4 KV heads) and TP=3 on SmolLM2-135M (9 heads, 3 KV
heads, one KV head per rank), 8 prompts x 32 tokens each, with the default budget, with chunked
prefill (a token budget smaller than every prompt) and with a KV cache so small that requests
are preempted and recomputed. Workers are Ray actors in a placement group of our own.
"""

from __future__ import annotations

import time

import pytest
import torch

from deployments.config import TpserveConfig
from deployments.engine.engine import LLMEngine
from model_fixtures import default_model_path, make_tiny_llama
from scheduler.sampling_params import SamplingParams
from workers.runner.kv_cache import GiB, kv_spec_for
from workers.model.config import ModelConfig

NUM_PROMPTS = 8
MAX_TOKENS = 32
BLOCK_SIZE = 16
# Chunked-prefill runs: a per-step token budget below every prompt's length.
CHUNK_BUDGET = 16
# Preemption runs: KV blocks for 8 prompts (2 blocks each) but not for their 32-token outputs.
SMALL_KV_BLOCKS = 20

TEXTS = [
    "The long history of the printing press in Europe begins in the middle of the fifteenth century, when Johannes Gutenberg",
    "Photosynthesis is the remarkable process by which green plants, algae and some other organisms use the energy of sunlight to",
    "In computer science, a hash table is a data structure that implements an associative array and",
    "The Pacific Ocean is the largest and deepest of the five oceanic divisions of our world, and it extends from",
    "Once upon a time in a small village at the foot of the mountains, there lived an old clockmaker who",
    "To bake a simple loaf of bread at home you will need flour, water, salt and yeast; first you should",
    "The theory of general relativity, published by Albert Einstein in 1915, describes gravity as a",
    "Rust and Python are both popular programming languages, but they differ a great deal in how each of them manages memory,",
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-h8-kv4"), num_heads=8, num_kv_heads=4)


def prompts_for(model_path: str) -> list[list[int]]:
    """The texts' token ids cut to one common length (so HF can run them as one batch, unpadded)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS[:NUM_PROMPTS]]
    length = min(len(p) for p in prompts)
    assert length > CHUNK_BUDGET, "chunked runs need prompts longer than the token budget"
    return [p[:length] for p in prompts]


def hf_greedy(model_path: str, prompts: list[list[int]]) -> list[list[int]]:
    """Reference: HF transformers, greedy, no EOS stop; the equal-length prompts as one batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    cache, generated = None, []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: OpenMP spin-waits crawl on a loaded 2-core machine
    try:
        with torch.inference_mode():
            for _ in range(MAX_TOKENS):
                out = model(ids, cache=cache, use_cache=True)
                cache = out.cache
                ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
                generated.append(ids[:, 0].tolist())
    finally:
        torch.set_num_threads(threads)
    return [list(tokens) for tokens in zip(*generated)]


def kv_gib_for_blocks(model_path: str, tensor_parallel_size: int, num_blocks: int) -> float:
    """The per-rank KV budget that holds num_blocks blocks at this TP size."""
    cfg = ModelConfig.from_pretrained(model_path)
    local_kv_heads = max(1, cfg.num_key_value_heads // tensor_parallel_size)
    spec = kv_spec_for(cfg, BLOCK_SIZE, local_kv_heads, torch.float32)
    return (num_blocks + 0.5) * spec.bytes_per_block / GiB


def run_engine(model_path: str, prompts: list[list[int]], tensor_parallel_size: int,
               **overrides) -> tuple[list[list[int]], int]:
    """Greedy outputs of every prompt (all submitted at once) and the number of preemptions."""
    config = TpserveConfig(model=model_path, tensor_parallel_size=tensor_parallel_size, block_size=BLOCK_SIZE,
                           max_model_len=256, kv_cache_memory_gib=overrides.pop("kv_cache_memory_gib", 0.05),
                           enable_prefix_caching=False, dtype="float32", cpu_threads=1, **overrides)
    engine = LLMEngine(config)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"req-{i}", prompt, params)
        outputs: dict[str, list[int]] = {f"req-{i}": [] for i in range(len(prompts))}
        num_preemptions = 0
        deadline = time.monotonic() + 120
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "generation did not finish in 120 s"
            for out in engine.step():
                assert out.error is None, out.error
                outputs[out.request_id].extend(out.new_token_ids)
            stats = engine.last_iteration.scheduler
            num_preemptions += stats.num_preemptions_decode + stats.num_preemptions_prefill
        return [outputs[f"req-{i}"] for i in range(len(prompts))], num_preemptions
    finally:
        engine.shutdown()


def assert_same_tokens(actual: list[list[int]], expected: list[list[int]], what: str) -> None:
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert len(a) == MAX_TOKENS, f"{what}: prompt {i} produced {len(a)} tokens"
        assert a == e, f"{what}: prompt {i} differs at token {next(j for j, (x, y) in enumerate(zip(a, e)) if x != y)}"


def check_tp_matches(model_path: str, tensor_parallel_size: int) -> None:
    prompts = prompts_for(model_path)
    reference = hf_greedy(model_path, prompts)
    tp1, _ = run_engine(model_path, prompts, 1)
    assert_same_tokens(tp1, reference, "TP=1 vs HF")

    # Whole prompts in one step are covered by the preemption run below (the default budget), so
    # the TP engine starts twice, not three times (each start loads the model on every rank).
    chunked, _ = run_engine(model_path, prompts, tensor_parallel_size, max_num_batched_tokens=CHUNK_BUDGET)
    assert_same_tokens(chunked, reference, f"TP={tensor_parallel_size} chunked prefill vs HF")

    small_kv = kv_gib_for_blocks(model_path, tensor_parallel_size, SMALL_KV_BLOCKS)
    preempted, num_preemptions = run_engine(model_path, prompts, tensor_parallel_size, kv_cache_memory_gib=small_kv)
    assert num_preemptions > 0, "the small KV cache did not force any preemption"
    assert_same_tokens(preempted, reference, f"TP={tensor_parallel_size} with preemption vs HF")


def test_tp2_tiny_llama_matches_tp1_and_hf(ray_cluster, tiny_model):
    check_tp_matches(tiny_model, 2)


def test_tp3_smollm2_matches_tp1_and_hf(ray_cluster):
    check_tp_matches(default_model_path(), 3)


def test_tp_size_that_does_not_divide_heads_fails_at_start(tiny_model):
    # No Ray needed: the executor checks the model's head counts before starting any worker.
    config = TpserveConfig(model=tiny_model, tensor_parallel_size=3, kv_cache_memory_gib=0.01, max_model_len=256)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not fit .*num_attention_heads=8"):
        LLMEngine(config)

