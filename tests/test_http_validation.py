"""Issue 12 items 1, 3, 6, 8 at the HTTP edge, over the scripted fake engine (no model, no Ray):
every bad input is a 4xx naming its field before the engine sees anything; caps come from the
config; tokenizing runs off the event loop; /health never waits on the engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from deployments.config import TpserveConfig
from deployments.http.health import HealthMonitor
from test_serving_fake_engine import FakeEngine, assert_error, post, run

SMALL_CAPS = dict(
    max_request_body_bytes=2000, max_json_depth=8, max_prompt_chars=50, max_prompts_per_request=3,
    max_stop_strings=2, max_stop_string_chars=5, max_stop_token_ids=2, max_num_seqs=4,
)


class CappedEngine(FakeEngine):
    """The fake engine with a config carrying small caps, and a record of tokenizer threads."""

    def __init__(self, **overrides) -> None:
        super().__init__()
        self.config = TpserveConfig(**{**SMALL_CAPS, **overrides})
        self.tokenizer_threads: list[str] = []
        encode = self.tokenizer.encode

        def recording_encode(text: str) -> list[int]:
            self.tokenizer_threads.append(threading.current_thread().name)
            return encode(text)

        self.tokenizer.encode = recording_encode


def error_for(body, path: str = "/v1/completions", status: int = 400, **overrides) -> dict:
    engine = CappedEngine(**overrides)
    error = assert_error(run(post(engine, path, body)), status)
    assert engine.calls == [], "nothing reached the engine"
    return error


# ---- bodies ------------------------------------------------------------------------------------


def test_a_body_over_the_cap_is_413():
    error = error_for({"prompt": "a", "padding": "x" * 3000}, status=413)
    assert error["code"] == "request_too_large" and "2000 bytes" in error["message"]


@pytest.mark.parametrize(
    "raw",
    [
        "[" * 100_000,  # deeper than Python's recursion limit
        json.dumps({"prompt": "a", "extra": [[[[[[[[[[1]]]]]]]]]]}),  # deeper than max_json_depth
        '{"prompt": "a", "temperature": NaN}',
        '{"prompt": "a", "top_p": Infinity}',
        b'{"prompt": "\xff\xfe"}',
        "null",
        '"just a string"',
    ],
)
def test_malformed_json_of_any_shape_is_400(raw):
    if isinstance(raw, str) and len(raw) > 1000:
        error = error_for(raw, max_request_body_bytes=1_000_000)
    else:
        error = error_for(raw)
    assert error["code"] == "json_invalid"


# ---- sampling fields and token ids --------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"repetition_penalty": 1e-50}, "repetition_penalty"),
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"stop": "toolong"}, "stop"),
        ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids"),
        ({"stop_token_ids": [1000]}, "stop_token_ids"),  # FakeTokenizer has 1000 ids
        ({"logit_bias": {"1000": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": [5, 1000]}, "prompt"),
        ({"prompt": [[5], [6, 2**40]]}, "prompt"),
        ({"prompt": ["a", "b", "c", "d"]}, "prompt"),
        ({"prompt": "x" * 51}, "prompt"),
        ({"prompt": ["a", "b"], "n": 3}, "n"),
        ({"max_tokens": 2**40}, "max_tokens"),
    ],
)
def test_bad_completion_fields_are_400_naming_the_field(fields, param):
    error = error_for({"prompt": "a", "max_tokens": 2, **fields})
    assert error["param"] == param, error


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 5}, "n"),
        ({"messages": [{"role": "user", "content": "x" * 60}]}, "messages"),
        ({"stop_token_ids": [5000]}, "stop_token_ids"),
        ({"logit_bias": {"99999": -1}}, "logit_bias"),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    assert error_for(body, "/v1/chat/completions")["param"] == param


def test_logit_bias_and_cache_salt_pass_through_to_the_engine():
    engine = CappedEngine()
    body = {"prompt": "a", "max_tokens": 1, "logit_bias": {"7": -100, "12": 2.5}, "cache_salt": "tenant-1"}
    assert run(post(engine, "/v1/completions", body)).status_code == 200
    params = engine.calls[0][2]
    assert params.logit_bias == ((7, -100.0), (12, 2.5)) and params.cache_salt == "tenant-1"


# ---- context overflow (item 3) --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_chat_without_max_tokens_whose_prompt_fills_the_context_is_400(stream):
    # FakeEngine.max_model_len = 64; the template adds "user:" and "assistant:".
    words = " ".join(f"w{i}" for i in range(62))  # 64 tokens with the template: no room
    body = {"messages": [{"role": "user", "content": words}], "stream": stream}
    error = error_for(body, "/v1/chat/completions", max_prompt_chars=10_000)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "max_model_len=64" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_over_the_context_is_400_before_any_stream(stream):
    body = {"prompt": "a b c", "max_tokens": 62, "stream": stream}
    error = error_for(body)
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"


def test_the_default_max_tokens_shrinks_to_the_room_left():
    engine = CappedEngine(max_prompt_chars=10_000)
    prompt = " ".join(f"w{i}" for i in range(60))  # 60 tokens of 64: 4 left, default is 16
    assert run(post(engine, "/v1/completions", {"prompt": prompt})).status_code == 200
    assert engine.calls[0][2].max_tokens == 4


# ---- where work runs, what errors say ------------------------------------------------------------


def test_prompts_are_tokenized_off_the_event_loop():
    engine = CappedEngine()
    assert run(post(engine, "/v1/completions", {"prompt": "a b", "max_tokens": 1})).status_code == 200
    assert engine.tokenizer_threads and all(t.startswith("tpserve-tokenize") for t in engine.tokenizer_threads)


def test_template_errors_that_are_not_the_clients_say_nothing_of_our_internals():
    engine = CappedEngine()

    def broken_template(*args, **kwargs):
        raise OSError("/opt/secret/path/tokenizer.json: permission denied (pid 4242)")

    engine.tokenizer.apply_chat_template = broken_template
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    error = assert_error(run(post(engine, "/v1/chat/completions", body)), 400)
    assert "/opt" not in error["message"] and "4242" not in error["message"]


class SlowHealthEngine:
    """is_healthy blocks (a TP ping through Ray to a slow worker)."""

    def __init__(self, delay_s: float, healthy: bool = True) -> None:
        self.delay_s = delay_s
        self.healthy = healthy

    def is_healthy(self) -> bool:
        time.sleep(self.delay_s)
        return self.healthy


class BlockedHealthEngine:
    """is_healthy blocks until released (a TP ping stuck in Ray) and says when it entered/returned."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()

    def is_healthy(self) -> bool:
        self.entered.set()
        self.release.wait(timeout=10)  # bounded: a ping wrongly run on the loop still ends
        self.returned.set()
        return True


def test_health_reads_a_background_answer_and_never_blocks_the_loop():
    """Ordered by events, not by a lag threshold: while a ping is blocked, the event loop turns
    and reads the last answer (a ping run on the loop would have returned before it could)."""
    engine = BlockedHealthEngine()

    async def scenario():
        monitor = HealthMonitor(engine, interval_s=0.05, timeout_s=30.0)
        monitor.start()
        while not engine.entered.is_set():
            await asyncio.sleep(0.005)
        answers = []
        for _ in range(10):
            answers.append(monitor.healthy)
            await asyncio.sleep(0)
        ping_in_flight = not engine.returned.is_set()
        engine.release.set()
        await monitor.stop()
        return answers, ping_in_flight

    answers, ping_in_flight = run(scenario())
    assert ping_in_flight and all(answers)


def test_a_hung_or_failing_health_check_reads_unhealthy():
    async def scenario(engine, timeout_s):
        monitor = HealthMonitor(engine, interval_s=0.05, timeout_s=timeout_s)
        monitor.start()
        await asyncio.sleep(timeout_s + 0.3)
        answer = monitor.healthy
        await monitor.stop()
        return answer

    assert run(scenario(SlowHealthEngine(0.0, healthy=False), 0.2)) is False
    assert run(scenario(SlowHealthEngine(5.0), 0.2)) is False
    assert run(scenario(SlowHealthEngine(0.0), 0.2)) is True
