"""The GPU memory profile covers the worst step: a prefill chunk of the whole step budget ending at
max_model_len plus max_num_seqs decodes of max_model_len, through the model runner's own path.
On CPU: the step's shape, the forward it produces on a tiny dummy model, every step the real
scheduler forms staying inside it, and profile_memory's use of it (CUDA counters faked)."""

from __future__ import annotations

import random

import pytest
import torch

from model_configs.scaled import scaled_config
from scheduler_factories import FakeRunner, make_request, make_scheduler
from workers.distributed.parallel_state import SINGLE_RANK
from workers.runner import profiling
from workers.runner.kv_cache import GiB
from workers.runner.profiling import WorstStepDoesNotFitError, worst_step_output, worst_step_shape
from workers.worker import WorkerConfig, WorkerCore


def _config(path: str = "unused", **overrides) -> WorkerConfig:
    base = dict(model_path=path, dtype=torch.float32, block_size=16, max_model_len=200, kv_cache_memory_gib=0.01,
                gpu_memory_utilization=0.9, device="cpu", max_num_seqs=5, max_num_batched_tokens=48,
                load_format="dummy", cpu_prepack_linear=False)
    return WorkerConfig(**{**base, **overrides})


def test_worst_step_is_a_full_budget_at_the_deepest_context_plus_every_decode():
    shape = worst_step_shape(_config())
    assert (shape.prefill_tokens, shape.prefill_cached_tokens, shape.num_decodes, shape.decode_context_len) == (
        48, 152, 5, 200)
    assert shape.num_tokens == 53
    # A budget above max_model_len is one whole request from position 0.
    assert worst_step_shape(_config(max_num_batched_tokens=8192)).prefill_tokens == 200


def test_worst_step_output_reads_whole_contexts_through_one_scratch_block():
    out = worst_step_output(worst_step_shape(_config()), block_size=16)
    assert out.total_num_scheduled_tokens == 53
    by_id = {r.req_id: r for r in out.scheduled_new_reqs}
    decodes = [rid for rid, n in out.num_scheduled_tokens.items() if n == 1]
    assert len(decodes) == 5
    for rid in decodes:  # one token at position 199, after 199 cached
        req = by_id[rid]
        assert len(req.token_ids) == 200 and req.num_computed_tokens == 199
        assert req.block_ids == [1] * 13
    prefill = by_id["profile-prefill"]
    assert out.num_scheduled_tokens["profile-prefill"] == 48
    assert prefill.num_computed_tokens == 152 and len(prefill.token_ids) == 200 and prefill.block_ids == [1] * 13


def test_the_profiled_forward_has_the_worst_step_shape(tmp_path, monkeypatch):
    cfg = _config(scaled_config("llama-3-8b", tmp_path / "m"))
    worker = WorkerCore(cfg, SINGLE_RANK)
    worker.load_model()
    seen = {}
    forward = worker.model.forward

    def recording_forward(input_ids, positions, kv_caches, meta):
        seen.update(tokens=input_ids.numel(), last_position=int(positions.max()), decodes=meta.num_decodes,
                    chunks=[(c.query_len, c.context_len) for c in meta.prefills], cache_blocks=kv_caches[0][0].shape[0])
        return forward(input_ids, positions, kv_caches, meta)

    monkeypatch.setattr(worker.model, "forward", recording_forward)
    with torch.inference_mode():
        profiling._worst_step(worker.model, torch.device("cpu"), cfg)
    assert seen == {"tokens": 53, "last_position": 199, "decodes": 5, "chunks": [(48, 200)], "cache_blocks": 2}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_step_the_scheduler_forms_fits_inside_the_profiled_one(seed):
    """Random prompts and lengths through the real scheduler under the same limits: no step has
    more decodes, more prefill tokens, more tokens or a deeper context than the profiled step."""
    cfg = _config(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    shape = worst_step_shape(cfg)
    scheduler = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=16,
                               num_blocks=200)
    runner = FakeRunner(16, 200)
    rng = random.Random(seed)
    for _ in range(30):
        prompt = rng.randint(1, 220)
        scheduler.add_request(make_request(prompt, max_tokens=rng.randint(1, 256 - prompt), ignore_eos=True))
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        decodes = sum(1 for n in out.num_scheduled_tokens.values() if n == 1)
        prefill = sum(n for n in out.num_scheduled_tokens.values() if n > 1)
        deepest = max((scheduler.requests[r].num_computed_tokens + n for r, n in out.num_scheduled_tokens.items()),
                      default=0)
        assert decodes <= shape.num_decodes and prefill <= shape.prefill_tokens
        assert out.total_num_scheduled_tokens <= shape.num_tokens and deepest <= shape.decode_context_len
        scheduler.update_from_output(out, runner.execute(out))
        steps += 1
    assert steps > 10


class FakeCudaCounters:
    """torch.cuda's allocator counters for a device that is not here: runs bump `allocated`."""

    def __init__(self, total: int, in_use: int) -> None:
        self.total, self.in_use = total, in_use
        self.allocated = self.peak = 0

    def transient(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.allocated + nbytes)

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", 0))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.total - self.in_use, self.total))


def test_profile_reserves_the_worst_step_when_it_outgrows_the_graph_decode(monkeypatch):
    counters = FakeCudaCounters(total=80 * GiB, in_use=17 * GiB)
    counters.install(monkeypatch)
    ran = []
    monkeypatch.setattr(profiling, "_worst_step",
                        lambda model, device, config: (ran.append(worst_step_shape(config)), counters.transient(6 * GiB)))
    monkeypatch.setattr(profiling, "_on_capture_stream",
                        lambda device, run, model, config: counters.transient(2 * GiB))
    cfg = _config(device="cuda", max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=256)
    profile = profiling.profile_memory(None, torch.device("cuda", 0), cfg, 16 * GiB)
    assert ran == [worst_step_shape(cfg)]
    assert profile.activation_peak == 6 * GiB and profile.graph_pool == 2 * GiB and profile.in_use == 17 * GiB


def test_a_worst_step_that_fits_only_shorter_caps_max_model_len_with_a_warning(monkeypatch, caplog):
    """Llama-3.1's own 131,072 with 256 decodes: each try that runs out of memory halves the
    length; the first that fits is profiled for the graphs too, returned and logged."""
    counters = FakeCudaCounters(total=139 * GiB, in_use=17 * GiB)
    counters.install(monkeypatch)
    tried, graphs_at = [], []

    def worst_step(model, device, config):
        tried.append(config.max_model_len)
        if config.max_model_len > 20_000:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        counters.transient(5 * GiB)

    monkeypatch.setattr(profiling, "_worst_step", worst_step)
    monkeypatch.setattr(profiling, "_on_capture_stream",
                        lambda device, run, model, config: graphs_at.append(config.max_model_len))
    cfg = _config(device="cuda", max_model_len=131072, max_num_batched_tokens=8192, max_num_seqs=256)
    with caplog.at_level("WARNING", logger="workers.runner.profiling"):
        profile = profiling.profile_memory(None, torch.device("cuda", 0), cfg, 16 * GiB)
    assert tried == [131072, 65536, 32768, 16384] and graphs_at == [16384]
    assert profile.max_model_len == 16384 and profile.activation_peak == 5 * GiB
    (record,) = caplog.records
    assert "max_model_len 131072 capped to 16384" in record.getMessage()
    assert "256 decodes of 131072 tokens" in record.getMessage()


def test_a_worst_step_that_never_fits_names_what_to_lower(monkeypatch):
    FakeCudaCounters(total=80 * GiB, in_use=17 * GiB).install(monkeypatch)

    def oom(model, device, config):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(profiling, "_worst_step", oom)
    cfg = _config(device="cuda", max_model_len=131072, max_num_batched_tokens=8192, max_num_seqs=256)
    with pytest.raises(WorstStepDoesNotFitError) as info:
        profiling.profile_memory(None, torch.device("cuda", 0), cfg, 16 * GiB)
    message = str(info.value)
    assert "8192 prefill tokens after 122880 cached" in message and "256 decodes of 131072 tokens" in message
    assert "nor does it at max_model_len 16" in message
    for field in ("max_num_batched_tokens", "max_num_seqs"):
        assert field in message


@pytest.mark.parametrize(("profiled_len", "budget_blocks", "expected"), [
    (None, None, 4096),   # room for every token: as configured
    (None, 96, 95 * 16),  # a 96-block budget (one the null block) holds 1,520 tokens for one request
    (2048, None, 2048),   # the worst step fit only at 2048 (profiling capped it)
])
def test_worker_core_reports_the_capped_max_model_len(tmp_path, monkeypatch, caplog, profiled_len, budget_blocks,
                                                      expected):
    """On a (faked) GPU rank: the load report's max_model_len is the configured one, or what the
    KV cache holds for one request, or what the worst step fit at, whichever is least."""
    import workers.worker as worker_module
    from workers.runner.kv_cache import MemoryProfile

    total = 80 * GiB
    # The scaled Llama: 2 layers x 2 KV heads x 16 dims x fp32 x (K, V) x 16 tokens = 8 KiB a block.
    in_use = 1 * GiB if budget_blocks is None else int(0.9 * total) - budget_blocks * 8192
    monkeypatch.setattr(profiling, "profile_memory", lambda model, device, config, weights: MemoryProfile(
        total=total, in_use=in_use, weights=weights, activation_peak=0, graph_pool=0, max_model_len=profiled_len))
    real_build = worker_module.build_model

    def build_on_cpu(*args, **kwargs):
        with torch.device("cpu"):
            return real_build(*args, **kwargs)

    monkeypatch.setattr(worker_module, "build_model", build_on_cpu)
    cfg = _config(scaled_config("llama-3-8b", tmp_path / "m"), device="cuda", max_model_len=4096)
    core = WorkerCore(cfg, SINGLE_RANK, local_rank=0)
    monkeypatch.setattr(worker_module, "bind_device", lambda device: None)
    with caplog.at_level("WARNING", logger="workers.runner.kv_cache"):
        report = core.load_model()
    assert report.max_model_len == core.max_model_len == expected
    if budget_blocks is not None:
        assert report.num_blocks == 96
        assert any("max_model_len 4096 capped to 1520" in r.getMessage() for r in caplog.records)
