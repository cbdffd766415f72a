"""Errors the engine raises to its callers. They live with the engine (not with the loop) so the
HTTP error mapping can import them without importing the loop, torch or the model."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: the client should retry later (503 + Retry-After)."""


class EngineDeadError(RuntimeError):
    """The engine failed (a worker died, a step errored or timed out); the replica is unhealthy."""


class StructuredOutputError(ValueError):
    """A response_format schema cannot be compiled into a grammar (an HTTP 400 naming it)."""
