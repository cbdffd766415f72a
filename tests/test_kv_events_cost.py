"""What KV-cache events cost the engine's step, and proof that they change nothing it decides.

The test: the same workload (shared prefixes, evictions, preemptions) scheduled with events off
and on gives identical scheduler outputs, step by step.

The benchmark: the scheduler alone (schedule + update with a trivial runner; no model, so every
cost shows at its largest) on a 256-request workload, in three modes:
  off        no collector (the default)
  collect    the pool collects and the hook takes the batch each step, nobody publishes
  publish    collect + the real ZMQ publisher (its thread encodes and sends on 127.0.0.1)
- `.venv/bin/python tests/test_kv_events_cost.py [SECONDS]` times the modes in alternation
  (wall, engine-thread CPU, process CPU); on a shared machine the spread is several percent.
- `valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python
  tests/test_kv_events_cost.py once MODE REPS` runs MODE REPS times; instructions of REPS=2
  minus REPS=1 are one run's, free of the noise (about 20 s each; docs/kv-events.md has both).
"""

from __future__ import annotations

import itertools
import random
import statistics
import sys
import time
from pathlib import Path

from scheduler.config import SchedulerConfig
from scheduler.kv_events import BlockRemoved, BlockStored
from scheduler.outputs import ModelRunnerOutput
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

# Sizes of a small production replica: 16-token blocks, 64 sequences, 2048-token steps, and a
# cache that holds about 24 of the 640-token requests (so it evicts and preempts).
BENCH_CONFIG = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096, block_size=16,
                    num_blocks=1025, enable_prefix_caching=True)


def make_workload(seed: int, num_requests: int, prompt_len: int, max_tokens: int) -> tuple[list[list[int]], int]:
    """Prompts that share one of a few system prefixes (half their length), then differ; and
    how many tokens each generates."""
    rng = random.Random(seed)
    tokens = itertools.count(1000)
    prefixes = [[next(tokens) for _ in range(prompt_len // 2)] for _ in range(4)]
    prompts = [rng.choice(prefixes) + [next(tokens) for _ in range(prompt_len - prompt_len // 2)]
               for _ in range(num_requests)]
    return prompts, max_tokens


def make_scheduler(config: dict, workload) -> Scheduler:
    prompts, max_tokens = workload
    sched = Scheduler(SchedulerConfig(**config))
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 1))
    return sched


def run(sched: Scheduler, after_step=None) -> list[dict[str, int]]:
    """Schedule to completion with a runner that samples token 7, calling `after_step(sched)`
    where the engine's hook sits; returns each step's scheduled tokens per request."""
    trace = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            request = sched.requests[req_id]
            if request.num_computed_tokens + n >= request.num_tokens:
                sampled[req_id] = [7]
        sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        if after_step is not None:
            after_step(sched)
        trace.append(dict(out.num_scheduled_tokens))
    return trace


def test_events_change_no_scheduling_decision():
    # 64 blocks of 16 for 16 sequences of up to 136 tokens: it preempts and evicts.
    config = dict(BENCH_CONFIG, num_blocks=65, max_num_seqs=16, max_num_batched_tokens=512)
    workload = make_workload(seed=1, num_requests=48, prompt_len=96, max_tokens=40)
    off = run(make_scheduler(config, workload))
    sched = make_scheduler(config, workload)
    sched.kv.enable_events()
    requests = list(sched.requests.values())
    batches = []
    on = run(sched, after_step=lambda s: batches.append(s.kv.take_events()))
    assert on == off
    assert sum(r.num_preemptions for r in requests) > 0
    events = [e for b in batches if b is not None for e in b.events]
    assert any(isinstance(e, BlockStored) for e in events) and any(isinstance(e, BlockRemoved) for e in events)


def mode_hook(mode: str, sched: Scheduler, replay: bool):
    """The engine's per-step hook for one benchmark mode, and the publisher to close after the run
    (None unless publishing; with `replay`, it also serves the replay socket)."""
    if mode == "collect":
        sched.kv.enable_events()
        return (lambda s: s.kv.take_events()), None
    if mode == "publish":
        from deployments.engine.kv_event_publisher import KVEventPublisher

        config = {"endpoint": "tcp://127.0.0.1:*"}
        if replay:
            config["replay_endpoint"] = "tcp://127.0.0.1:*"
        publisher = KVEventPublisher.from_config(config, sched.kv)
        return (lambda s: publisher.publish(s.kv.take_events())), publisher
    return None, None


def bench(seconds_budget: float) -> None:
    workload = make_workload(seed=0, num_requests=256, prompt_len=640, max_tokens=64)
    modes = ("off", "collect", "publish")
    # Per mode and clock, one sample per run: wall time, the engine thread's CPU time (what the
    # step itself spends) and the process's CPU time (the publisher thread's too).
    clocks = {"wall": time.perf_counter, "thread cpu": time.thread_time, "process cpu": time.process_time}
    samples = {(mode, clock): [] for mode in modes for clock in clocks}
    num_steps = 0
    deadline = time.monotonic() + seconds_budget
    while time.monotonic() < deadline or not samples["publish", "wall"]:
        for mode in modes:
            sched = make_scheduler(BENCH_CONFIG, workload)
            hook, publisher = mode_hook(mode, sched, replay=True)
            start = {name: clock() for name, clock in clocks.items()}
            num_steps = len(run(sched, hook))
            if publisher is not None:
                publisher.close()  # waits until every batch is encoded and sent: its cost counts
            for name, clock in clocks.items():
                samples[mode, name].append(clock() - start[name])
    rounds = len(samples["off", "wall"])
    print(f"{rounds} rounds, each running off, collect, publish back to back; {num_steps} steps per run")
    # Each round's own ratio to its own "off" run, then the median over rounds: load from other
    # processes drifts slowly, so neighbours in time see about the same machine.
    for clock in clocks:
        cells = []
        for mode in modes:
            per_step = statistics.median(samples[mode, clock]) / num_steps * 1e6
            ratios = [m / o for m, o in zip(samples[mode, clock], samples["off", clock])]
            cells.append(f"{mode} {per_step:6.1f} us/step ({(statistics.median(ratios) - 1) * 100:+5.1f}%)")
        print(f"{clock:12s} " + "   ".join(cells))


def once(mode: str, reps: int) -> None:
    """Run one mode `reps` times, untimed (for an instruction counter)."""
    workload = make_workload(seed=0, num_requests=256, prompt_len=640, max_tokens=64)
    for _ in range(reps):
        sched = make_scheduler(BENCH_CONFIG, workload)
        hook, publisher = mode_hook(mode, sched, replay=False)
        run(sched, hook)
        if publisher is not None:
            publisher.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if len(sys.argv) > 1 and sys.argv[1] == "once":
        once(sys.argv[2], int(sys.argv[3]))
    else:
        bench(float(sys.argv[1]) if len(sys.argv) > 1 else 30.0)
