"""Driving an LLMEngine to completion in tests, and HF transformers as the greedy reference."""

from __future__ import annotations

import functools

import torch

from deployments.config import TpserveConfig
from deployments.engine.engine import LLMEngine
from scheduler.sampling_params import SamplingParams
from workers.runner.kv_cache import KVCacheSpec
from workers.model.config import ModelConfig

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a land far away, there lived a",
    "Here is a list of the planets of the solar system, ordered by their distance to the sun:",
    "Question: What is the boiling point of water at sea level?\nAnswer:",
    "The quick brown fox",
    "In machine learning, a transformer is a deep learning architecture that",
    "1, 2, 3, 5, 8, 13,",
]


def kv_gib_for_blocks(model_path: str, num_blocks: int, block_size: int = 16) -> float:
    """The kv_cache_memory_gib that yields exactly num_blocks blocks (null block included)."""
    cfg = ModelConfig.from_pretrained(model_path)
    spec = KVCacheSpec(cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    return (num_blocks * spec.bytes_per_block + 1) / (1 << 30)


def run_engine(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Add every request at once, step until all finish; return output token ids per id."""
    for request_id, (prompt_ids, params) in requests.items():
        engine.add_request(request_id, prompt_ids, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return outputs


def make_engine(model_path: str, **overrides) -> LLMEngine:
    args = {"model": model_path, "dtype": "float32", "kv_cache_memory_gib": 0.25}
    args.update(overrides)
    return LLMEngine(TpserveConfig(**args))


@functools.lru_cache(maxsize=4)
def _hf_model(model_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_greedy(model_path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: the HF model's own forward with its KV cache, argmax at every step.

    A plain loop rather than `generate(min_new_tokens=...)`, which masks EOS and so differs from
    greedy-with-ignore_eos exactly where EOS is the argmax.
    """
    model = _hf_model(model_path)
    tokens: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            next_id = int(out.logits[0, -1].argmax())
            tokens.append(next_id)
            out = model(torch.tensor([[next_id]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
