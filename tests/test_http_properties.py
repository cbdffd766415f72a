"""Issue 12, property-based: generated JSON bodies, valid and invalid, sent to both endpoints of
the real HTTP app over a real engine (SmolLM2, in process). Every answer is a 200 or a 4xx with an
OpenAI error body, never a 5xx nor an in-band error; afterwards the engine is alive and its KV
cache empty.

The strategies aim at the edges the issue lists: numbers outside what the sampler can compute
with (NaN, infinities, 1e-50 penalties, 2**70 seeds), token ids outside the vocabulary anywhere
(prompts, stop_token_ids, logit_bias), too many / too long stops and prompts, n x prompts over the
cap, malformed JSON of any shape, chat messages of every wrong shape. Outputs are kept short
(max_model_len 96) so the ~200 examples run in a few minutes on a CPU.
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments.config import TpserveConfig
from live_app import LiveApp, Reply
from model_fixtures import default_model_path

pytestmark = pytest.mark.slow

VOCAB = 49152  # SmolLM2
MAX_MODEL_LEN = 96
EXAMPLES = 80

SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def live() -> LiveApp:
    config = TpserveConfig(
        model=default_model_path(), dtype="float32", kv_cache_memory_gib=0.05, max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8, max_waiting_requests=64, max_num_batched_tokens=256, max_stop_strings=4,
        max_stop_token_ids=8, max_prompts_per_request=4, max_prompt_chars=2000, health_check_interval_s=0.5,
    )
    app = LiveApp(config)
    yield app
    app.close()


# ---- strategies ----------------------------------------------------------------------------------

short_text = st.text(max_size=30)
any_int = st.one_of(st.integers(-3, 12), st.integers(-(2**70), 2**70))
any_float = st.one_of(
    st.floats(-3, 3), st.sampled_from([0.0, 1e-50, -1e-50, 1e-6, 1e30, -1e30]),
    st.floats(allow_nan=True, allow_infinity=True),
)
token_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, 2**40))
json_leaf = st.one_of(st.none(), st.booleans(), any_int, st.floats(allow_nan=False), short_text)
any_json = st.recursive(
    json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(short_text, inner, max_size=4)),
    max_leaves=12,
)
# Mostly a few tokens (generation is the slow part), sometimes anything.
max_tokens = st.one_of(st.integers(1, 4), st.integers(1, 4), any_int, st.none(), short_text)

# Fields inside the ranges the server accepts: these bodies mostly reach the engine.
valid_fields = {
    "max_tokens": st.integers(1, 4),
    "min_tokens": st.integers(0, 2),
    "n": st.integers(1, 2),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.001, 1),
    "top_k": st.integers(-1, 200),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 2),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=5), max_size=4),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=8),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "stream": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=4),
    "cache_salt": st.text(min_size=1, max_size=10),
    "user": short_text,
}
# Anything at all in the same fields: these bodies mostly get a 400 naming the field.
wild_fields = {
    "max_tokens": max_tokens,
    "min_tokens": st.one_of(st.integers(0, 3), any_int),
    "n": st.one_of(st.integers(1, 2), any_int),
    "temperature": any_float,
    "top_p": any_float,
    "top_k": any_int,
    "min_p": any_float,
    "presence_penalty": any_float,
    "frequency_penalty": any_float,
    "repetition_penalty": any_float,
    "seed": any_int,
    "stop": st.one_of(short_text, st.lists(short_text, max_size=6), any_json),
    "stop_token_ids": st.one_of(st.lists(token_id, max_size=10), any_json),
    "stream_options": st.one_of(
        st.fixed_dictionaries({}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
        any_json,
    ),
    "logit_bias": st.one_of(
        st.dictionaries(st.one_of(token_id.map(str), short_text), any_float, max_size=4), any_json
    ),
    "cache_salt": st.one_of(short_text, any_json),
    "model": st.sampled_from(["SmolLM2-135M-Instruct", "other-model"]),
    "some_unknown_field": any_json,
}


def bodies(required: dict, valid: dict, wild: dict) -> st.SearchStrategy:
    """A third valid bodies, a third valid but one wild field, a third wild throughout."""
    valid_body = st.fixed_dictionaries(required["valid"], optional=valid)
    one_wild = st.sampled_from(sorted(wild)).flatmap(lambda key: st.tuples(st.just(key), wild[key]))
    return st.one_of(
        valid_body,
        st.tuples(valid_body, one_wild).map(lambda pair: {**pair[0], pair[1][0]: pair[1][1]}),
        st.fixed_dictionaries(required["wild"], optional=wild),
    )


completion_body = bodies(
    {"valid": {"prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
                                   st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2))},
     "wild": {"prompt": st.one_of(short_text, st.lists(short_text, max_size=5), st.lists(token_id, max_size=12),
                                  st.lists(st.lists(token_id, max_size=8), max_size=3), any_json)}},
    {**valid_fields, "echo": st.booleans(), "logprobs": st.integers(0, 3)},
    {**wild_fields, "echo": st.booleans(), "logprobs": any_int, "best_of": any_int, "suffix": short_text},
)
content_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "bogus"]), "text": short_text})
wild_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "bogus"]),
     "content": st.one_of(short_text, st.none(), st.lists(content_part, max_size=3), any_json)},
    optional={"name": short_text},
)
valid_conversation = st.lists(st.text(max_size=30), min_size=0, max_size=2).map(
    lambda turns: [{"role": "system", "content": "Be brief."}]
    + [{"role": r, "content": t} for r, t in zip(["user", "assistant"] * 2, turns)]
    + [{"role": "user", "content": "Hi"}]
)
chat_body = bodies(
    {"valid": {"messages": valid_conversation},
     "wild": {"messages": st.one_of(st.lists(wild_message, min_size=1, max_size=3), any_json)}},
    {**valid_fields, "logprobs": st.booleans(), "add_generation_prompt": st.booleans()},
    {**wild_fields, "max_completion_tokens": max_tokens, "logprobs": any_json,
     "top_logprobs": st.one_of(st.integers(0, 3), any_int), "tools": any_json, "response_format": any_json},
)


def encode(body) -> bytes:
    # allow_nan: NaN / Infinity literals are part of what clients (and attackers) send.
    return json.dumps(body, allow_nan=True).encode()


raw_bodies = st.one_of(st.binary(max_size=40), any_json.map(encode), st.sampled_from([b"[" * 5000, b"{" * 3000]))


# ---- the property ----------------------------------------------------------------------------------


def check_reply(reply: Reply) -> None:
    """A 200 that finished normally, or a 4xx with an OpenAI error body naming no internals."""
    assert reply.status < 500, f"{reply.status}: {reply.text[:500]}"
    if reply.status >= 400:
        error = json.loads(reply.text)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert "Traceback" not in error["message"] and "/work" not in error["message"]
        return
    assert reply.status == 200
    if reply.headers["content-type"].startswith("text/event-stream"):
        assert reply.text.endswith("data: [DONE]\n\n"), reply.text[-300:]
        events = [json.loads(e[6:]) for e in reply.text.split("\n\n")[:-2]]
        assert all("error" not in e for e in events), [e for e in events if "error" in e]
        reasons = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    else:
        body = json.loads(reply.text)
        reasons = [c["finish_reason"] for c in body["choices"]]
    assert reasons and all(r in ("stop", "length") for r in reasons), reasons


@SETTINGS
@given(body=completion_body)
def test_completions_answer_200_or_4xx(live, body):
    check_reply(live.post("/v1/completions", encode(body)))


@SETTINGS
@given(body=chat_body)
def test_chat_answers_200_or_4xx(live, body):
    check_reply(live.post("/v1/chat/completions", encode(body)))


@settings(SETTINGS, max_examples=40)
@given(raw=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_malformed_bodies_are_4xx(live, raw, path):
    reply = live.post(path, raw)
    assert 400 <= reply.status < 500, f"{reply.status}: {reply.text[:300]}"
    check_reply(reply)


def test_afterwards_the_engine_is_alive_and_its_kv_cache_empty(live):
    # Runs last in this module (pytest keeps file order): after every generated body.
    deadline = time.monotonic() + 60
    while live.engine_counts() != (0, 0):
        assert time.monotonic() < deadline, f"engine not idle: {live.engine_counts()}"
        time.sleep(0.1)
    assert live.engine.is_healthy()
    assert live.get("/health").status == 200
    # And it still serves.
    reply = live.post("/v1/completions", encode({"prompt": "Hello", "max_tokens": 2}))
    assert reply.status == 200 and json.loads(reply.text)["usage"]["completion_tokens"] == 2
