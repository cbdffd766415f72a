"""StructuredOutputManager on the real tokenizer: compiling, masks, matchers (no model needed)."""

from __future__ import annotations

import json

import pytest
import torch

from deployments.engine.structured_output import StructuredOutputError, StructuredOutputManager
from scheduler.sampling_params import StructuredOutputSpec
from model_fixtures import default_model_path

SCHEMA = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
})


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture()
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, vocab_size=49152)


def allowed_ids(mask: torch.Tensor) -> set[int]:
    bits = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    return set(torch.nonzero(bits).flatten().tolist())


def test_bad_schema_is_a_structured_output_error(manager):
    with pytest.raises(StructuredOutputError, match="JSON schema"):
        manager.compile(StructuredOutputSpec("json_schema", json.dumps({"type": 5})))
    with pytest.raises(StructuredOutputError):
        manager.compile(StructuredOutputSpec("json_schema", "{not json"))


def test_compiled_grammar_is_cached_per_spec(manager):
    spec = StructuredOutputSpec("json_schema", SCHEMA)
    assert manager.compile(spec) is manager.compile(StructuredOutputSpec("json_schema", SCHEMA))


def test_mask_allows_only_what_the_grammar_allows(manager, tokenizer):
    manager.add_request("a", StructuredOutputSpec("json_schema", SCHEMA))
    masks = manager.make_bitmasks(["a", "free"])
    assert set(masks) == {"a"}, "only constrained requests get a mask"
    first = allowed_ids(masks["a"])
    # The object must open with "{": every allowed token's text starts with it.
    assert first and all(tokenizer.decode([t]).lstrip().startswith("{") for t in first)
    text = '{"name": "Bo", "age": 7}'
    ids = tokenizer.encode(text)
    assert manager.accept("a", ids)
    assert not manager.is_finished("a"), "complete JSON still needs its stop token"
    # After a complete object only the stop token may follow.
    assert allowed_ids(manager.make_bitmasks(["a"])["a"]) == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert manager.accept("a", [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    assert manager.is_finished("a")


def test_refused_token_is_reported(manager, tokenizer):
    manager.add_request("b", StructuredOutputSpec("json_object"))
    assert not manager.accept("b", tokenizer.encode("hello"))


def test_removed_request_no_longer_constrained(manager):
    manager.add_request("c", StructuredOutputSpec("json_object"))
    assert manager.is_constrained("c") and manager.num_constrained == 1
    manager.remove_request("c")
    assert not manager.is_constrained("c") and manager.make_bitmasks(["c"]) == {}


def test_mask_rows_are_independent_tensors(manager):
    """A row view would drag the whole batch's storage into every pickled SchedulerOutput."""
    for rid in ("x", "y"):
        manager.add_request(rid, StructuredOutputSpec("json_object"))
    masks = manager.make_bitmasks(["x", "y"])
    assert masks["x"].untyped_storage().nbytes() == masks["x"].numel() * 4
