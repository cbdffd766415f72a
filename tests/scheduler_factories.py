"""Factories and a fake worker for CPU tests of `scheduler/` (no torch, no ray).

- `make_config` / `make_scheduler` / `make_request` / `make_prompt` build small objects.
- `FakeRunner` plays every worker rank at once: it keeps its own copy of each request from the
  `SchedulerOutput` deltas only (as `workers/runner/input_batch.py` does), simulates the KV cache slot by
  slot (each slot holds the token id whose K/V it stores), checks that every token a step attends
  to is really in the request's blocks, and samples one token for each request whose computed +
  scheduled tokens reach its known tokens. Sampled ids come from `token_fn(req_id, i)` (the
  request's i-th output token) or a per-request script, so a recomputed request must produce
  exactly the tokens it would have produced without preemption.
- `step` runs one engine step (schedule -> execute -> update -> stats, as deployments/engine/engine.py),
  checking `check_invariants` after `schedule()` and after the update.
- `run_until_done` drives the scheduler to completion, then delivers the last finished ids to the
  workers and checks that nothing is left: no used block, no used token, no worker state.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from metrics.events import EventType, RequestEvent
from metrics.stats import SchedulerStats
from scheduler.block_pool import NULL_BLOCK_ID
from scheduler.config import SchedulerConfig
from scheduler.math_utils import cdiv
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import RequestUpdate, Scheduler

# The EOS id requests are made with; the default fake runner never samples it.
EOS = 1

DEFAULT_CONFIG = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=4,
    num_blocks=65,  # 64 usable + the null block
    enable_prefix_caching=True,
)

_prompt_tokens = itertools.count(100_000)
_request_ids = itertools.count()


def make_config(**overrides) -> SchedulerConfig:
    return SchedulerConfig(**{**DEFAULT_CONFIG, **overrides})


def make_scheduler(**overrides) -> Scheduler:
    return Scheduler(make_config(**overrides))


def make_prompt(n: int) -> list[int]:
    """n token ids never used by any other prompt (so no accidental prefix-cache hit)."""
    return [next(_prompt_tokens) for _ in range(n)]


def make_request(
    prompt: list[int] | int = 8,
    request_id: str | None = None,
    eos_token_id: int | None = EOS,
    queued_ts: float | None = None,
    **sampling,
) -> Request:
    """A request with a fresh prompt of `prompt` tokens (or the given token ids)."""
    prompt_ids = make_prompt(prompt) if isinstance(prompt, int) else list(prompt)
    sampling.setdefault("max_tokens", 4)
    return Request(
        request_id if request_id is not None else f"req-{next(_request_ids)}",
        prompt_ids,
        SamplingParams(**sampling),
        eos_token_id,
        queued_ts=queued_ts,
    )


def add_requests(scheduler: Scheduler, *requests: Request) -> list[Request]:
    for request in requests:
        scheduler.add_request(request)
    return list(requests)


def default_token(req_id: str, index: int) -> int:
    """The index-th output token of a request: a function of position only, never EOS."""
    return 500 + index


# ---------------------------------------------------------------------------------------------
# Fake worker
# ---------------------------------------------------------------------------------------------


@dataclass
class WorkerRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int


class FakeRunner:
    """All worker ranks in one object, fed only by SchedulerOutput deltas."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        token_fn: Callable[[str, int], int] = default_token,
        scripts: dict[str, list[int]] | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.token_fn = token_fn
        # Request id -> output tokens to sample, in order (overrides token_fn while it lasts).
        self.scripts = dict(scripts or {})
        self.states: dict[str, WorkerRequestState] = {}
        # Simulated KV cache: block id -> (position, token id) stored in each slot (None = never
        # written). K/V depend on the position too (RoPE): a block reused elsewhere is wrong.
        self.kv: dict[int, list[tuple[int, int] | None]] = {}
        self.num_steps = 0

    @classmethod
    def for_scheduler(cls, scheduler: Scheduler, **kwargs) -> "FakeRunner":
        return cls(scheduler.config.block_size, scheduler.config.num_blocks, **kwargs)

    def next_token(self, req_id: str, index: int) -> int:
        script = self.scripts.get(req_id)
        if script is not None and index < len(script):
            return script[index]
        return self.token_fn(req_id, index)

    # ---- state updates, as workers/runner/input_batch.py --------------------------------------------
    def _apply(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            assert req_id in self.states, f"finished id {req_id!r} was never sent to the workers"
            del self.states[req_id]
        new_ids = [new.req_id for new in out.scheduled_new_reqs]
        cached_ids = [cached.req_id for cached in out.scheduled_cached_reqs]
        assert len(set(new_ids + cached_ids)) == len(new_ids) + len(cached_ids), "a request sent twice"
        assert set(new_ids + cached_ids) == set(out.num_scheduled_tokens), (
            "scheduled requests and request data differ"
        )
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert not set(out.finished_req_ids) & set(out.num_scheduled_tokens), (
            "a finished request is scheduled"
        )
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id!r} sent as new twice"
            self.states[new.req_id] = WorkerRequestState(
                token_ids=list(new.token_ids),
                num_prompt_tokens=len(new.token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in out.scheduled_cached_reqs:
            assert cached.req_id in self.states, f"{cached.req_id!r} sent as cached before as new"
            state = self.states[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                # A request continuing without preemption: the scheduler's computed count must be
                # the one this worker reached.
                assert cached.num_computed_tokens == state.num_computed_tokens, (
                    f"{cached.req_id}: scheduler says {cached.num_computed_tokens} computed, "
                    f"worker has {state.num_computed_tokens}"
                )
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._apply(out)
        self.num_steps += 1
        bs = self.block_size
        all_blocks = [b for s in self.states.values() for b in s.block_ids]
        assert NULL_BLOCK_ID not in all_blocks, "the null block was handed to a request"
        assert all(0 < b < self.num_blocks for b in all_blocks), "block id out of range"
        # Write every scheduled token's K/V first (one forward writes all layers before reading).
        for req_id, num in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            assert num > 0, f"{req_id}: scheduled with 0 tokens"
            end = state.num_computed_tokens + num
            assert end <= len(state.token_ids), (
                f"{req_id}: scheduled up to token {end}, worker knows {len(state.token_ids)}"
            )
            assert len(state.block_ids) * bs >= end, f"{req_id}: block table too short for {end}"
            assert len(set(state.block_ids)) == len(state.block_ids), f"{req_id}: block twice in table"
            for pos in range(state.num_computed_tokens, end):
                block = self.kv.setdefault(state.block_ids[pos // bs], [None] * bs)
                block[pos % bs] = (pos, state.token_ids[pos])
        # Then attend: every context token must be in the request's own blocks.
        result = ModelRunnerOutput()
        for req_id, num in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            end = state.num_computed_tokens + num
            for pos in range(end):
                stored = self.kv.get(state.block_ids[pos // bs], [None] * bs)[pos % bs]
                assert stored == (pos, state.token_ids[pos]), (
                    f"{req_id}: KV slot of token {pos} holds {stored}, "
                    f"expected {(pos, state.token_ids[pos])}"
                )
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                index = len(state.token_ids) - state.num_prompt_tokens
                result.sampled_token_ids[req_id] = [self.next_token(req_id, index)]
        return result


# ---------------------------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------------------------


def block_holders(scheduler: Scheduler) -> dict[str, list]:
    """Request id -> the KVBlock objects it holds (white-box read of the KV manager)."""
    return scheduler.kv._req_blocks


def independent_used_tokens(scheduler: Scheduler) -> int:
    """Tokens written in used blocks, each block counted once (valid between steps).

    Slot j of a request's i-th block holds a token iff i * B + j < its computed tokens; a block
    shared through the prefix cache holds what its most advanced holder wrote.
    """
    bs = scheduler.config.block_size
    written: dict[int, int] = {}
    for req_id, blocks in block_holders(scheduler).items():
        computed = scheduler.requests[req_id].num_computed_tokens
        for i, block in enumerate(blocks):
            n = max(0, min(bs, computed - i * bs))
            written[block.block_id] = max(written.get(block.block_id, 0), n)
    return sum(written.values())


def check_invariants(scheduler: Scheduler, between_steps: bool = True) -> None:
    config = scheduler.config
    bs = config.block_size
    pool = scheduler.kv.pool
    holders = block_holders(scheduler)

    # Requests: every live one is running or waiting, exactly once, with a matching status.
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    assert len(set(running_ids + waiting_ids)) == len(running_ids) + len(waiting_ids)
    assert set(running_ids + waiting_ids) == set(scheduler.requests)
    assert len(scheduler.running) <= config.max_num_seqs
    for r in scheduler.running:
        assert r.status == RequestStatus.RUNNING, r
        assert r.request_id in holders, f"{r} runs without blocks"
    for r in scheduler.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
        assert r.num_computed_tokens == 0, f"{r} waits with computed tokens"
        assert r.request_id not in holders, f"{r} waits holding blocks"
    assert set(holders) <= set(running_ids), "a request that is not running holds blocks"

    # Blocks: ref counts are exactly the number of holders; the null block is never held.
    refs = Counter(b.block_id for blocks in holders.values() for b in blocks)
    for req_id, blocks in holders.items():
        ids = [b.block_id for b in blocks]
        assert len(set(ids)) == len(ids), f"{req_id} holds a block twice"
    assert pool.blocks[NULL_BLOCK_ID].ref_cnt == 0 and refs[NULL_BLOCK_ID] == 0
    assert NULL_BLOCK_ID not in pool._free_queue
    used = cached = free = 0
    for block in pool.blocks[1:]:
        assert block.ref_cnt == refs[block.block_id], f"block {block.block_id}: ref_cnt wrong"
        assert (block.ref_cnt == 0) == (block.block_id in pool._free_queue)
        if block.ref_cnt > 0:
            used += 1
        elif block.block_key is not None:
            cached += 1
            # A cached block is kept for prefix reuse: it must be findable by its content.
            assert config.enable_prefix_caching
            assert pool.lookup(block.block_key) is block, f"cached block {block.block_id} unreachable"
        else:
            free += 1
    for key, block in pool._cached.items():
        assert block.block_key == key
    if not config.enable_prefix_caching:
        assert not pool._cached and cached == 0

    snap = scheduler.kv.snapshot()
    assert snap.total_blocks == config.num_blocks - 1
    assert (snap.used_blocks, snap.cached_blocks, snap.free_blocks) == (used, cached, free)
    assert used + cached + free == snap.total_blocks
    assert snap.block_size == bs
    assert snap.capacity_tokens == snap.total_blocks * bs
    assert snap.cached_tokens == cached * bs
    assert 0 <= snap.used_tokens <= used * bs
    assert snap.unfilled_slots == used * bs - snap.used_tokens
    assert snap.usage_perc == used / snap.total_blocks

    if between_steps:
        for r in scheduler.running:
            # Blocks are reserved only for tokens that were scheduled (and are now computed).
            assert len(holders[r.request_id]) == cdiv(r.num_computed_tokens, bs), r
            assert 0 < r.num_computed_tokens < r.num_tokens, r
        assert snap.used_tokens == independent_used_tokens(scheduler)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


@dataclass
class StepRecord:
    output: SchedulerOutput
    runner_output: ModelRunnerOutput
    updates: list[RequestUpdate]
    # make_stats() after the update, as the engine takes it.
    stats: SchedulerStats

    def scheduled(self, req_id: str) -> int:
        return self.output.num_scheduled_tokens.get(req_id, 0)

    def new_tokens(self, req_id: str) -> list[int]:
        return [t for u in self.updates if u.request.request_id == req_id for t in u.new_token_ids]

    def cached_data(self, req_id: str):
        return next((c for c in self.output.scheduled_cached_reqs if c.req_id == req_id), None)

    def new_data(self, req_id: str):
        return next((n for n in self.output.scheduled_new_reqs if n.req_id == req_id), None)


@dataclass
class RunResult:
    steps: list[StepRecord] = field(default_factory=list)
    # Every request seen, by id (finished ones are gone from scheduler.requests).
    requests: dict[str, Request] = field(default_factory=dict)
    # Tokens handed out through RequestUpdate, per request, in order.
    emitted: dict[str, list[int]] = field(default_factory=dict)
    # Events drained after each step (as the engine does), per request.
    events: dict[str, list[RequestEvent]] = field(default_factory=dict)

    def event_types(self, req_id: str) -> list[EventType]:
        return [e.type for e in self.events.get(req_id, [])]


def step(scheduler: Scheduler, runner: FakeRunner, result: RunResult | None = None) -> StepRecord:
    """One engine step with invariant checks; records into `result` when given."""
    if result is not None:
        result.requests.update(scheduler.requests)
    out = scheduler.schedule()
    check_invariants(scheduler, between_steps=False)
    runner_output = runner.execute(out)
    for req_id in out.num_scheduled_tokens:
        # From deltas alone, the workers know exactly the scheduler's tokens for the request.
        request = scheduler.requests[req_id]
        assert runner.states[req_id].token_ids == request.prompt_token_ids + request.output_token_ids
    updates = scheduler.update_from_output(out, runner_output)
    stats = scheduler.make_stats()
    check_invariants(scheduler, between_steps=True)
    record = StepRecord(out, runner_output, updates, stats)
    if result is not None:
        result.steps.append(record)
        for update in updates:
            result.emitted.setdefault(update.request.request_id, []).extend(update.new_token_ids)
        for request in result.requests.values():
            result.events.setdefault(request.request_id, []).extend(request.take_events())
    return record


def run_until_done(
    scheduler: Scheduler,
    runner: FakeRunner | None = None,
    max_steps: int = 10_000,
    before_step: Callable[[int, Scheduler], None] | None = None,
    result: RunResult | None = None,
) -> RunResult:
    """Step until no request is left; `before_step(i, scheduler)` may add or abort requests."""
    runner = runner or FakeRunner.for_scheduler(scheduler)
    result = result or RunResult()
    for i in itertools.count():
        if before_step is not None:
            before_step(i, scheduler)
        if not scheduler.has_unfinished_requests():
            break
        assert i < max_steps, "the scheduler made no progress"
        step(scheduler, runner, result)
    result.requests.update(scheduler.requests)
    for request in result.requests.values():
        result.events.setdefault(request.request_id, []).extend(request.take_events())
    assert_drained(scheduler, runner)
    return result


def assert_drained(scheduler: Scheduler, runner: FakeRunner) -> None:
    """Nothing live: deliver the last finished ids, then no state, no used block or token."""
    assert not scheduler.has_unfinished_requests()
    flush = scheduler.schedule()
    assert flush.is_empty and not flush.num_scheduled_tokens
    runner.execute(flush)
    assert runner.states == {}, f"workers still hold {sorted(runner.states)}"
    check_invariants(scheduler)
    snap = scheduler.kv.snapshot()
    assert snap.used_blocks == 0 and snap.used_tokens == 0
    assert snap.used_blocks + snap.cached_blocks + snap.free_blocks == snap.total_blocks
    assert scheduler.requests == {} and scheduler.kv._req_blocks == {}


def expected_outputs(request: Request, runner: FakeRunner) -> list[int]:
    """The tokens `runner` gives this request, up to its length."""
    return [runner.next_token(request.request_id, i) for i in range(request.num_output_tokens)]


def check_request_events(events: list[RequestEvent], request: Request) -> None:
    """The METRICS.md section-1 grammar of one finished request's events."""
    types = [e.type for e in events]
    assert types[0] == EventType.QUEUED, types
    assert types.count(EventType.QUEUED) == 1
    assert types[-1] == EventType.FINISHED and types.count(EventType.FINISHED) == 1, types
    assert all(a.ts <= b.ts for a, b in zip(events, events[1:])), "events out of time order"
    assert types.count(EventType.PREEMPTED) == request.num_preemptions
    # Each admission is a SCHEDULED; each preemption is followed by one more admission unless
    # the request was aborted while waiting to resume.
    num_scheduled = types.count(EventType.SCHEDULED)
    assert num_scheduled in (request.num_preemptions, request.num_preemptions + 1), types
    # SCHEDULED and PREEMPTED alternate: running -> preempted -> running ...
    phases = [t for t in types if t in (EventType.SCHEDULED, EventType.PREEMPTED)]
    assert phases == [EventType.SCHEDULED, EventType.PREEMPTED] * (len(phases) // 2) + (
        [EventType.SCHEDULED] if len(phases) % 2 else []
    ), types
    # NEW_TOKENS only while running (after a SCHEDULED, before a PREEMPTED).
    running = False
    for t in types:
        if t == EventType.SCHEDULED:
            running = True
        elif t == EventType.PREEMPTED:
            running = False
        elif t in (EventType.NEW_TOKENS, EventType.PREFILL_CHUNK):
            assert running, types
