"""GPU KV-cache budget arithmetic (pure, CPU) and the profiling forwards it is fed by.

budget = gpu_memory_utilization x total - in use after weights and profiling - activation peak
         - decode graph pool; max_model_len capped (one warning line) when that cannot hold one
         max_model_len request, a start error when it cannot hold one block.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.runner.kv_cache import (
    GiB,
    KVCacheSpec,
    KVCacheTooSmallError,
    MemoryProfile,
    allocate_kv_cache,
    max_model_len_for_blocks,
    gpu_kv_budget,
    num_blocks_for_budget,
)

MiB = 1 << 20


def _profile(**overrides) -> MemoryProfile:
    # An 80 GiB device, 8B bf16 weights (16 GiB) + context and NCCL (1 GiB) in use.
    base = MemoryProfile(total=80 * GiB, in_use=17 * GiB, weights=16 * GiB, activation_peak=2 * GiB,
                         graph_pool=1 * GiB)
    return dataclasses.replace(base, **overrides)


def test_budget_is_utilization_times_total_minus_in_use_peak_and_graph_pool():
    budget, note = gpu_kv_budget(_profile(), 0.9)
    assert budget == int(0.9 * 80 * GiB) - 17 * GiB - 2 * GiB - 1 * GiB  # 52 GiB
    for figure in ("0.90 x 80.0 GiB", "in use 17.00 GiB", "weights 16.00", "activation peak 2.00 GiB",
                   "decode graph pool 1.00 GiB"):
        assert figure in note


def test_memory_other_processes_hold_is_not_counted_twice_or_ignored():
    # Another process holds 10 GiB: it is part of what the device reports in use.
    alone, _ = gpu_kv_budget(_profile(), 0.9)
    shared, _ = gpu_kv_budget(_profile(in_use=27 * GiB), 0.9)
    assert alone - shared == 10 * GiB


def test_enforce_eager_frees_the_graph_pool_for_kv():
    graphs, _ = gpu_kv_budget(_profile(), 0.9)
    eager, _ = gpu_kv_budget(_profile(graph_pool=0), 0.9)
    assert eager - graphs == 1 * GiB


def test_budget_never_negative():
    assert gpu_kv_budget(_profile(in_use=79 * GiB), 0.5)[0] == 0


def test_blocks_from_budget():
    # Llama-3-8B per rank: 32 layers, 8 KV heads of 128, bf16, 16-token blocks: 2 MiB per block.
    spec = KVCacheSpec(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert spec.bytes_per_block == 2 * MiB
    assert num_blocks_for_budget(spec, 52 * GiB) == 52 * 512
    assert num_blocks_for_budget(spec, 2 * MiB - 1) == 0


@pytest.mark.parametrize(("max_model_len", "num_blocks", "expected"), [
    (4096, 257, 4096),     # 256 blocks of context + the null block
    (4096, 256, 4080),     # one block short: capped to the 255 blocks there are
    (4097, 257, 4096),     # one token more needs a 257th context block
    (16, 2, 16),
    (100, 2, 16),
])
def test_max_model_len_is_capped_to_what_one_request_can_hold(max_model_len, num_blocks, expected, caplog):
    with caplog.at_level("WARNING", logger="workers.runner.kv_cache"):
        assert max_model_len_for_blocks(num_blocks, 16, max_model_len, "0.90 x 80.0 GiB - ...") == expected
    if expected == max_model_len:
        assert not caplog.records
    else:
        (record,) = caplog.records
        line = record.getMessage()
        assert f"max_model_len {max_model_len} capped to {expected}" in line
        assert f"{num_blocks} blocks of 16 tokens" in line and "0.90 x 80.0 GiB" in line


@pytest.mark.parametrize("num_blocks", [0, 1])
def test_start_error_when_not_even_one_block_fits(num_blocks):
    with pytest.raises(KVCacheTooSmallError) as info:
        max_model_len_for_blocks(num_blocks, 16, 4096, "0.90 x 80.0 GiB - ...")
    message = str(info.value)
    assert f"room for {num_blocks} blocks" in message and "gpu_memory_utilization" in message
    assert "0.90 x 80.0 GiB" in message


def test_a_128k_model_on_a_small_budget_is_capped_to_the_cache():
    """8B at 128k context: one request needs 8193 blocks = 16 GiB of KV; with 16 GiB left (8192
    blocks, one short) max_model_len becomes 8191 blocks of tokens; with 52 GiB it stays."""
    spec = KVCacheSpec(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    budget, note = gpu_kv_budget(_profile(total=40 * GiB), 0.9)  # 36 - 20 = 16 GiB: 8192 blocks
    assert max_model_len_for_blocks(num_blocks_for_budget(spec, budget), 16, 131072, note) == 8191 * 16
    roomy, note = gpu_kv_budget(_profile(), 0.9)
    assert max_model_len_for_blocks(num_blocks_for_budget(spec, roomy), 16, 131072, note) == 131072


# ---- the profiling forwards run (CPU: the same code, without the CUDA peak counters) ------------
def test_profiling_forwards_run_on_a_tiny_model(tmp_path):
    from model_fixtures import make_tiny_llama
    from workers.runner import profiling
    from workers.distributed.parallel_state import SINGLE_RANK
    from workers.worker import WorkerConfig, WorkerCore

    path = make_tiny_llama(tmp_path / "llama", num_heads=8, num_kv_heads=2)
    cfg = WorkerConfig(model_path=path, dtype=torch.float32, block_size=16, max_model_len=100,
                       kv_cache_memory_gib=0.01, gpu_memory_utilization=0.9, device="cpu", max_num_seqs=5)
    worker = WorkerCore(cfg, SINGLE_RANK)
    worker.load_model()
    with torch.inference_mode():
        profiling._worst_step(worker.model, torch.device("cpu"), cfg)
        profiling._widest_decode_and_sampler(worker.model, torch.device("cpu"), cfg)


def test_cpu_caches_are_head_major_in_memory_and_other_devices_token_major():
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    for device, strides in ((torch.device("cpu"), (3 * 16 * 64, 64, 16 * 64, 1)),
                            (torch.device("meta"), (16 * 3 * 64, 3 * 64, 64, 1))):
        caches = allocate_kv_cache(spec, num_blocks=5, device=device)
        assert len(caches) == 2
        for k, v in caches:
            assert k.shape == v.shape == (5, 16, 3, 64)
            assert k.stride() == v.stride() == strides, device
