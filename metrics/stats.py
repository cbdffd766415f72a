"""Per-step and per-request stats objects (METRICS.md sections 3 and 4).

The scheduler fills `KVCacheSnapshot` and `SchedulerStats`; the engine adds timings into
`IterationStats`; finished requests become `FinishedRequestStats`. Stat loggers consume them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from metrics.definitions import KV_EVENT_TYPES


@dataclass(frozen=True)
class KVCacheSnapshot:
    """The KV cache at one moment, in blocks and tokens (the null block is never counted)."""

    # Tokens per block (B).
    block_size: int
    # Blocks usable for requests (excludes the reserved null block).
    total_blocks: int
    # Blocks referenced by at least one live request.
    used_blocks: int
    # Blocks referenced by no live request but kept for prefix reuse (evictable).
    cached_blocks: int
    # Empty blocks.
    free_blocks: int
    # Tokens whose K/V are written in used blocks; a block shared through the prefix cache counts once.
    used_tokens: int
    # Tokens held in cached blocks.
    cached_tokens: int

    @property
    def capacity_tokens(self) -> int:
        return self.total_blocks * self.block_size

    @property
    def unfilled_slots(self) -> int:
        # Internal fragmentation: reserved slots of used blocks that hold no token yet.
        return self.used_blocks * self.block_size - self.used_tokens

    @property
    def usage_perc(self) -> float:
        # Cached blocks count as free, as in vLLM.
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass
class SchedulerStats:
    """What one `schedule()` call decided and the state it left (one per engine step)."""

    # Requests in the running set after scheduling.
    num_running: int = 0
    # Requests waiting (including preempted ones) after scheduling.
    num_waiting: int = 0
    # Of the waiting requests, those that were preempted and wait to resume.
    num_waiting_preempted: int = 0
    # Prompt (or recompute) tokens scheduled this step, counted per chunk.
    prefill_tokens: int = 0
    # Tokens scheduled for requests that are decoding (one per running decode request).
    decode_tokens: int = 0
    # Requests in this step's batch.
    num_batch_requests: int = 0
    # Preemptions this step whose victim had not produced its first token yet.
    num_preemptions_prefill: int = 0
    # Preemptions this step whose victim was decoding.
    num_preemptions_decode: int = 0
    # Prefix-cache lookups this step, in tokens: every token of each admitted request (prompt,
    # plus kept outputs for a resumed one), the same base the hits are counted on.
    prefix_cache_queries: int = 0
    # Of those, tokens found in the cache.
    prefix_cache_hits: int = 0
    # The KV cache after this step's allocations.
    kv: KVCacheSnapshot | None = None
    # Filled by the update after the forward: prompt tokens of requests whose prefill completed
    # this step (once per request), of those the ones served from the prefix cache at first
    # admission, and the output tokens the step appended.
    prompt_tokens_completed: int = 0
    cached_prompt_tokens_completed: int = 0
    generation_tokens: int = 0


@dataclass(frozen=True)
class KVEventCounts:
    """KV-cache events of one step handed to the kv_events publisher, by vLLM event type."""

    # BlockStored events (each may carry several blocks).
    block_stored: int = 0
    # BlockRemoved events.
    block_removed: int = 0
    # AllBlocksCleared events.
    all_blocks_cleared: int = 0

    @classmethod
    def of(cls, events: Iterable[object]) -> "KVEventCounts":
        """Counts of a step's event records (scheduler/kv_events.py), told apart by class name:
        those are vLLM's type names, and metrics must not import the scheduler."""
        names = [type(event).__name__ for event in events]
        return cls(*(names.count(event_type) for event_type in KV_EVENT_TYPES))

    def by_type(self) -> dict[str, int]:
        """The counts under their `event_type` label values."""
        return dict(zip(KV_EVENT_TYPES, (self.block_stored, self.block_removed, self.all_blocks_cleared)))


@dataclass
class IterationStats:
    """One engine step as the stat loggers see it: the scheduler's view plus timings and tokens."""

    # The scheduler's stats for this step.
    scheduler: SchedulerStats
    # Wall time of the whole step (schedule + execute + update), seconds.
    step_duration: float = 0.0
    # Of which the model forward (executor call), seconds.
    forward_duration: float = 0.0
    # Prompt tokens of requests whose prefill completed this step (once per request).
    num_prompt_tokens: int = 0
    # Prompt tokens of newly admitted requests served from the prefix cache (first admission only).
    num_prompt_tokens_cached: int = 0
    # Output tokens produced this step.
    num_generation_tokens: int = 0
    # Requests that finished this step (engine-side view).
    finished: list["FinishedRequestStats"] = field(default_factory=list)
    # KV-cache events this step handed to the kv_events publisher; None with kv_events off.
    kv_events: KVEventCounts | None = None


@dataclass
class FinishedRequestStats:
    """One finished request (stop, length or abort) with the intervals it reached."""

    # "stop" | "length" | "abort".
    finished_reason: str
    # Prompt length in tokens.
    num_prompt_tokens: int
    # Output tokens produced.
    num_generation_tokens: int
    # Prompt tokens served from the prefix cache at first admission.
    num_cached_prompt_tokens: int
    # How many times it was preempted.
    num_preemptions: int
    # Section-2 intervals in seconds; None where the request never reached the events involved.
    queue_time: float | None = None
    prefill_time: float | None = None
    ttft: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    tpot: float | None = None
    e2e_latency: float | None = None
    preemption_stall: float = 0.0
    # Inter-token latency samples, one per gap between successive NEW_TOKENS events.
    itl: list[float] = field(default_factory=list)
    # The request's OpenTelemetry trace id (32 lower-case hex digits) when tracing is on: the
    # exemplar of its latency observations. None with tracing off (no exemplar).
    trace_id: str | None = None
