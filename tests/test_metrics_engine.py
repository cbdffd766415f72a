"""Metrics of a real LLMEngine (tiny random Llama, CPU): events, intervals, KV tokens, counters.

`Driver` runs the engine the way the server does: it feeds EngineMetrics (a PrometheusStatLogger
and a recording logger behind it) once per step, and plays the HTTP side (ARRIVED before the
engine sees the request, FIRST_TOKEN_SENT after the first token, RESPONDED + finalize after the
last output). Independently it keeps every request's raw events (RequestOutput.new_events plus
the frontend events it adds), and each test recomputes what the metrics must say from those raw
events and its own bookkeeping, then reads the numbers back from the Prometheus text exposition
parsed with prometheus_client's parser.

The KV cache sizes are chosen so that the scheduler must preempt (METRICS.md sections 1-2), and
small block sizes keep every prompt a handful of blocks. Nothing here sleeps: time passes only
through engine steps, and the checks compare timestamps of one monotonic clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.engine.engine_metrics import EngineMetrics
from engine_helpers import greedy, kv_gib_for_blocks, make_engine
from metrics.events import EventType as E
from metrics.events import RequestEvent, now
from metrics.prometheus_logger import PrometheusStatLogger
from metrics.stat_logger import StatLogger
from metrics.stats import FinishedRequestStats, IterationStats
from metrics.timeline_svg import timeline_segments
from model_fixtures import make_tiny_llama

MODEL = "tiny"
# Float tolerance for sums of differences (a + b + c vs d - a): rounding only, never time.
EPS = 1e-9


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("metrics-tiny") / "llama")


def tiny_engine(path: str, *, num_blocks: int, block_size: int = 4, budget: int = 8, **overrides):
    return make_engine(
        path,
        block_size=block_size,
        kv_cache_memory_gib=kv_gib_for_blocks(path, num_blocks, block_size),
        max_num_batched_tokens=budget,
        served_model_name=MODEL,
        cpu_threads=1,
        **overrides,
    )


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


# ---- driving the engine ---------------------------------------------------------------------


class Recorder(StatLogger):
    """Keeps what the stat loggers are fed."""

    def __init__(self) -> None:
        self.iterations: list[IterationStats] = []
        self.finished: list[FinishedRequestStats] = []

    def record(self, iteration: IterationStats) -> None:
        self.iterations.append(iteration)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        self.finished.append(stats)


@dataclass
class Tracked:
    """The test's own record of one request."""

    prompt_len: int
    # Raw events: frontend ones added by the driver, engine ones from RequestOutput.new_events.
    events: list[RequestEvent] = field(default_factory=list)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    # What EngineMetrics handed the stat loggers when the request was finalized.
    stats: FinishedRequestStats | None = None

    def ts(self, event_type: E) -> list[float]:
        return [event.ts for event in self.events if event.type == event_type]


class Driver:
    def __init__(self, engine, step_flush_interval_s: float = 0.0) -> None:
        self.engine = engine
        cfg = engine.scheduler_config
        self.prom = PrometheusStatLogger(MODEL, cfg.max_num_batched_tokens, engine.max_model_len)
        self.recorder = Recorder()
        self.metrics = EngineMetrics([self.prom, self.recorder], timeline_capacity=64, frontend_finalizes=True,
                                     step_flush_interval_s=step_flush_interval_s)
        self.metrics.log_startup(engine)
        self.requests: dict[str, Tracked] = {}

    def add(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> None:
        arrived = now()
        self.requests[request_id] = Tracked(len(prompt_ids), [RequestEvent(E.ARRIVED, arrived)])
        self.metrics.on_request_added(request_id, arrived)
        self.engine.add_request(request_id, prompt_ids, greedy(max_tokens))

    def live(self) -> list[str]:
        return [rid for rid, t in self.requests.items() if t.finish_reason is None]

    def step(self) -> IterationStats:
        outputs = self.engine.step()
        self.metrics.on_step(outputs, self.engine.last_iteration)
        self._deliver(outputs)
        return self.engine.last_iteration

    def abort(self, request_ids: list[str]) -> None:
        outputs = self.engine.abort_requests(request_ids)
        assert {out.request_id for out in outputs} == set(request_ids)
        self.metrics.on_step(outputs, None)  # what the server's loop does with abort outputs
        self._deliver(outputs)

    def run_to_end(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("the engine did not drain")

    def _deliver(self, outputs) -> None:
        for out in outputs:
            tracked = self.requests[out.request_id]
            tracked.events.extend(out.new_events)
            first_token = out.new_token_ids and tracked.num_output_tokens == 0
            tracked.num_output_tokens = out.num_output_tokens
            tracked.num_cached_tokens = out.num_cached_tokens
            if first_token:
                self._frontend_event(out.request_id, E.FIRST_TOKEN_SENT)
            if out.finished:
                tracked.finish_reason = out.finish_reason
                self._frontend_event(out.request_id, E.RESPONDED)
                before = len(self.recorder.finished)
                self.metrics.finalize(out.request_id)
                assert len(self.recorder.finished) == before + 1
                tracked.stats = self.recorder.finished[-1]

    def _frontend_event(self, request_id: str, event_type: E) -> None:
        ts = now()
        self.requests[request_id].events.append(RequestEvent(event_type, ts))
        self.metrics.add_frontend_event(request_id, event_type, ts)

    def scrape(self) -> dict[str, list]:
        return parse(self.prom.render().decode())


def parse(text: str) -> dict[str, list]:
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    matching = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, (name, labels, samples.get(name))
    return matching[0]


# ---- section 2, recomputed from raw events ----------------------------------------------------


def stall_spans(tracked: Tracked) -> list[tuple[float, float, str]]:
    """(PREEMPTED, end of its stall, phase) per preemption, from the raw events.

    A stall ends when the request produces again (next NEW_TOKENS), or earlier when it is
    preempted again first (evicted while recomputing: the next stall takes over, so stalls never
    overlap), or, aborted first, at FINISHED. Phase: "prefill" if the request had no NEW_TOKENS
    before the PREEMPTED, else "decode".
    """
    tokens = tracked.ts(E.NEW_TOKENS)
    preemptions = tracked.ts(E.PREEMPTED)
    finished = tracked.ts(E.FINISHED)
    spans = []
    for preempted in preemptions:
        phase = "decode" if any(t < preempted for t in tokens) else "prefill"
        ends = [t for t in tokens + preemptions if t > preempted]
        end = min(ends) if ends else finished[0]
        spans.append((preempted, end, phase))
    return spans


def stalls_by_gap(tracked: Tracked) -> list[tuple[float, float, str]]:
    """The stall of each run of preemptions between two NEW_TOKENS: (first PREEMPTED of the run,
    the NEW_TOKENS (or FINISHED) ending it, phase of the run)."""
    runs: dict[float, tuple[float, float, str]] = {}
    for start, end, phase in stall_spans(tracked):
        gap_end = min([t for t in tracked.ts(E.NEW_TOKENS) if t > start] or tracked.ts(E.FINISHED))
        runs.setdefault(gap_end, (start, gap_end, phase))
    return list(runs.values())


def expected_intervals(tracked: Tracked) -> dict:
    """Every section-2 rule, applied to the raw events by this test."""
    queued = tracked.ts(E.QUEUED)[0]
    scheduled = tracked.ts(E.SCHEDULED)
    tokens = tracked.ts(E.NEW_TOKENS)
    arrived = tracked.ts(E.ARRIVED)[0]
    first_sent = tracked.ts(E.FIRST_TOKEN_SENT)
    responded = tracked.ts(E.RESPONDED)[-1]
    decode = tokens[-1] - tokens[0] if tokens else None
    n = tracked.num_output_tokens
    return {
        # first SCHEDULED - QUEUED
        "queue_time": scheduled[0] - queued if scheduled else None,
        # first NEW_TOKENS - first SCHEDULED
        "prefill_time": tokens[0] - scheduled[0] if tokens else None,
        # first token handed to the client - ARRIVED
        "ttft": first_sent[0] - arrived if first_sent else None,
        # gaps between successive NEW_TOKENS
        "itl": [b - a for a, b in zip(tokens, tokens[1:])],
        # last NEW_TOKENS - first NEW_TOKENS
        "decode_time": decode,
        # last NEW_TOKENS - first SCHEDULED
        "inference_time": tokens[-1] - scheduled[0] if tokens else None,
        # decode time / (generated tokens - 1)
        "tpot": decode / (n - 1) if decode is not None and n > 1 else None,
        # RESPONDED - ARRIVED
        "e2e_latency": responded - arrived,
        "preemption_stall": sum(end - start for start, end, _ in stall_spans(tracked)),
        "num_preemptions": len(tracked.ts(E.PREEMPTED)),
    }


def check_request(driver: Driver, request_id: str) -> dict:
    """Intervals of one finished request: exact rules, invariants, and the three places they are
    reported (stat loggers, timeline store, per-request metrics object) agree."""
    tracked = driver.requests[request_id]
    stats = tracked.stats
    assert stats is not None, request_id
    expected = expected_intervals(tracked)
    # Every interval equals its rule exactly: the same clock, the same subtraction.
    got = {name: getattr(stats, name) for name in expected}
    assert got == expected, request_id
    assert stats.finished_reason == tracked.finish_reason
    assert stats.num_generation_tokens == tracked.num_output_tokens
    assert stats.num_prompt_tokens == tracked.prompt_len
    entry = driver.metrics.timelines.get(request_id)
    assert entry is not None
    for name, rule_value in expected.items():
        if name != "itl":
            assert getattr(entry.intervals, name) == rule_value, (request_id, name)
    reported = driver.metrics.request_metrics(request_id)
    for name in ("queue_time", "prefill_time", "ttft", "decode_time", "inference_time", "tpot",
                 "e2e_latency", "preemption_stall", "num_preemptions"):
        assert reported[name] == expected[name], (request_id, name)
    assert reported["cached_prompt_tokens"] == tracked.num_cached_tokens

    # Section-2 invariants.
    queued = tracked.ts(E.QUEUED)[0]
    tokens = tracked.ts(E.NEW_TOKENS)
    stall = stats.preemption_stall
    assert stall >= 0.0
    if stats.num_preemptions == 0:
        assert stall == 0.0  # never preempted -> no stall
    if tokens:
        # queue + prefill + decode = last NEW_TOKENS - QUEUED
        assert stats.queue_time + stats.prefill_time + stats.decode_time == pytest.approx(tokens[-1] - queued, abs=EPS)
        # sum ITL = decode time
        assert sum(stats.itl) == pytest.approx(stats.decode_time, abs=EPS)
        # inference = prefill + decode
        assert stats.inference_time == pytest.approx(stats.prefill_time + stats.decode_time, abs=EPS)
        # TTFT >= queue + prefill (tokenization, and handing the token over, come on top)
        assert stats.ttft >= stats.queue_time + stats.prefill_time - EPS
        # e2e >= queue + inference
        assert stats.e2e_latency >= stats.queue_time + stats.inference_time - EPS
        # preemption stall <= inference time (for a request that reached a token)
        assert stall <= stats.inference_time + EPS
    # The stalls of one run of preemptions (preempted, recomputing, preempted again, ...) add
    # up to the time from its first PREEMPTED to the next token, and land where section 2 says:
    # a prefill-phase run inside prefill time, a decode-phase run inside the one ITL sample (the
    # gap between two tokens) it interrupted.
    runs = stalls_by_gap(tracked)
    assert stall == pytest.approx(sum(end - start for start, end, _ in runs), abs=EPS)
    for start, end, phase in runs:
        if end not in tokens:
            continue  # aborted before producing again
        if phase == "prefill":
            assert stats.prefill_time >= end - start
        else:
            gap = tokens.index(end) - 1
            assert tokens[gap] < start
            assert stats.itl[gap] >= end - start
    # The timeline chart's preemption overlays (preempted, then recompute) tile the stalls:
    # disjoint, and as long in total as the stall.
    overlays = sorted(
        (seg for seg in timeline_segments(entry.events) if seg.kind in ("preempted", "recompute")),
        key=lambda seg: seg.start_ts,
    )
    for earlier, later in zip(overlays, overlays[1:]):
        assert earlier.end_ts <= later.start_ts
    assert sum(seg.end_ts - seg.start_ts for seg in overlays) == pytest.approx(stall, abs=EPS)
    return expected


def preemptions_by_phase(driver: Driver) -> dict[str, int]:
    counts = {"prefill": 0, "decode": 0}
    for tracked in driver.requests.values():
        for _, _, phase in stall_spans(tracked):
            counts[phase] += 1
    return counts


# ---- 1. preemption during prefill and during decode -----------------------------------------

# Block size 4, 8 usable blocks, 8-token budget. A (3-token prompt, 20 tokens) decodes alone for
# two steps, then B arrives with a prompt prefilled in 7-token chunks:
# - "prefill": B's 28-token prompt fills the cache before it completes; A's next block evicts B
#   (the most recently admitted) in the middle of its chunked prefill; B resumes after A ends.
# - "decode": B's 24-token prompt completes, B produces a token, then A's next block evicts B
#   while decoding, so B's stall is one long ITL sample.
# - "decode-again": the same without prefix caching: B's recomputation cannot reuse its blocks,
#   so A evicts B again and again while B recomputes, all inside one ITL sample.
SCENARIOS = {"prefill": (28, True), "decode": (24, True), "decode-again": (24, False)}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_intervals_under_preemption(tiny_path, scenario):
    prompt_len, prefix_caching = SCENARIOS[scenario]
    phase = scenario.split("-")[0]
    driver = Driver(tiny_engine(tiny_path, num_blocks=9, enable_prefix_caching=prefix_caching))
    driver.add("A", prompt(100, 3), 20)
    driver.step()
    driver.step()
    driver.add("B", prompt(200, prompt_len), 3)
    driver.run_to_end()

    a, b = driver.requests["A"], driver.requests["B"]
    assert a.finish_reason == b.finish_reason == "length"
    assert a.num_output_tokens == 20 and b.num_output_tokens == 3
    # The scenario happened: A was never evicted, B was, in the phase under test.
    assert not a.ts(E.PREEMPTED)
    b_phases = [p for _, _, p in stall_spans(b)]
    assert b_phases and b_phases[0] == phase
    if phase == "decode":
        assert set(b_phases) == {"decode"}
    if scenario == "decode-again":
        assert len(b_phases) > 1 and len(stalls_by_gap(b)) == 1  # preempted again while recomputing

    for request_id in ("A", "B"):
        check_request(driver, request_id)
    assert driver.requests["A"].stats.preemption_stall == 0.0
    b_stats = b.stats
    assert b_stats.preemption_stall > 0.0 and b_stats.num_preemptions == len(b_phases)
    if phase == "decode":
        # The decode preemption shows as one long ITL sample containing the whole stall.
        assert max(b_stats.itl) >= b_stats.preemption_stall

    # tpserve_num_preemptions_total{phase} counts each phase as the scheduler saw it, and as the
    # events say (no NEW_TOKENS before the PREEMPTED = prefill).
    samples = driver.scrape()
    by_events = preemptions_by_phase(driver)
    by_scheduler = {
        "prefill": sum(it.scheduler.num_preemptions_prefill for it in driver.recorder.iterations),
        "decode": sum(it.scheduler.num_preemptions_decode for it in driver.recorder.iterations),
    }
    assert by_scheduler == by_events
    for name, count in by_events.items():
        assert value(samples, "tpserve_num_preemptions_total", model_name=MODEL, phase=name) == count
    assert value(samples, "tpserve_request_num_preemptions_sum") == b_stats.num_preemptions
    assert value(samples, "tpserve_request_num_preemptions_bucket", le="0.5") == 1  # A
    assert value(samples, "tpserve_request_preemption_stall_seconds_sum") == pytest.approx(b_stats.preemption_stall)
    # Recomputation is prefill work; the prompt is counted once, when its prefill completed.
    computed = sum(it.scheduler.prefill_tokens for it in driver.recorder.iterations)
    assert value(samples, "tpserve_prefill_tokens_computed_total") == computed
    assert computed > a.prompt_len + b.prompt_len - b.num_cached_tokens
    assert value(samples, "tpserve_prompt_tokens_total") == a.prompt_len + b.prompt_len
    assert value(samples, "tpserve_generation_tokens_total") == 23
    assert value(samples, "tpserve_kv_cache_used_tokens") == 0
    assert value(samples, "tpserve_kv_cache_used_blocks") == 0


# ---- 2. resident KV tokens vs batch tokens (vLLM #12330) -------------------------------------


def test_kv_used_tokens_are_resident_context_not_batch_tokens(tiny_path):
    block_size, shared = 4, 8  # the 8-token shared prefix is two full blocks
    driver = Driver(tiny_engine(tiny_path, num_blocks=64, block_size=block_size, budget=128))
    suffixes = {"r0": 5, "r1": 6, "r2": 7, "r3": 9}
    max_tokens = {"r0": 10, "r1": 13, "r2": 16, "r3": 20}
    for index, (request_id, suffix) in enumerate(suffixes.items()):
        driver.add(request_id, prompt(100, shared) + prompt(1000 + 100 * index, suffix), max_tokens[request_id])

    decode_only_steps = 0
    before = driver.scrape()
    # Before the first step the gauges already describe the (empty) cache.
    assert value(before, "tpserve_kv_cache_total_blocks") == value(before, "tpserve_kv_cache_free_blocks") == 63
    assert value(before, "tpserve_kv_cache_capacity_tokens") == 63 * block_size
    assert value(before, "tpserve_num_requests_waiting") == 0  # requests added, no step yet
    while driver.engine.has_unfinished_requests():
        live_before = driver.live()
        decode_only = all(driver.requests[rid].num_output_tokens > 0 for rid in live_before)
        driver.step()
        after = driver.scrape()
        live = driver.live()
        # Tokens whose K/V are written: prompt + generated - 1 (the last sampled token is not
        # computed yet); the shared prefix blocks are held by every live request, counted once.
        written = [driver.requests[rid].prompt_len + driver.requests[rid].num_output_tokens - 1 for rid in live]
        expected_used = sum(written) - shared * (len(live) - 1) if live else 0
        expected_blocks = sum(math.ceil(w / block_size) for w in written) - shared // block_size * (len(live) - 1) if live else 0
        used_blocks = value(after, "tpserve_kv_cache_used_blocks")
        cached_blocks = value(after, "tpserve_kv_cache_cached_blocks")
        free_blocks = value(after, "tpserve_kv_cache_free_blocks")
        total_blocks = value(after, "tpserve_kv_cache_total_blocks")
        assert value(after, "tpserve_kv_cache_used_tokens", model_name=MODEL) == expected_used
        assert used_blocks == expected_blocks
        assert used_blocks + cached_blocks + free_blocks == total_blocks == 63
        assert value(after, "tpserve_kv_cache_unfilled_slots") == used_blocks * block_size - expected_used
        assert value(after, "tpserve_kv_cache_cached_tokens") == cached_blocks * block_size
        assert value(after, "tpserve_kv_cache_capacity_tokens") == 63 * block_size
        assert value(after, "tpserve_kv_cache_usage_perc") == pytest.approx(used_blocks / 63)
        assert value(after, "tpserve_num_requests_running") == len(live)

        def delta(name: str) -> float:
            return value(after, name) - value(before, name)

        # One observation per step in every per-step histogram.
        assert delta("tpserve_iteration_tokens_total_count") == 1
        if decode_only:
            decode_only_steps += 1
            # The batch of a decode-only step is one token per running request, however many
            # tokens those requests hold in the cache.
            assert delta("tpserve_iteration_tokens_total_sum") == len(live_before)
            assert delta("tpserve_iteration_decode_tokens_sum") == len(live_before)
            assert delta("tpserve_iteration_prefill_tokens_sum") == 0
            assert delta("tpserve_iteration_num_requests_sum") == len(live_before)
            assert value(after, "tpserve_kv_cache_used_tokens") > len(live_before) or not live
        before = after

    assert decode_only_steps == max(max_tokens.values()) - 1
    # Prefix sharing really happened: every request but the first found the prefix cached.
    assert [driver.requests[rid].num_cached_tokens for rid in suffixes] == [0, shared, shared, shared]
    assert value(before, "tpserve_prompt_tokens_cached_total") == 3 * shared
    assert value(before, "tpserve_prefix_cache_hits_total") == 3 * shared
    assert value(before, "tpserve_prefix_cache_queries_total") == sum(t.prompt_len for t in driver.requests.values())
    # All finished: nothing used, their full blocks kept as cached.
    assert value(before, "tpserve_kv_cache_used_tokens") == 0
    assert value(before, "tpserve_kv_cache_used_blocks") == 0
    assert value(before, "tpserve_kv_cache_unfilled_slots") == 0
    assert value(before, "tpserve_kv_cache_cached_blocks") > 0
    for request_id in suffixes:
        check_request(driver, request_id)


# ---- 3. chunked prefill counted per chunk ----------------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_chunked_prefill_is_counted_per_chunk(tiny_path, max_tokens):
    driver = Driver(tiny_engine(tiny_path, num_blocks=32, budget=16))
    driver.add("long", prompt(300, 64), max_tokens)
    driver.run_to_end()
    samples = driver.scrape()
    per_step = [it.scheduler.prefill_tokens for it in driver.recorder.iterations]
    assert per_step == [16, 16, 16, 16] + [0] * (max_tokens - 1)
    # Four prefill chunks = four observations whose sum is the prompt; every per-step histogram
    # observes every step, so decode-only steps add observations of 0 prefill tokens.
    assert value(samples, "tpserve_iteration_prefill_tokens_count", model_name=MODEL) == 4 + (max_tokens - 1)
    assert value(samples, "tpserve_iteration_prefill_tokens_sum") == 64
    assert value(samples, "tpserve_iteration_prefill_tokens_bucket", le="1.0") == max_tokens - 1
    assert value(samples, "tpserve_iteration_prefill_tokens_bucket", le="10.0") == max_tokens - 1
    assert value(samples, "tpserve_iteration_prefill_tokens_bucket", le="16.0") == 4 + (max_tokens - 1)
    assert value(samples, "tpserve_iteration_decode_tokens_sum") == max_tokens - 1
    assert value(samples, "tpserve_prefill_tokens_computed_total") == 64
    assert value(samples, "tpserve_prompt_tokens_total") == 64  # once, not once per chunk
    assert value(samples, "tpserve_generation_tokens_total") == max_tokens
    assert value(samples, "tpserve_request_prompt_tokens_sum") == 64
    check_request(driver, "long")


# ---- 4. aborted requests ---------------------------------------------------------------------


def test_aborted_requests_are_counted_with_the_intervals_they_reached(tiny_path):
    driver = Driver(tiny_engine(tiny_path, num_blocks=64, budget=8, max_num_seqs=2))
    driver.add("decoding", prompt(100, 4), 50)
    driver.add("prefilling", prompt(200, 40), 10)
    driver.add("queued", prompt(300, 4), 10)  # max_num_seqs=2: never scheduled
    for _ in range(3):
        driver.step()
    decoding, prefilling, queued = (driver.requests[r] for r in ("decoding", "prefilling", "queued"))
    assert decoding.num_output_tokens == 3
    computed_before_abort = driver.engine.scheduler.requests["prefilling"].num_computed_tokens
    assert 0 < computed_before_abort < 40 and prefilling.num_output_tokens == 0
    assert not queued.ts(E.SCHEDULED)

    driver.abort(["decoding", "prefilling", "queued"])
    # The aborts freed every block between steps; the gauges say so without waiting for a step.
    samples = driver.scrape()
    for name in ("tpserve_kv_cache_used_blocks", "tpserve_kv_cache_used_tokens", "tpserve_num_requests_running",
                 "tpserve_num_requests_waiting", "tpserve_kv_cache_usage_perc"):
        assert value(samples, name) == 0, name
    assert value(samples, "tpserve_kv_cache_free_blocks") + value(samples, "tpserve_kv_cache_cached_blocks") == 63
    assert value(samples, "tpserve_iteration_tokens_total_count") == 3  # no step was made up
    driver.add("complete", prompt(400, 6), 4)
    driver.run_to_end()

    samples = driver.scrape()
    assert value(samples, "tpserve_request_success_total", model_name=MODEL, finished_reason="abort") == 3
    assert value(samples, "tpserve_request_success_total", finished_reason="length") == 1
    assert value(samples, "tpserve_request_success_total", finished_reason="stop") == 0
    # Request histograms hold every finished request, with the intervals it reached.
    assert value(samples, "tpserve_e2e_request_latency_seconds_count") == 4
    assert value(samples, "tpserve_request_prompt_tokens_count") == 4
    assert value(samples, "tpserve_request_num_preemptions_count") == 4
    assert value(samples, "tpserve_request_preemption_stall_seconds_count") == 4
    assert value(samples, "tpserve_request_queue_time_seconds_count") == 3  # not the never-scheduled one
    assert value(samples, "tpserve_request_prefill_time_seconds_count") == 2  # decoding, complete
    assert value(samples, "tpserve_time_to_first_token_seconds_count") == 2
    assert value(samples, "tpserve_request_decode_time_seconds_count") == 2
    assert value(samples, "tpserve_request_time_per_output_token_seconds_count") == 2
    assert value(samples, "tpserve_inter_token_latency_seconds_count") == 2 + 3
    # Token counters stay consistent with what was produced and what was prefilled.
    produced = sum(t.num_output_tokens for t in driver.requests.values())
    assert produced == 3 + 4
    assert value(samples, "tpserve_generation_tokens_total") == produced
    assert value(samples, "tpserve_request_generation_tokens_sum") == produced
    assert value(samples, "tpserve_prompt_tokens_total") == 4 + 6  # prefill completed: decoding, complete
    assert value(samples, "tpserve_request_prompt_tokens_sum") == 4 + 40 + 4 + 6
    assert value(samples, "tpserve_prefill_tokens_computed_total") == 4 + computed_before_abort + 6
    assert value(samples, "tpserve_kv_cache_used_blocks") == 0

    for request_id in ("decoding", "prefilling", "queued", "complete"):
        check_request(driver, request_id)
    assert prefilling.stats.queue_time is not None and prefilling.stats.prefill_time is None
    assert prefilling.stats.ttft is None and prefilling.stats.decode_time is None
    assert queued.stats.queue_time is None and queued.stats.e2e_latency is not None
    assert decoding.stats.decode_time is not None and decoding.stats.finished_reason == "abort"
    for request_id in ("decoding", "prefilling", "queued"):
        assert driver.metrics.timelines.get(request_id).extra["finish_reason"] == "abort"


def test_batched_step_stats_all_reach_the_loggers_in_order(tiny_path, monkeypatch):
    """A server hands step stats to the loggers in batches (step_flush_interval_s): each step's
    stats are held until the oldest held one is that old, or until /metrics renders, a request
    ends between steps, or the loop flushes; none is lost, reordered or counted twice."""
    import deployments.engine.engine_metrics as engine_metrics

    clock = [100.0]
    monkeypatch.setattr(engine_metrics, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    driver = Driver(tiny_engine(tiny_path, num_blocks=64), step_flush_interval_s=0.25)
    driver.add("a", prompt(10, 12), max_tokens=8)
    driver.add("b", prompt(40, 6), max_tokens=8)
    held = [driver.step() for _ in range(3)]
    assert driver.recorder.iterations == []  # no time has passed: all three are held
    samples = parse(driver.metrics.render_metrics().decode())  # a scrape sees every step so far
    assert driver.recorder.iterations == held
    assert value(samples, "tpserve_generation_tokens_total") == sum(i.num_generation_tokens for i in held)
    assert value(samples, "tpserve_iteration_tokens_total_count") == 3

    more = [driver.step(), driver.step()]
    clock[0] += 0.1
    more.append(driver.step())
    assert driver.recorder.iterations == held  # the oldest held step is 0.1 s old
    clock[0] += 0.15
    more.append(driver.step())  # now 0.25 s: this step and every one before it go out
    assert driver.recorder.iterations == held + more

    last = driver.step()
    driver.abort(["a"])  # a request ended between steps: held steps first, then the gauges
    assert driver.recorder.iterations == held + more + [last]
    driver.run_to_end()
    driver.metrics.flush_steps()  # what the server's loop does once the engine is out of work
    samples = parse(driver.metrics.render_metrics().decode())
    assert len(driver.recorder.iterations) == len({id(i) for i in driver.recorder.iterations})
    produced = sum(t.num_output_tokens for t in driver.requests.values())
    assert value(samples, "tpserve_generation_tokens_total") == produced
    assert value(samples, "tpserve_iteration_tokens_total_count") == len(driver.recorder.iterations)
    assert value(samples, "tpserve_kv_cache_used_blocks") == 0
