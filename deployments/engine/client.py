"""What the HTTP layer may ask of an engine: `EngineClient`.

`AsyncEngine` implements it in a Serve replica; the HTTP tests' fakes implement it too. The HTTP
layer holds an `EngineClient`, never the engine's internals (the LLMEngine, its scheduler or its
grammar manager), so a response's code reads against this one surface.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any, Protocol

from deployments.engine.outputs import RequestOutput
from scheduler.admission import AdmissionLimits
from scheduler.sampling_params import SamplingParams, StructuredOutputSpec


class EngineMetricsClient(Protocol):
    """The engine's metrics as the HTTP layer reads and feeds them."""

    def wants_request_metrics(self, flag_from_body: bool) -> bool: ...

    def request_metrics(self, request_id: str) -> dict | None: ...

    def mark_first_token_sent(self, request_id: str) -> None: ...

    def mark_responded(self, request_id: str) -> None: ...

    def render_metrics(self, openmetrics_format: bool = False) -> bytes: ...

    def get_timeline(self, request_id: str, fmt: str = "json") -> Any: ...


class EngineClient(Protocol):
    # The name clients put in the `model` field.
    model_name: str
    # Longest prompt + output, in tokens.
    max_model_len: int
    # The model's embedding rows: token ids must be below it.
    vocab_size: int
    # The model's HF tokenizer (tokenizing and chat templates run in the HTTP layer's threads).
    tokenizer: Any
    # What bounds one request (context length and KV capacity), for 400s before admission.
    admission_limits: AdmissionLimits
    # Per-request metrics, /metrics and timelines.
    metrics: EngineMetricsClient

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def is_healthy(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    def admit(self, batch: Sequence[tuple[str, list[int], SamplingParams]],
              arrival_ts: float) -> list[AsyncGenerator[RequestOutput, None]]:
        """Admit one HTTP request's engine requests, all or none; each one's outputs."""
        ...

    def release(self, request_ids: Sequence[str]) -> None:
        """End these requests if still registered (their outputs will never be read)."""
        ...

    async def compile_grammar(self, spec: StructuredOutputSpec) -> None:
        """Compile a response_format grammar off the event loop (StructuredOutputError: a bad or
        too slow schema; GrammarCompilerBusy: no compile thread free)."""
        ...
