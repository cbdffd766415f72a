"""`response_format` at the edge: its request models, and the check that the schema compiles
into a grammar (or the request is a 400 naming `response_format` before anything is queued).

Compiling happens on the tokenizer pool (a large schema can take milliseconds to seconds) and
fills the engine's grammar cache, so the engine's own compile at admission is a cache hit.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.engine.exceptions import StructuredOutputError
from deployments.http.errors import bad_request
from deployments.http.prompts import PromptTokenizer
from scheduler.sampling_params import StructuredOutputSpec


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema` object."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    # The schema's name (informational here).
    name: str | None = Field(default=None, max_length=64)
    # Free-text description (informational here).
    description: str | None = None
    # The JSON Schema the output must validate against.
    schema_: dict[str, Any] = Field(alias="schema")
    # OpenAI's strict flag: tpserve always enforces the schema.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`."""

    model_config = ConfigDict(extra="forbid")

    # What the output must parse as.
    type: Literal["text", "json_object", "json_schema"]
    # Required with type "json_schema".
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format of type "json_schema" needs a "json_schema" object')
        return self

    def to_spec(self) -> StructuredOutputSpec | None:
        """The engine's constraint (None for plain text). The schema keeps the client's key
        order: properties are generated in declared order."""
        if self.type == "json_object":
            return StructuredOutputSpec("json_object")
        if self.type == "json_schema":
            return StructuredOutputSpec("json_schema", json.dumps(self.json_schema.schema_))
        return None


async def check_response_format(request: Any, engine: Any, prompts: PromptTokenizer) -> None:
    """`request`: a protocol SamplingRequest; `engine`: the AsyncEngine (its LLMEngine compiles)."""
    spec = request.response_format.to_spec() if request.response_format else None
    if spec is None:
        return
    try:
        await prompts.run(engine.engine.structured_output.compile, spec)
    except StructuredOutputError as exc:
        raise bad_request(str(exc), "response_format") from None
