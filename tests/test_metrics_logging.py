"""The progress line and the startup lines of METRICS.md section 6; the fanout."""

from __future__ import annotations

import logging

from metrics.logging_logger import LoggingStatLogger
from metrics.stat_logger import StatLogger, StatLoggerFanout
from metrics.startup import (
    GIB,
    cache_config_info,
    format_kv_cache,
    format_max_concurrency,
    format_memory_budget,
    format_weights_loaded,
)
from metrics.stats import FinishedRequestStats, IterationStats, KVCacheSnapshot, SchedulerStats

KV = KVCacheSnapshot(
    block_size=16, total_blocks=512, used_blocks=75, cached_blocks=4, free_blocks=433, used_tokens=1200, cached_tokens=64
)


def step(prefill_tokens: int, decode_tokens: int, num_generation_tokens: int, num_preemptions_decode: int = 0):
    return IterationStats(
        scheduler=SchedulerStats(
            num_running=3,
            num_waiting=1,
            prefill_tokens=prefill_tokens,
            decode_tokens=decode_tokens,
            num_batch_requests=3,
            num_preemptions_decode=num_preemptions_decode,
            kv=KV,
        ),
        num_generation_tokens=num_generation_tokens,
    )


class FakeClock:
    def __init__(self):
        self.ts = 0.0

    def __call__(self) -> float:
        return self.ts


def make_logger(caplog):
    clock = FakeClock()
    logger = logging.getLogger("tpserve.test.progress")
    caplog.set_level(logging.INFO, logger=logger.name)
    return LoggingStatLogger(interval_s=5.0, logger=logger, clock=clock), clock


def test_progress_line_accumulates_between_lines(caplog):
    stat_logger, clock = make_logger(caplog)
    stat_logger.record(step(300, 2, 3))  # t = 0: starts the window
    clock.ts = 2.0
    stat_logger.record(step(100, 3, 3, num_preemptions_decode=1))
    clock.ts = 4.0
    stat_logger.record(step(0, 3, 3))
    assert caplog.messages == []  # less than interval_s since the window started
    clock.ts = 5.0
    stat_logger.record(step(0, 4, 3))
    assert caplog.messages == [
        "Running: 3 reqs, Waiting: 1 reqs, KV cache: used 1200 / 8192 tokens (14.6%), cached 64 tokens, "
        "avg prefill 100.0 tok/step, avg decode 3.0 tok/step, prompt throughput 80.0 tok/s, "
        "generation throughput 2.4 tok/s, preemptions 1"
    ]
    # the window was drained: the next line only counts what came after
    clock.ts = 10.0
    stat_logger.record(step(50, 0, 0))
    assert caplog.messages[-1].endswith(
        "avg prefill 50.0 tok/step, avg decode 0.0 tok/step, prompt throughput 10.0 tok/s, "
        "generation throughput 0.0 tok/s, preemptions 0"
    )


def test_no_line_when_idle(caplog):
    stat_logger, clock = make_logger(caplog)
    idle = IterationStats(scheduler=SchedulerStats(kv=KV))
    stat_logger.record(idle)
    clock.ts = 60.0
    stat_logger.record(idle)
    assert caplog.messages == []


def test_startup_lines():
    assert format_weights_loaded(GIB // 4, 1.844, rank=0, tensor_parallel_size=2) == (
        "Rank 0/2: model weights loaded: 0.25 GiB in 1.84 s"
    )
    assert format_memory_budget(
        total_bytes=100 * GIB,
        memory_utilization=0.9,
        weights_bytes=10 * GIB,
        activation_peak_bytes=2 * GIB,
        kv_cache_bytes=70 * GIB,
        rank=1,
        tensor_parallel_size=2,
    ) == (
        "Rank 1/2: memory budget 0.90 x 100.00 GiB = 90.00 GiB: weights 10.00 GiB + activation peak 2.00 GiB"
        " + KV cache 70.00 GiB + unassigned 8.00 GiB"
    )
    assert format_kv_cache(512, 16, GIB // 2) == "KV cache: 512 blocks x 16 tokens = 8192 tokens (0.50 GiB per rank)"
    assert format_max_concurrency(8192, 3000) == "Maximum concurrency for 3000 tokens per request: 2.73x"


def test_cache_config_info_labels():
    assert cache_config_info(
        block_size=16, num_blocks=512, max_model_len=2048, tensor_parallel_size=2, enable_prefix_caching=True, dtype="torch.bfloat16"
    ) == {
        "block_size": "16",
        "num_blocks": "512",
        "capacity_tokens": "8192",
        "max_model_len": "2048",
        "max_concurrency": "4.00",
        "tensor_parallel_size": "2",
        "enable_prefix_caching": "true",
        "dtype": "bfloat16",
        # The endpoint picker's name for the KV blocks (Gateway API Inference Extension).
        "num_gpu_blocks": "512",
    }


class RecordingLogger(StatLogger):
    def __init__(self):
        self.calls = []

    def record(self, iteration):
        self.calls.append(("record", iteration))

    def record_finished(self, stats):
        self.calls.append(("record_finished", stats))

    def log_cache_config(self, info):
        self.calls.append(("log_cache_config", info))


def test_fanout_forwards_to_every_logger_in_order():
    first, second = RecordingLogger(), RecordingLogger()
    fanout = StatLoggerFanout([first, second])
    iteration = step(1, 1, 1)
    finished = FinishedRequestStats("stop", 1, 1, 0, 0)
    fanout.log_cache_config({"block_size": "16"})
    fanout.record(iteration)
    fanout.record_finished(finished)
    expected = [("log_cache_config", {"block_size": "16"}), ("record", iteration), ("record_finished", finished)]
    assert first.calls == expected and second.calls == expected
