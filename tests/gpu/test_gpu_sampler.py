"""The sampler on CUDA: the same tokens as on the CPU for greedy and seeded rows (seeded noise is
drawn from each request's CPU generator), logprobs within float tolerance, and ONE synchronizing
device -> host transfer per step (CUDA's sync debug mode counts them)."""

from __future__ import annotations

import warnings

import pytest
import torch

from scheduler.sampling_params import SamplingParams as SP
from tests.sampling_reference import row
from workers.sampling.sampler import sample

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PARAMS = [
    SP(temperature=0.0),
    SP(temperature=0.0, repetition_penalty=1.3, logprobs=5),
    SP(temperature=0.8, top_k=40, seed=1),
    SP(temperature=1.1, top_p=0.9, frequency_penalty=0.5, presence_penalty=0.2, seed=2, logprobs=3),
    SP(temperature=0.9, min_p=0.05, logit_bias={11: 3.0}, min_tokens=10, seed=3),
    SP(temperature=1.0, seed=4),
]


def rows():
    return [row(p, torch.Generator().manual_seed(p.seed) if p.seed is not None else None) for p in PARAMS]


def test_cuda_tokens_equal_cpu_tokens_for_greedy_and_seeded_rows():
    logits = torch.randn(len(PARAMS), 49152, generator=torch.Generator().manual_seed(0)) * 3
    on_cpu = sample(logits, rows())
    on_gpu = sample(logits.cuda(), rows())
    assert not on_cpu.errors and not on_gpu.errors
    assert on_gpu.token_ids == on_cpu.token_ids
    for cpu_lp, gpu_lp in zip(on_cpu.logprobs, on_gpu.logprobs):
        assert (cpu_lp is None) == (gpu_lp is None)
        if cpu_lp is not None:
            assert gpu_lp.sampled[0] == cpu_lp.sampled[0]
            assert gpu_lp.sampled[1] == pytest.approx(cpu_lp.sampled[1], abs=1e-4)
            assert [t for t, _ in gpu_lp.top] == [t for t, _ in cpu_lp.top]


def test_one_synchronizing_transfer_per_step():
    logits = torch.randn(len(PARAMS), 49152, device="cuda")
    sample(logits, rows())  # warm up kernels and caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sample(logits, rows())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
