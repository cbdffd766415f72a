"""`response_format` at the edge: its request models, and the check that the schema compiles
into a grammar (or the request is a 400 naming `response_format` before anything is queued).

Compiling happens on the engine's grammar compile threads (their own pool: the body-parsing and
tokenizing threads never wait behind a schema), answered within grammar_compile_timeout_s, and
fills the engine's grammar cache, so the engine's lookup at admission is a cache hit.
docs/structured-output.md describes what is supported and the limits.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.engine.client import EngineClient
from deployments.engine.exceptions import GrammarCompilerBusy, StructuredOutputError
from deployments.http.errors import OVERLOAD_RETRY_AFTER_S, APIError, bad_request
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


def compiler_busy(exc: GrammarCompilerBusy) -> APIError:
    return APIError(503, f"The server cannot compile a new response_format now: {exc}", code="grammar_compiler_busy",
                    headers={"Retry-After": str(OVERLOAD_RETRY_AFTER_S)})


async def check_response_format(request: Any, engine: EngineClient) -> None:
    """`request`: a protocol SamplingRequest.
    A schema that is too large, invalid or too slow to compile is a 400 naming response_format;
    compile threads all stuck in overdue compiles is a 503."""
    spec = request.response_format.to_spec() if request.response_format else None
    if spec is None:
        return
    try:
        await engine.compile_grammar(spec)
    except StructuredOutputError as exc:
        raise bad_request(str(exc), "response_format") from None
    except GrammarCompilerBusy as exc:
        raise compiler_busy(exc) from None
