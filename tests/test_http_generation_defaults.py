"""generation_config.json defaults reach SamplingParams only for the fields a client leaves out
(HTTP app over the fake engine of test_serving_fake_engine)."""

from __future__ import annotations

from test_serving_fake_engine import FakeEngine, post, run
from workers.model.generation_defaults import GenerationDefaults

MODEL_DEFAULTS = GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_tokens=3)


def params_of(engine: FakeEngine):
    return [call[2] for call in engine.calls]


def test_model_defaults_fill_only_what_the_client_left_out():
    engine = FakeEngine()
    engine.generation_defaults = MODEL_DEFAULTS
    run(post(engine, "/v1/completions", {"prompt": "a b", "temperature": 0.0, "top_k": None}))
    (params,) = params_of(engine)
    assert params.temperature == 0.0, "the client's temperature wins"
    assert (params.top_p, params.top_k, params.repetition_penalty) == (0.9, 20, 1.1)
    assert params.max_tokens == 3, "max_new_tokens is the default length cap"


def test_chat_length_cap_from_the_model_and_client_cap_wins():
    engine = FakeEngine()
    engine.generation_defaults = MODEL_DEFAULTS
    run(post(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}))
    run(post(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "max_completion_tokens": 2, "top_p": 0.5}))
    first, second = params_of(engine)
    assert first.max_tokens == 3 and first.temperature == 0.6
    assert second.max_tokens == 2 and second.top_p == 0.5 and second.top_k == 20


def test_without_defaults_the_openai_defaults_stay():
    engine = FakeEngine()
    run(post(engine, "/v1/completions", {"prompt": "a"}))
    (params,) = params_of(engine)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, 0, 16)
