"""/tokenize and /detokenize over Ray Serve with the real tokenizer (vLLM's shapes)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def http(tpserve_server) -> httpx.Client:
    with httpx.Client(base_url=tpserve_server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from workers.model.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def test_tokenize_prompt_and_detokenize_round_trip(http, tokenizer, tpserve_server):
    text = "Grüße aus Köln — 東京 🚀 def f(x): return x"
    body = http.post("/tokenize", json={"model": tpserve_server.model_name, "prompt": text,
                                        "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = http.post("/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(body["tokens"])}


def test_tokenize_chat_matches_the_chat_endpoints_template(http, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    body = http.post("/tokenize", json={"messages": messages}).json()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/tokenize", {"prompt": "a", "model": "other"}, None),
])
def test_bad_tokenize_bodies_are_4xx(http, path, body, param):
    response = http.post(path, json=body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["message"]
    if param:
        assert error["param"] == param
