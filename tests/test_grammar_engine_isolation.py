"""Grammar hooks inside the engine step (a tiny random Llama with SmolLM2's tokenizer, no real
weights needed): a hook that raises ends that request alone, with an error, never the step or its
batch mates; a request's matcher is removed however the request ends; a grammar missing from the
cache at admission compiles on the compile threads, never on the event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from deployments.engine.async_engine import AsyncEngine
from deployments.engine.structured_output import GRAMMAR_FAILED_MESSAGE
from engine_helpers import make_engine
from model_fixtures import make_tiny_llama
from scheduler.sampling_params import SamplingParams, StructuredOutputSpec

PROMPT = [100 + k for k in range(8)]
JSON_OBJECT = StructuredOutputSpec("json_object")


def constrained(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=JSON_OBJECT)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = make_engine(make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))
    yield eng
    eng.shutdown()


class RaisingMatcher:
    """Wraps a real matcher; one of its methods raises (a fault inside xgrammar)."""

    def __init__(self, inner, failing: str) -> None:
        self._inner = inner
        self._failing = failing

    def __getattr__(self, name):
        if name == self._failing:
            def fail(*args, **kwargs):
                raise RuntimeError(f"injected fault in {name}")
            return fail
        return getattr(self._inner, name)


def run_all(engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


@pytest.mark.parametrize("failing", ["fill_next_token_bitmask", "accept_token", "is_terminated"])
def test_a_raising_grammar_hook_ends_its_request_alone(engine, failing):
    engine.add_request("bad", PROMPT, constrained())
    engine.add_request("good", PROMPT, constrained())
    engine.add_request("free", PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    manager = engine.structured_output
    manager._matchers["bad"] = RaisingMatcher(manager._matchers["bad"], failing)
    outputs = run_all(engine)
    bad = outputs["bad"][-1]
    assert bad.finished and bad.finish_reason == "abort" and bad.error == GRAMMAR_FAILED_MESSAGE
    assert outputs["bad"][-1].new_text == "", "text sampled without the grammar's mask was released"
    for rid in ("good", "free"):
        last = outputs[rid][-1]
        assert last.finished and last.error is None and last.finish_reason in ("stop", "length")
    assert sum(len(o.new_token_ids) for o in outputs["free"]) == 8
    assert engine.structured_output.num_constrained == 0
    assert engine.num_used_kv_blocks == 0


def test_matcher_removed_when_a_queued_request_is_aborted(engine):
    engine.add_request("queued", PROMPT, constrained())
    assert engine.structured_output.is_constrained("queued")
    engine.abort_requests(["queued"])  # never scheduled: no step will see it end
    assert not engine.structured_output.is_constrained("queued")


def test_matcher_removed_when_a_running_request_is_aborted(engine):
    engine.add_request("running", PROMPT, constrained(max_tokens=50))
    engine.step()
    assert engine.structured_output.is_constrained("running")
    engine.abort_requests(["running"])
    assert engine.structured_output.num_constrained == 0 and engine.num_used_kv_blocks == 0


def test_matcher_removed_in_the_step_the_request_ends(engine):
    engine.add_request("short", PROMPT, constrained(max_tokens=1))
    outs = engine.step()
    assert any(o.request_id == "short" and o.finished for o in outs)
    assert engine.structured_output.num_constrained == 0, "kept until some later step"


def test_matcher_removed_when_the_scheduler_refuses_the_request(engine):
    with pytest.raises(ValueError):
        engine.add_request("too-long", list(range(100, 100 + engine.max_model_len)), constrained())
    assert engine.structured_output.num_constrained == 0


def test_async_paths_compile_off_loop_and_release_matchers(engine):
    async def scenario():
        async_engine = AsyncEngine(engine.config, engine=engine)
        await async_engine.start()
        manager = engine.structured_output
        loop_thread = threading.get_ident()
        compile_threads: list[int] = []
        real_compile = manager._compile_uncached

        def recording_compile(spec):
            compile_threads.append(threading.get_ident())
            return real_compile(spec)

        manager._compile_uncached = recording_compile
        try:
            # A schema the HTTP layer never compiled (or one evicted since): a cache miss at admission.
            spec = StructuredOutputSpec("json_schema", '{"type": "object", "properties": {"miss": {"type": "integer"}}}')
            assert manager.cached(spec) is None
            params = SamplingParams(max_tokens=6, temperature=0.0, structured_output=spec)
            (outputs,) = async_engine.admit([("miss", PROMPT, params)], 0.0)
            finals = [out async for out in outputs]
            assert finals[-1].finished and finals[-1].error is None
            assert compile_threads and loop_thread not in compile_threads, "compiled on the event loop"

            # A client that goes away mid-stream: its matcher goes with its request.
            (outputs,) = async_engine.admit([("gone", PROMPT, constrained(max_tokens=200))], 0.0)
            await anext(outputs)
            await outputs.aclose()
            for _ in range(50):
                if not manager.is_constrained("gone") and not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.05)
            assert not manager.is_constrained("gone") and engine.num_used_kv_blocks == 0

            # A schema that cannot compile at admission ends that request with the reason.
            bad = SamplingParams(max_tokens=4, structured_output=StructuredOutputSpec("json_schema", '{"type": 5}'))
            (outputs,) = async_engine.admit([("bad-schema", PROMPT, bad)], 0.0)
            finals = [out async for out in outputs]
            assert finals[-1].finish_reason == "abort" and "JSON schema" in finals[-1].error
            assert manager.num_constrained == 0
        finally:
            manager._compile_uncached = real_compile
            if async_engine._loop_task is not None:
                async_engine._loop_task.cancel()
            async_engine._step_thread.shutdown(wait=False)

    asyncio.run(scenario())


def test_matchers_dropped_when_the_engine_fails(engine):
    """A step that raises kills the loop; no request will step again, so no matcher stays."""

    async def scenario():
        async_engine = AsyncEngine(engine.config, engine=engine)
        await async_engine.start()
        real_execute = engine.executor.execute_model

        def broken(_):
            raise RuntimeError("injected worker failure")

        engine.executor.execute_model = broken
        try:
            (outputs,) = async_engine.admit([("doomed", PROMPT, constrained(max_tokens=50))], 0.0)
            finals = [out async for out in outputs]
            assert finals[-1].finish_reason == "abort" and async_engine.dead_reason is not None
            for _ in range(50):
                if engine.structured_output.num_constrained == 0:
                    break
                await asyncio.sleep(0.05)
            assert engine.structured_output.num_constrained == 0
        finally:
            engine.executor.execute_model = real_execute
            engine.abort_requests(["doomed"])  # the module's engine goes on for other tests
            async_engine._step_thread.shutdown(wait=False)

    asyncio.run(scenario())
