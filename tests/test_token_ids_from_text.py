"""Token ids made from text are checked against the model's embedding (fake engine, real HTTP
app, the real tokenizer): a tokenizer larger than the embedding would otherwise hand the model an
id past its last row (an IndexError inside the step, failing the whole batch); the request is a
400 naming the field, and nothing reaches the engine."""

from __future__ import annotations

import functools

import pytest

from model_fixtures import default_model_path
from scheduler.admission import AdmissionLimits
from test_serving_fake_engine import FakeEngine, assert_error, post, run

# The model's embedding rows in this test: fewer than the tokenizer's 49152 ids.
EMBEDDING_ROWS = 1000


@functools.lru_cache(maxsize=1)
def real_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


def small_embedding_engine() -> FakeEngine:
    engine = FakeEngine()
    engine.tokenizer = real_tokenizer()
    engine.vocab_size = EMBEDDING_ROWS
    engine.max_model_len = 2048
    engine.admission_limits = AdmissionLimits(2048)
    return engine


def low_id_text() -> str:
    """Text whose tokens all fit the small embedding (single letters are low ids)."""
    text = "a b c"
    assert max(real_tokenizer().encode(text)) < EMBEDDING_ROWS
    return text


HIGH_ID_TEXT = "Supercalifragilistic extraordinary"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": HIGH_ID_TEXT}, "prompt"),
    ("/v1/completions", {"prompt": ["a", HIGH_ID_TEXT]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HIGH_ID_TEXT}]}, "messages"),
])
def test_an_id_past_the_embedding_is_a_400(path, body, param):
    assert max(real_tokenizer().encode(HIGH_ID_TEXT)) >= EMBEDDING_ROWS
    engine = small_embedding_engine()
    error = assert_error(run(post(engine, path, {"max_tokens": 1, **body})), 400)
    assert error["param"] == param and f"0..{EMBEDDING_ROWS - 1}" in error["message"]
    assert not engine.calls, "the request reached the engine"


def test_ids_inside_the_embedding_pass():
    engine = small_embedding_engine()
    response = run(post(engine, "/v1/completions", {"prompt": low_id_text(), "max_tokens": 1}))
    assert response.status_code == 200, response.text
    assert max(engine.calls[0][1]) < EMBEDDING_ROWS
