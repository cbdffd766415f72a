"""The OpenAI API end to end over Ray Serve with the real engine (non-streaming behaviours).

Greedy (temperature 0) outputs make texts comparable across requests; max_tokens stays small
because the model decodes at tens of tokens per second on a CPU.
"""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def http(tpserve_server) -> httpx.Client:
    with httpx.Client(base_url=tpserve_server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(tpserve_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tpserve_server.base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from workers.model.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def complete(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_models_and_health(http, tpserve_server):
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [tpserve_server.model_name]
    assert http.get("/health").status_code == 200


def test_completion_body(http, tpserve_server):
    body = complete(http, model=tpserve_server.model_name, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert body["object"] == "text_completion" and body["model"] == tpserve_server.model_name
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["text"] and choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["completion_tokens"] <= 5 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]


def test_chat_with_the_openai_client(client, tpserve_server):
    response = client.chat.completions.create(
        model=tpserve_server.model_name,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant" and response.choices[0].message.content
    assert response.usage.completion_tokens <= 8


def test_ignore_eos_gives_exactly_max_tokens(http):
    body = complete(http, prompt="Once upon a time", max_tokens=6, temperature=0, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"


def test_token_id_prompts_equal_text_prompts(http, tokenizer):
    text = "The quick brown fox"
    by_text = complete(http, prompt=text, max_tokens=5, temperature=0)
    by_ids = complete(http, prompt=tokenizer.encode(text), max_tokens=5, temperature=0)
    both = complete(http, prompt=[tokenizer.encode(text), tokenizer.encode(text)], max_tokens=5, temperature=0)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert [c["text"] for c in both["choices"]] == [by_text["choices"][0]["text"]] * 2
    assert both["usage"]["prompt_tokens"] == 2 * by_text["usage"]["prompt_tokens"]


def test_echo(http):
    body = complete(http, prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    assert body["choices"][0]["text"].startswith("Hello there")


def test_stop_string_truncates_and_reports_stop(http):
    prompt = "Count: one, two, three, four, five,"
    free = complete(http, prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True)["choices"][0]["text"]
    # Stop at a piece of text the model produces after its first few characters.
    stop = free[len(free) // 2 :][:3]
    assert stop.strip(), f"need a visible stop string from {free!r}"
    stopped = complete(http, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == free[: free.index(stop)]


def test_n_choices_and_seeded_sampling_are_reproducible(http):
    request = dict(prompt="My favourite colour is", max_tokens=8, temperature=1.0, seed=1234)
    first = complete(http, **request)
    again = complete(http, **request)
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    several = complete(http, n=3, **request)
    assert [c["index"] for c in several["choices"]] == [0, 1, 2]
    # Choice i is seeded with seed + i: choice 0 is the n=1 request.
    assert several["choices"][0]["text"] == first["choices"][0]["text"]
    assert 3 <= several["usage"]["completion_tokens"] <= 3 * 8
    assert several["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]


def test_completion_logprobs(http):
    body = complete(http, prompt="One, two,", max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(1 <= len(top) <= 3 for top in logprobs["top_logprobs"])
    # Greedy: the sampled token is the most likely one.
    for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert lp == pytest.approx(max(top.values()), abs=1e-4) and token in top
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"]) and logprobs["text_offset"][0] == 0


def test_chat_logprobs(client, tpserve_server):
    response = client.chat.completions.create(
        model=tpserve_server.model_name,
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=3, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace")
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)


def test_metrics_and_timeline_routes(http, tpserve_server):
    metrics = http.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    body = complete(http, prompt="Hi", max_tokens=2, temperature=0)
    timeline = http.get(f"/v1/requests/{body['id']}/timeline")
    assert timeline.status_code == 200, timeline.text
    assert http.get("/v1/requests/no-such-request/timeline").status_code == 404
