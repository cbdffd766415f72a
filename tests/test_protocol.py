"""Request validation and SamplingParams conversion (pure: no engine, no Ray)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from deployments.http.errors import from_validation_errors
from deployments.http.protocol import ChatCompletionRequest, CompletionRequest


def completion(**fields):
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def chat(**fields):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def error_of(factory, **fields) -> tuple[str | None, str]:
    """(param, message) of the 400 a body would get."""
    with pytest.raises(ValidationError) as info:
        factory(**fields)
    error = from_validation_errors(list(info.value.errors()))
    assert error.status_code == 400 and error.type == "invalid_request_error"
    return error.param, error.message


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt_list() == expected


@pytest.mark.parametrize("prompt", [[], [[]], [-1], 5, None, [1, "a"]])
def test_bad_prompts_are_rejected(prompt):
    param, _ = error_of(completion, prompt=prompt)
    assert param == "prompt"


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("n", 0),
        ("n", 17),
        ("max_tokens", 0),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("min_tokens", -1),
        ("stop", [""]),
        ("stop_token_ids", [-5]),
        ("temperature", "hot"),
    ],
)
def test_out_of_range_values_name_their_field(field, value):
    param, message = error_of(completion, **{field: value})
    assert param == field
    assert field in message


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"logit_bias": {"a": 5}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"²": 1}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_unsupported_completion_options_are_rejected(fields, words):
    _, message = error_of(completion, **fields)
    assert words in message


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ],
)
def test_unsupported_chat_options_are_rejected(fields, words):
    _, message = error_of(chat, **fields)
    assert words in message


@pytest.mark.parametrize("make", [completion, chat], ids=["completions", "chat"])
def test_response_format_becomes_the_engine_constraint(make):
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    request = make(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    spec = request.to_sampling_params(8, 0).structured_output
    assert spec.kind == "json_schema"
    assert list(json.loads(spec.json_schema)["properties"]) == ["z", "a"], "declared key order kept"
    assert make(response_format={"type": "json_object"}).to_sampling_params(8, 0).structured_output.kind == "json_object"
    assert make(response_format={"type": "text"}).to_sampling_params(8, 0).structured_output is None


def test_unknown_fields_are_ignored_and_reported():
    request = completion(store=True, metadata={"a": 1})
    assert request.ignored_fields == ["metadata", "store"]


def test_null_means_default():
    request = completion(temperature=None, n=None, stop=None, max_tokens=None)
    assert request.temperature == 1.0 and request.n == 1 and request.stop is None


def test_sampling_params_conversion_offsets_the_seed_per_choice():
    request = completion(
        temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7, stop="END", stop_token_ids=[5],
        presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1, ignore_eos=True,
        min_tokens=2, logprobs=3, n=2,
    )
    first, second = (request.to_sampling_params(10, i) for i in range(2))
    assert (first.seed, second.seed) == (7, 8)
    assert first.max_tokens == 10 and first.min_tokens == 2
    assert first.stop == ("END",) and first.stop_token_ids == (5,)
    assert first.logprobs == 3 and first.ignore_eos
    assert (first.temperature, first.top_p, first.top_k, first.min_p) == (0.5, 0.9, 40, 0.05)
    assert (first.presence_penalty, first.frequency_penalty, first.repetition_penalty) == (0.1, 0.2, 1.1)
    assert completion().to_sampling_params(16, 0).seed is None


def test_chat_logprobs_and_max_completion_tokens():
    assert chat().to_sampling_params(5, 0).logprobs is None
    assert chat(logprobs=True).to_sampling_params(5, 0).logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).to_sampling_params(5, 0).logprobs == 4
    assert chat(max_tokens=9, max_completion_tokens=3).requested_max_tokens() == 3
    assert chat(max_tokens=9).requested_max_tokens() == 9


def test_chat_messages_render_for_the_template():
    request = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert request.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]


def test_stream_options():
    request = completion(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert request.include_usage and request.continuous_usage
    assert not completion(stream=True).include_usage


def test_malformed_json_error_shape():
    error = from_validation_errors([{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error"}])
    assert error.status_code == 400
    assert error.body()["error"]["code"] == "json_invalid"
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_logit_bias_and_cache_salt_reach_the_sampling_params():
    request = CompletionRequest.model_validate(
        {"prompt": "a", "logit_bias": {"17": 5, "3": -100}, "cache_salt": "tenant-a"}
    )
    params = request.to_sampling_params(4, 0)
    assert params.logit_bias == ((3, -100.0), (17, 5.0)) and params.cache_salt == "tenant-a"


@pytest.mark.parametrize(
    "field, value",
    [("repetition_penalty", 1e-50), ("temperature", "Infinity"), ("top_k", 2**40), ("max_tokens", 2**40),
     ("cache_salt", ""), ("cache_salt", "x" * 257)],
)
def test_values_the_sampler_cannot_compute_with_are_rejected(field, value):
    param, _ = error_of(completion, **{field: value})
    assert param == field
