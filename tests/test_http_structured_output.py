"""`response_format` over Ray Serve with the real engine: JSON that parses and validates on both
endpoints, streamed and not; a schema that cannot be compiled is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["city", "population"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def http(tpserve_server) -> httpx.Client:
    with httpx.Client(base_url=tpserve_server.base_url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def client(tpserve_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tpserve_server.base_url}/v1", api_key="none", max_retries=0)


def test_chat_json_schema_whole_and_streamed(client, tpserve_server):
    kwargs = dict(model=tpserve_server.model_name, temperature=0, max_tokens=64, response_format=FORMAT,
                  messages=[{"role": "user", "content": "A French city and its population, as JSON."}])
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(whole), SCHEMA)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(stream=True, **kwargs) if chunk.choices)
    assert streamed == whole


def test_completions_json_object_sampled(http, tpserve_server):
    body = {"model": tpserve_server.model_name, "prompt": "Here is a JSON object describing a cat:",
            "max_tokens": 48, "temperature": 0.8, "seed": 3, "n": 2,
            "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"prompt": "x"}),
])
def test_uncompilable_schema_is_a_400(http, tpserve_server, path, body):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 5}}}
    response = http.post(path, json={"model": tpserve_server.model_name, "max_tokens": 4, "response_format": bad, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and "schema" in error["message"]
    assert "cpp" not in error["message"] and "/" not in error["message"], "internals leaked into the message"
