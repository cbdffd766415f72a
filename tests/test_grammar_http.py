"""response_format compile bounds at the HTTP edge (fake engine, real grammar manager on the real
tokenizer): a schema slower than grammar_compile_timeout_s is a 400 naming response_format at the
deadline, a schema over the size cap is a 400 before compiling, compile threads all stuck in
overdue compiles are a 503 with Retry-After; none of them reaches the engine."""

from __future__ import annotations

import threading
import time

import pytest

from deployments.engine.structured_output import GrammarLimits, StructuredOutputManager
from model_fixtures import default_model_path
from test_serving_fake_engine import FakeEngine, assert_error, post, run


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture()
def release():
    event = threading.Event()
    yield event
    event.set()


def engine_with_grammars(tokenizer, release: threading.Event, **limits) -> FakeEngine:
    """A fake engine whose grammar manager's compiles block until `release` (a slow schema)."""
    manager = StructuredOutputManager(tokenizer, vocab_size=49152, limits=GrammarLimits(**limits))

    def blocked_compile(spec):
        release.wait(30)
        raise AssertionError("never reached in these tests")

    manager._compile_uncached = blocked_compile
    engine = FakeEngine()
    # The engine client's compile_grammar, over the real grammar manager.
    engine.compile_grammar = manager.compile_async
    return engine


def body_with_schema(title: str, path: str) -> dict:
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "title": title}}}
    prompt = {"prompt": "a b"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]}
    return {"max_tokens": 2, "response_format": schema, **prompt}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_schema_slower_than_the_timeout_is_a_400_at_the_deadline(tokenizer, release, path):
    engine = engine_with_grammars(tokenizer, release, compile_timeout_s=0.3)
    started = time.monotonic()
    error = assert_error(run(post(engine, path, body_with_schema("slow", path))), 400)
    assert time.monotonic() - started < 3, "the response waited for the compile, not the deadline"
    assert error["param"] == "response_format" and "grammar_compile_timeout_s" in error["message"]
    assert not engine.calls


def test_compile_threads_all_stuck_is_a_503_at_once(tokenizer, release):
    # One compile thread and one abandoned slot: two overdue schemas use both up.
    engine = engine_with_grammars(tokenizer, release, compile_timeout_s=0.2, compile_threads=1)
    for title in ("stuck-1", "stuck-2"):
        assert_error(run(post(engine, "/v1/completions", body_with_schema(title, "/v1/completions"))), 400)
    started = time.monotonic()
    response = run(post(engine, "/v1/completions", body_with_schema("third", "/v1/completions")))
    error = assert_error(response, 503)
    assert time.monotonic() - started < 1 and response.headers["Retry-After"]
    assert error["code"] == "grammar_compiler_busy" and not engine.calls


def test_a_schema_over_the_size_cap_is_a_400_before_compiling(tokenizer, release):
    engine = engine_with_grammars(tokenizer, release, max_schema_chars=200)
    body = body_with_schema("t" * 300, "/v1/completions")
    started = time.monotonic()
    error = assert_error(run(post(engine, "/v1/completions", body)), 400)
    assert time.monotonic() - started < 1
    assert error["param"] == "response_format" and "at most 200" in error["message"]
