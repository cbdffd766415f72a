"""A request's own fault fails that request alone (issue 12, items 2 and 4), and a client slower
than the engine reads merged outputs (issue 11, lever 2).

Faults are injected per request inside a batch of healthy greedy requests on a tiny random
Llama: a sampling error reported by the runner (`ModelRunnerOutput.request_errors`, what the
sampler reports for non-finite logits) and a tokenizer that raises while detokenizing one
request. Only the faulty request ends, with finish_reason "abort" and an error message; the
others' tokens equal a fault-free run; the KV cache is empty afterwards.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from deployments.engine.async_engine import AsyncEngine, RequestStream
from deployments.engine.engine import merge_eos_token_ids
from workers.model.generation_defaults import read_generation_defaults
from deployments.engine.engine_metrics import EngineMetrics
from deployments.engine.output_processor import OUTPUT_FAILED_MESSAGE
from deployments.engine.outputs import RequestOutput
from engine_helpers import greedy, make_engine, run_engine
from metrics.stat_logger import StatLogger
from metrics.stats import IterationStats, SchedulerStats
from model_fixtures import make_tiny_llama
from scheduler_factories import FakeRunner, make_request, make_scheduler, run_until_done
from scheduler.request import RequestStatus

PROMPTS = {f"r{i}": [100 + 7 * i + k for k in range(6 + 3 * i)] for i in range(4)}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def reference(tiny_model) -> dict[str, list[int]]:
    engine = make_engine(tiny_model)
    try:
        return run_engine(engine, {rid: (p, greedy(MAX_TOKENS)) for rid, p in PROMPTS.items()})
    finally:
        engine.shutdown()


def run_collecting(engine) -> dict[str, RequestOutput]:
    """Every request's outputs folded into one (tokens, text, final status)."""
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, greedy(MAX_TOKENS))
    merged: dict[str, RequestOutput] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.request_id in merged:
                merged[out.request_id].merge(out)
            else:
                merged[out.request_id] = out
    assert not engine.has_unfinished_requests() and engine.num_used_kv_blocks == 0
    return merged


def assert_only_faulty_failed(results: dict[str, RequestOutput], reference, faulty: str, message: str) -> None:
    for rid, out in results.items():
        assert out.finished, rid
        if rid == faulty:
            assert out.finish_reason == "abort" and out.error is not None and message in out.error
            # What it produced before the fault is what it would have produced.
            assert out.new_token_ids == reference[rid][: len(out.new_token_ids)]
            assert len(out.new_token_ids) < MAX_TOKENS
        else:
            assert out.error is None and out.finish_reason == "length", rid
            assert out.new_token_ids == reference[rid], rid


def test_a_sampling_error_fails_only_its_request(tiny_model, reference):
    engine = make_engine(tiny_model)
    execute = engine.executor.execute_model
    steps_with_r1 = 0

    def faulty_execute(scheduler_output):
        nonlocal steps_with_r1
        result = execute(scheduler_output)
        if "r1" in result.sampled_token_ids:
            steps_with_r1 += 1
            if steps_with_r1 == 4:  # r1's 4th sampled token: the runner reports a failure instead
                del result.sampled_token_ids["r1"]
                result.logprobs.pop("r1", None)
                result.request_errors["r1"] = "sampling failed: the logits of this request are not finite"
        return result

    engine.executor.execute_model = faulty_execute
    try:
        results = run_collecting(engine)
    finally:
        engine.shutdown()
    assert_only_faulty_failed(results, reference, "r1", "logits of this request are not finite")
    assert len(results["r1"].new_token_ids) == 3


class PoisonedTokenizer:
    """The real tokenizer, except that decoding any sequence with `poison` in it raises."""

    def __init__(self, inner, poison: int) -> None:
        self._inner, self._poison = inner, poison

    def decode(self, ids, **kwargs):
        if self._poison in ids:
            raise RuntimeError("tokenizer exploded")
        return self._inner.decode(ids, **kwargs)


def test_a_detokenizer_error_fails_only_its_request(tiny_model, reference, caplog):
    engine = make_engine(tiny_model)
    # r2's prompt ends with a token no other prompt has; decoding it raises.
    engine.output_processor.tokenizer = PoisonedTokenizer(engine.tokenizer, PROMPTS["r2"][-1])
    try:
        results = run_collecting(engine)
    finally:
        engine.shutdown()
    assert_only_faulty_failed(results, reference, "r2", OUTPUT_FAILED_MESSAGE)
    # The message says what failed, not where; the trace is in the log.
    assert "exploded" not in results["r2"].error
    assert any("tokenizer exploded" in (r.exc_text or "") for r in caplog.records)


class RaisingLogger(StatLogger):
    def record(self, iteration):
        raise RuntimeError("exporter down")

    def record_finished(self, stats):
        raise RuntimeError("exporter down")


class CountingLogger(StatLogger):
    def __init__(self) -> None:
        self.steps = 0

    def record(self, iteration):
        self.steps += 1

    def record_finished(self, stats):
        pass


def test_a_raising_stat_logger_never_reaches_the_engine():
    counting = CountingLogger()
    metrics = EngineMetrics([RaisingLogger(), counting], timeline_capacity=4, frontend_finalizes=False)
    for _ in range(3):
        metrics.on_step([], IterationStats(scheduler=SchedulerStats()))
    assert counting.steps == 3


def test_any_of_several_eos_ids_stops_a_request():
    # Llama 3 style: generation_config.json lists several EOS ids.
    for eos in (5, 7):
        sched = make_scheduler()
        req = make_request(5, max_tokens=4, eos_token_id=(5, 7))
        sched.add_request(req)
        run_until_done(sched, FakeRunner.for_scheduler(sched, scripts={req.request_id: [9, eos, 9, 9]}))
        assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [9, eos]


def test_the_engine_reads_every_eos_id_of_generation_config(tmp_path):
    class Tokenizer:
        eos_token_id = 99

    def read_eos_token_ids(path: str, config_ids, tokenizer):
        # "ignore" drops the sampling defaults, never the EOS ids.
        return merge_eos_token_ids(config_ids, read_generation_defaults(path, "ignore"), tokenizer)

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    assert read_eos_token_ids(str(tmp_path), (128001,), Tokenizer()) == (128001, 128008, 128009)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert read_eos_token_ids(str(tmp_path), (), Tokenizer()) == (3,)
    (tmp_path / "generation_config.json").unlink()
    assert read_eos_token_ids(str(tmp_path), (), Tokenizer()) == (99,)


# ---- frame merging ---------------------------------------------------------------------------


def output(rid: str, token: int, text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [token], text, None, finished, "length" if finished else None, 3, token, 0)


def test_request_stream_merges_what_the_consumer_has_not_read():
    async def scenario():
        stream = RequestStream()
        for k in range(1, 4):
            stream.put(output("a", k, f" t{k}", finished=k == 3))
        merged = await stream.get()
        assert merged.new_token_ids == [1, 2, 3] and merged.new_text == " t1 t2 t3"
        assert merged.finished and merged.finish_reason == "length" and merged.num_output_tokens == 3
        # Nothing pending: the next read waits for the next put.
        waiting = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        stream.put(output("a", 4, " t4"))
        assert (await waiting).new_token_ids == [4]

    asyncio.run(scenario())


def delivered_finished(engine: AsyncEngine, request_id: str) -> bool:
    """The request's final output waits, unread, in its stream."""
    stream = engine._streams.get(request_id)
    return stream is not None and stream._pending is not None and stream._pending.finished


def test_a_slow_client_reads_one_merged_output_not_one_per_token(tiny_model, reference):
    """The consumer reads nothing until the request is over: it then gets ONE output with every
    token (not a backlog of 12), and the tokens are the engine's own."""
    from deployments.config import TpserveConfig

    engine = AsyncEngine(TpserveConfig(model=tiny_model, dtype="float32", kv_cache_memory_gib=0.25))

    async def scenario() -> list[RequestOutput]:
        (stream,) = engine.admit([("r0", PROMPTS["r0"], greedy(MAX_TOKENS))], time.monotonic())
        reads = [await anext(stream)]  # admitted; the first output (its prefill) is read
        # The client is busy while the engine runs the request to its end and the event loop
        # hands it the last output. (Waiting on the engine alone races: a step finishes the
        # request on the step thread a moment before the loop delivers that step's output.)
        while not delivered_finished(engine, "r0"):
            await asyncio.sleep(0.01)
        reads += [out async for out in stream]
        return reads

    try:
        reads = asyncio.run(scenario())
    finally:
        asyncio.run(engine.shutdown())
    assert len(reads) == 2 and reads[-1].finished
    assert [t for out in reads for t in out.new_token_ids] == reference["r0"]


def test_a_stop_check_error_fails_only_its_request(monkeypatch):
    import scheduler.scheduler as scheduler_module

    real_check = scheduler_module.check_stop

    def check_stop(request, max_model_len):
        if request.request_id == "bad" and request.num_output_tokens == 2:
            raise IndexError("stop ids out of range")
        return real_check(request, max_model_len)

    monkeypatch.setattr(scheduler_module, "check_stop", check_stop)
    sched = make_scheduler()
    good, bad = make_request(6, "good", max_tokens=5), make_request(6, "bad", max_tokens=5)
    sched.add_request(good)
    sched.add_request(bad)
    run_until_done(sched, FakeRunner.for_scheduler(sched))
    assert good.status == RequestStatus.FINISHED_LENGTH and good.num_output_tokens == 5 and good.error is None
    assert bad.status == RequestStatus.FINISHED_ABORTED and bad.error == scheduler_module.STOP_HANDLING_FAILED_MESSAGE
    assert sched.kv.pool.num_used_blocks == 0


def test_an_unread_final_output_is_not_rewritten_by_a_later_failure():
    """Shutdown delivers "shutting down"; the step it tore down may then fail and report "the
    engine failed" to the same stream before the client reads it (seen once in
    test_graceful_shutdown). The client must read the first final output, unchanged."""
    async def scenario():
        stream = RequestStream()
        stream.put(output("a", 1, " t1"))
        stream.put(RequestOutput("a", [], "", None, True, "abort", 3, 1, 0, error="the server is shutting down"))
        stream.put(RequestOutput("a", [], "", None, True, "abort", 3, 0, 0, error="the engine failed"))
        merged = await stream.get()
        assert merged.new_token_ids == [1] and merged.finished and merged.finish_reason == "abort"
        assert merged.error == "the server is shutting down" and merged.num_output_tokens == 1
        # A normal end is not turned into an abort either.
        stream.put(output("b", 2, " t2", finished=True))
        stream.put(RequestOutput("b", [], "", None, True, "abort", 3, 0, 0, error="the engine failed"))
        done = await stream.get()
        assert done.finish_reason == "length" and done.error is None and done.num_output_tokens == 2

    asyncio.run(scenario())


def test_shutdown_releases_the_model_and_kv_cache_while_the_engine_object_lives(tiny_model):
    """An HTTP app keeps its engine object alive after shutdown (FastAPI caches the endpoint
    closures); the weights and KV cache must go anyway, or a GPU keeps that memory."""
    import gc
    import weakref

    engine = make_engine(tiny_model)
    worker = engine.executor.worker
    model, kv_cache = weakref.ref(worker.model), weakref.ref(worker.runner.kv_caches[0][0])
    engine.shutdown()
    gc.collect()
    assert model() is None and kv_cache() is None
    engine.add_request("late", PROMPTS["r0"], greedy(2))
    with pytest.raises(RuntimeError, match="shut down"):
        engine.executor.execute_model(None)
