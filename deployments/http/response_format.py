"""The edge check of `response_format`: the schema compiles into a grammar, or the request is a
400 naming `response_format` before anything is queued.

Compiling happens on the tokenizer pool (a large schema can take milliseconds to seconds) and
fills the engine's grammar cache, so the engine's own compile at admission is a cache hit.
"""

from __future__ import annotations

from typing import Any

from deployments.engine.structured_output import StructuredOutputError
from deployments.http.errors import bad_request
from deployments.http.prompts import PromptTokenizer
from deployments.http.protocol import SamplingRequest


async def check_response_format(request: SamplingRequest, engine: Any, prompts: PromptTokenizer) -> None:
    spec = request.response_format.to_spec() if request.response_format else None
    if spec is None:
        return
    try:
        await prompts.run(engine.engine.structured_output.compile, spec)
    except StructuredOutputError as exc:
        raise bad_request(str(exc), "response_format") from None
