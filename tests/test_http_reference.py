"""What a client sees over HTTP, checked against references outside tpserve: logprobs against
HF transformers' log-softmax, text against `tokenizer.decode` of HF's greedy ids, stop strings
against the unstopped text, and reported timings against the client's own clock.

Greedy (temperature 0) so the server's ids are HF's greedy ids (proven token for token by
tests/test_engine_equality.py); every check runs streamed and not.
"""

from __future__ import annotations

import functools
import json
import time

import httpx
import pytest
import torch

from tests.engine_helpers import PROMPTS, _hf_model, hf_greedy
from tests.model_fixtures import default_model_path

pytestmark = pytest.mark.slow

TOLERANCE = 1e-3
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def http(tpserve_server) -> httpx.Client:
    with httpx.Client(base_url=tpserve_server.base_url, timeout=120) as client:
        yield client


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


def sse_events(text: str) -> list[dict]:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    return [json.loads(e[len("data: "):]) for e in text.split("\n\n")[:-2]]


def post(http: httpx.Client, path: str, body: dict, stream: bool) -> dict | list[dict]:
    response = http.post(path, json={**body, "stream": stream})
    assert response.status_code == 200, response.text
    return sse_events(response.text) if stream else response.json()


def reference_logprobs(prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """HF's log-softmax of the raw logits at every position that produced an output token."""
    with torch.no_grad():
        logits = _hf_model(default_model_path())(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)


def check_token_entry(token: str, logprob: float, ref: torch.Tensor, candidates: list[int]) -> None:
    """`token` is the text of one of `candidates` and `logprob` its reference value."""
    matches = [float(ref[i]) for i in candidates if tokenizer().decode([i]) == token]
    assert matches, f"{token!r} is none of the reference's top tokens"
    assert min(abs(logprob - m) for m in matches) < TOLERANCE, (token, logprob, matches)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_equal_hf(http, stream):
    prompt_ids = tokenizer().encode(PROMPTS[0])
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 5, "ignore_eos": True}
    result = post(http, "/v1/completions", body, stream)
    if stream:
        parts = [e["choices"][0]["logprobs"] for e in result if e["choices"] and e["choices"][0].get("logprobs")]
        logprobs = {key: sum((p[key] for p in parts), []) for key in ("tokens", "token_logprobs", "top_logprobs")}
    else:
        logprobs = result["choices"][0]["logprobs"]
    output_ids = hf_greedy(default_model_path(), prompt_ids, MAX_TOKENS)
    ref = reference_logprobs(prompt_ids, output_ids)
    assert logprobs["tokens"] == [tokenizer().decode([i]) for i in output_ids]
    for n, token_id in enumerate(output_ids):
        assert abs(logprobs["token_logprobs"][n] - float(ref[n, token_id])) < TOLERANCE, n
        top = logprobs["top_logprobs"][n]
        assert 5 <= len(top) <= 6  # the top 5 plus the sampled token (OpenAI)
        candidates = ref[n].topk(8).indices.tolist()
        for token, value in top.items():
            check_token_entry(token, value, ref[n], candidates)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_equal_hf(http, stream):
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt_ids = list(tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"])
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True,
            "top_logprobs": 4, "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    result = post(http, "/v1/chat/completions", body, stream)
    if stream:
        usage = result[-1]["usage"]
        content = [entry for e in result if e["choices"] and e["choices"][0].get("logprobs")
                   for entry in e["choices"][0]["logprobs"]["content"]]
    else:
        usage = result["usage"]
        content = result["choices"][0]["logprobs"]["content"]
    assert usage["prompt_tokens"] == len(prompt_ids), "the reference must see the server's prompt"
    output_ids = hf_greedy(default_model_path(), prompt_ids, MAX_TOKENS)
    ref = reference_logprobs(prompt_ids, output_ids)
    assert [entry["token"] for entry in content] == [tokenizer().decode([i]) for i in output_ids]
    for n, entry in enumerate(content):
        assert abs(entry["logprob"] - float(ref[n, output_ids[n]])) < TOLERANCE, n
        assert len(entry["top_logprobs"]) == 4
        candidates = ref[n].topk(6).indices.tolist()
        for alternative in entry["top_logprobs"]:
            check_token_entry(alternative["token"], alternative["logprob"], ref[n], candidates)


SCRIPT_PROMPTS = {
    "cjk": "日本語の文章を書きます。東京は",
    "emoji": "Reactions: 🙂👍🏽🎉 and then",
    "accented": "Liste de mots français accentués : été, très, naïve, façade,",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
}


def completion_texts(http: httpx.Client, body: dict, stream: bool) -> list[tuple[str, str]]:
    """(text, finish_reason) per choice, streamed chunks joined by choice index."""
    result = post(http, "/v1/completions", body, stream)
    if not stream:
        return [(c["text"], c["finish_reason"]) for c in sorted(result["choices"], key=lambda c: c["index"])]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for choice in (c for e in result for c in e["choices"]):
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        reasons[choice["index"]] = choice["finish_reason"] or reasons.get(choice["index"])
    return [(texts[i], reasons[i]) for i in sorted(texts)]


def test_text_equals_decode_of_the_greedy_ids(http):
    """Four scripts in one request (a list of prompts: one choice each, batched)."""
    max_tokens = 8
    prompts = list(SCRIPT_PROMPTS.values())
    expected = []
    for prompt in prompts:
        output_ids = hf_greedy(default_model_path(), tokenizer().encode(prompt), max_tokens)
        expected.append((tokenizer().decode(output_ids, skip_special_tokens=True), "length"))
    body = {"prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    for stream in (False, True):
        # Equal to decode(): a character released half (U+FFFD) where decode() has it whole fails.
        assert completion_texts(http, body, stream) == expected, stream


def test_stop_strings_are_honoured_identically_streamed_and_not(http):
    prompt = SCRIPT_PROMPTS["accented"]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    output_ids = hf_greedy(default_model_path(), tokenizer().encode(prompt), 8)
    free = tokenizer().decode(output_ids)
    pieces = [tokenizer().decode([i]) for i in output_ids]
    # Across two tokens: the last character of token k and the first of token k + 1.
    k = next(k for k in range(2, len(pieces) - 1) if pieces[k][-1:].strip() and pieces[k + 1][:1].strip())
    across = pieces[k][-1] + pieces[k + 1][0]
    at_end = free[-2:]
    for stop in (across, at_end):
        expected = free[: free.index(stop)]
        for stream in (False, True):
            assert completion_texts(http, {**body, "stop": [stop]}, stream) == [(expected, "stop")], (stop, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reported_timings_lie_inside_the_client_clock(http, stream):
    body = {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "tpserve": {"return_metrics": True}, "stream": stream}
    first_token_at = None
    start = time.monotonic()
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = []
        for line in response.iter_lines():
            if stream and first_token_at is None and line.startswith("data: {") and json.loads(line[6:])["choices"]:
                first_token_at = time.monotonic()
            lines.append(line)
    client_e2e = time.monotonic() - start
    text = "\n".join(lines)
    if stream:
        metrics = [json.loads(line[6:]) for line in lines if line.startswith("data: {")][-1]["metrics"]
    else:
        metrics = json.loads(text)["metrics"]
    assert 0 < metrics["ttft"] <= metrics["e2e_latency"] <= client_e2e, (metrics, client_e2e)
    if stream:
        assert metrics["ttft"] <= first_token_at - start, (metrics["ttft"], first_token_at - start)
    if metrics.get("queue_time") is not None:
        assert 0 <= metrics["queue_time"] <= metrics["ttft"]
