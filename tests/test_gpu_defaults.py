"""GPU step sizes derived from free memory and the model when the user left them unset (pure
arithmetic, on CPU); on CPU the configured defaults stand exactly."""

from __future__ import annotations

import pytest

from model_configs.scaled import LLAMA_3_8B
from workers.model.config import ModelConfig
from workers.runtime import (STEP_SIZE_FIELDS, StepSizes, gpu_step_defaults, kv_bytes_per_token,
                             resolve_step_sizes, weight_bytes_per_rank)

GiB = 1 << 30
# The server's configured defaults (deployments/config.py), which CPU servers run with.
CPU_DEFAULTS = StepSizes(max_num_seqs=64, max_num_batched_tokens=2048, max_cuda_graph_batch_size=256,
                         max_cuda_graph_tokens=2048)


@pytest.fixture(scope="module")
def llama8b() -> ModelConfig:
    return ModelConfig.from_pretrained(LLAMA_3_8B)


def test_llama3_8b_sizes_per_rank_match_the_published_model(llama8b):
    # 8.03 B parameters in bf16; 32 layers x 8 KV heads x 128 x K and V x 2 bytes = 128 KiB a token.
    assert weight_bytes_per_rank(llama8b, 2, 1) == pytest.approx(8.03e9 * 2, rel=0.01)
    assert kv_bytes_per_token(llama8b, 2, 1) == 128 * 1024
    assert kv_bytes_per_token(llama8b, 2, 2) == 64 * 1024


def test_an_h200_gets_vllms_large_gpu_sizes(llama8b):
    sizes = gpu_step_defaults(139 * GiB, llama8b, 2, 1, 0.9)
    assert (sizes.max_num_seqs, sizes.max_num_batched_tokens) == (256, 8192)
    assert sizes.max_cuda_graph_batch_size == 256 and sizes.max_cuda_graph_tokens == 2048
    assert "139.0 GiB free" in sizes.note


def test_a_24_gib_gpu_gets_what_its_kv_room_holds(llama8b):
    # 0.9 x 24 GiB - 14.96 GiB of weights = 6.64 GiB = ~54k tokens of KV: 32 sequences of 1024
    # tokens fit, 64 would not; 5% of that room holds 2048 tokens of activations, not 4096.
    sizes = gpu_step_defaults(24 * GiB, llama8b, 2, 1, 0.9)
    assert (sizes.max_num_seqs, sizes.max_num_batched_tokens, sizes.max_cuda_graph_batch_size) == (32, 2048, 32)


def test_sizes_never_shrink_as_free_memory_grows(llama8b):
    previous = None
    for free in range(16, 200, 4):
        sizes = gpu_step_defaults(free * GiB, llama8b, 2, 1, 0.9)
        assert 16 <= sizes.max_num_seqs <= 256 and 2048 <= sizes.max_num_batched_tokens <= 8192
        assert sizes.max_num_batched_tokens >= sizes.max_num_seqs
        if previous is not None:
            assert sizes.max_num_seqs >= previous.max_num_seqs
            assert sizes.max_num_batched_tokens >= previous.max_num_batched_tokens
        previous = sizes


def test_tensor_parallel_ranks_each_hold_less_so_more_fits(llama8b):
    one = gpu_step_defaults(24 * GiB, llama8b, 2, 1, 0.9)
    two = gpu_step_defaults(24 * GiB, llama8b, 2, 2, 0.9)
    assert two.max_num_seqs > one.max_num_seqs


def test_unknown_free_memory_takes_vllms_defaults(llama8b):
    sizes = gpu_step_defaults(None, llama8b, 2, 2, 0.9)
    assert (sizes.max_num_seqs, sizes.max_num_batched_tokens) == (256, 8192)


def _never():
    raise AssertionError("derive must not run")


def test_cpu_keeps_the_configured_defaults_exactly():
    assert resolve_step_sizes(CPU_DEFAULTS, set(), "cpu", _never) is CPU_DEFAULTS


def test_fields_the_user_set_are_kept_on_gpu(llama8b):
    derived = lambda: gpu_step_defaults(139 * GiB, llama8b, 2, 1, 0.9)  # noqa: E731
    assert resolve_step_sizes(CPU_DEFAULTS, set(STEP_SIZE_FIELDS), "cuda", _never) is CPU_DEFAULTS
    only_seqs = resolve_step_sizes(CPU_DEFAULTS, {"max_num_seqs"}, "cuda", derived)
    assert only_seqs.max_num_seqs == 64 and only_seqs.max_num_batched_tokens == 8192
    assert only_seqs.max_cuda_graph_batch_size == 256
    # A budget the user chose below the derived sequence count bounds it: each decode is a token.
    small_budget = StepSizes(64, 128, 256, 2048)
    resolved = resolve_step_sizes(small_budget, {"max_num_batched_tokens"}, "cuda", derived)
    assert resolved.max_num_batched_tokens == 128 and resolved.max_num_seqs == 128
    assert resolved.max_cuda_graph_tokens == 128


def test_nothing_set_on_gpu_takes_every_derived_field(llama8b, caplog):
    with caplog.at_level("INFO", logger="workers.runtime"):
        resolved = resolve_step_sizes(CPU_DEFAULTS, set(), "cuda",
                                      lambda: gpu_step_defaults(139 * GiB, llama8b, 2, 1, 0.9))
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens, resolved.max_cuda_graph_batch_size,
            resolved.max_cuda_graph_tokens) == (256, 8192, 256, 2048)
    assert any("max_num_seqs 256, max_num_batched_tokens 8192" in r.getMessage() for r in caplog.records)
