"""Structured output through the real engine (SmolLM2, float32): constrained requests produce
JSON that parses and validates, greedy and sampled, batched with free requests whose tokens stay
exactly what they are without constrained mates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine_helpers import PROMPTS, greedy, make_engine, run_engine
from model_fixtures import default_model_path
from scheduler.sampling_params import SamplingParams, StructuredOutputSpec

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]},
    },
    "required": ["name", "age", "city"],
}
ITEMS = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                  "minItems": 1, "maxItems": 4},
        "done": {"type": "boolean"},
    },
    "required": ["items", "done"],
}
# Room to finish any of the schemas above: every string, number and array in them is bounded, so
# a constrained request always ends by its grammar, never by length.
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def engine():
    eng = make_engine(default_model_path(), kv_cache_memory_gib=0.5)
    yield eng
    eng.shutdown()


def prompt_ids(engine, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def constrained(schema: dict | None, max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    spec = StructuredOutputSpec("json_object") if schema is None else StructuredOutputSpec("json_schema", json.dumps(schema))
    return SamplingParams(max_tokens=max_tokens, structured_output=spec, **kwargs)


def decode(engine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def run_with_reasons(engine, requests) -> dict[str, tuple[list[int], str]]:
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, ids, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return {rid: (tokens[rid], reasons[rid]) for rid in requests}


def test_greedy_output_validates_and_free_mates_unchanged(engine):
    free = {f"free{i}": (engine.tokenizer.encode(p), greedy(24)) for i, p in enumerate(PROMPTS[:2])}
    alone = run_engine(engine, free)
    mixed = run_engine(engine, {
        **{f"m-{k}": v for k, v in free.items()},
        "json": (prompt_ids(engine, "Describe a person as JSON."), constrained(PERSON, temperature=0.0)),
    })
    jsonschema.validate(json.loads(decode(engine, mixed["json"])), PERSON)
    for key, tokens in alone.items():
        assert mixed[f"m-{key}"] == tokens, "a constrained batch mate changed a free request's tokens"
    assert engine.num_used_kv_blocks == 0


def test_sampled_schema_json_object_and_ignore_eos_in_one_batch(engine):
    ask = prompt_ids(engine, "Give me some data as JSON.")
    reqs = {f"s{i}": (ask, constrained(ITEMS, temperature=1.0, seed=i)) for i in range(3)}
    reqs["obj"] = (ask, constrained(None, temperature=0.0))
    reqs["ign"] = (ask, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                       structured_output=StructuredOutputSpec("json_schema", json.dumps(ITEMS))))
    out = run_with_reasons(engine, reqs)
    for i in range(3):
        tokens, reason = out[f"s{i}"]
        assert reason == "stop", "a bounded schema must end by its grammar"
        jsonschema.validate(json.loads(decode(engine, tokens)), ITEMS)
    obj_tokens, obj_reason = out["obj"]
    text = decode(engine, obj_tokens)
    # Free-form JSON may be longer than max_tokens; when the grammar ended it, it must parse.
    if obj_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert obj_reason == "length" and text.lstrip().startswith("{")
    ign_tokens, ign_reason = out["ign"]
    jsonschema.validate(json.loads(decode(engine, ign_tokens)), ITEMS)
    assert ign_reason == "stop" and len(ign_tokens) < MAX_TOKENS, "ran on past its completed grammar"
    assert engine.num_used_kv_blocks == 0


def test_matchers_released_after_requests_end(engine):
    run_engine(engine, {"r": (prompt_ids(engine, "JSON."), constrained(None, temperature=0.0, max_tokens=4))})
    run_engine(engine, {"next": (engine.tokenizer.encode("Hello"), greedy(2))})  # a step drops ended matchers
    assert engine.structured_output.num_constrained == 0
