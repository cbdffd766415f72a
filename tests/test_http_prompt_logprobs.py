"""`prompt_logprobs` on /v1/completions over the real HTTP app and a real in-process engine: the
response shape vLLM gives (per choice, one entry per prompt token, null first, then
{token id: {logprob, rank, decoded_token}} holding the actual token and the top-N), the same list
in the first streamed chunk of each choice, the engine's values, and 400s for bad values and chat.
"""

from __future__ import annotations

import json
import math

import pytest

from deployments.config import TpserveConfig
from live_app import LiveApp, Reply
from model_fixtures import default_model_path

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def live() -> LiveApp:
    config = TpserveConfig(model=default_model_path(), dtype="float32", kv_cache_memory_gib=0.05, max_model_len=128)
    app = LiveApp(config)
    yield app
    app.close()


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path()).encode(PROMPT)


def post(live: LiveApp, path: str, body: dict) -> Reply:
    return live.post(path, json.dumps(body).encode())


def assert_vllm_shape(entries, prompt_ids: list[int], num_top: int) -> None:
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for k in range(1, len(prompt_ids)):
        entry = entries[k]
        # The actual prompt token is always there; the top-N may include it.
        assert str(prompt_ids[k]) in entry, k
        assert num_top <= len(entry) <= num_top + 1, k
        ranks = []
        for token_id, value in entry.items():
            assert token_id.isdigit() and set(value) == {"logprob", "rank", "decoded_token"}
            assert value["logprob"] <= 0 and math.isfinite(value["logprob"])
            assert isinstance(value["rank"], int) and value["rank"] >= 1
            assert isinstance(value["decoded_token"], str)
            if token_id != str(prompt_ids[k]) or value["rank"] <= num_top:
                ranks.append(value["rank"])
        assert sorted(ranks) == list(range(1, num_top + 1)), (k, entry)


def test_completion_choices_carry_prompt_logprobs(live, prompt_ids):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "n": 2, "prompt_logprobs": 3}
    reply = post(live, "/v1/completions", body)
    assert reply.status == 200, reply.text
    choices = json.loads(reply.text)["choices"]
    assert len(choices) == 2
    for choice in choices:
        assert_vllm_shape(choice["prompt_logprobs"], prompt_ids, 3)
    first, second = (c["prompt_logprobs"] for c in choices)
    for k in range(1, len(prompt_ids)):
        assert first[k].keys() == second[k].keys()
        for token_id, value in first[k].items():
            assert abs(value["logprob"] - second[k][token_id]["logprob"]) < TOLERANCE

    # Streaming: the same list in each choice's first chunk, and in no other.
    reply = post(live, "/v1/completions", {**body, "stream": True})
    assert reply.status == 200, reply.text
    chunks = [json.loads(line[len("data: "):]) for line in reply.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    seen: dict[int, int] = {}
    for n, chunk in enumerate(chunks):
        for choice in chunk["choices"]:
            if "prompt_logprobs" in choice:
                assert choice["index"] not in seen
                seen[choice["index"]] = n
                streamed = choice["prompt_logprobs"]
                assert_vllm_shape(streamed, prompt_ids, 3)
                for k in range(1, len(prompt_ids)):
                    assert streamed[k].keys() == first[k].keys()
    first_chunk = {c["index"]: min(n for n, ch in enumerate(chunks) for cc in ch["choices"] if cc["index"] == c["index"])
                   for c in choices}
    assert seen == first_chunk

    # Not asked: no field.
    plain = json.loads(post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).text)
    assert "prompt_logprobs" not in plain["choices"][0]


def test_prompt_logprobs_zero_lists_only_the_prompt_token(live, prompt_ids):
    reply = post(live, "/v1/completions", {"prompt": prompt_ids, "max_tokens": 1, "prompt_logprobs": 0})
    assert reply.status == 200, reply.text
    entries = json.loads(reply.text)["choices"][0]["prompt_logprobs"]
    assert entries[0] is None
    assert [list(e) for e in entries[1:]] == [[str(t)] for t in prompt_ids[1:]]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": "all"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1}),
])
def test_bad_prompt_logprobs_is_a_400(live, path, body):
    reply = post(live, path, {"max_tokens": 1, **body})
    assert reply.status == 400, reply.text
    assert "prompt_logprobs" in reply.text


def test_echo_with_logprobs_lists_the_prompt_tokens_first(live, prompt_ids):
    """Legacy echo + logprobs (vLLM): the prompt's tokens lead tokens/token_logprobs/top_logprobs
    (the first with null logprobs), with the prompt logprobs' values; generated tokens follow."""
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 2}
    reply = post(live, "/v1/completions", body)
    assert reply.status == 200, reply.text
    choice = json.loads(reply.text)["choices"][0]
    lp, prompt_lp = choice["logprobs"], choice["prompt_logprobs"]
    num_prompt = len(prompt_ids)
    assert len(lp["tokens"]) == num_prompt + 2
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    for k in range(1, num_prompt):
        actual = prompt_lp[k][str(prompt_ids[k])]
        assert lp["tokens"][k] == actual["decoded_token"]
        assert lp["token_logprobs"][k] == actual["logprob"]
        assert 2 <= len(lp["top_logprobs"][k]) <= 3
    assert lp["text_offset"][num_prompt] == len(PROMPT) and choice["text"].startswith(PROMPT)
    assert all(v is not None for v in lp["token_logprobs"][num_prompt:])

    reply = post(live, "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(line[len("data: "):]) for line in reply.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for c in chunk["choices"]:
            for key in streamed:
                streamed[key] += (c["logprobs"] or {}).get(key, [])
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"][0] is None
    assert all(abs(a - b) < TOLERANCE for a, b in zip(streamed["token_logprobs"][1:], lp["token_logprobs"][1:]))
