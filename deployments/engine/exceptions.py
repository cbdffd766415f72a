"""Errors the engine raises to its callers. They live with the engine (not with the loop) so the
HTTP error mapping can import them without importing the loop, torch or the model."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: the client should retry later (503 + Retry-After)."""


# The dead reason of an engine stopped on purpose (the replica is shutting down): the one reason
# clients are told as is, since it names nothing internal and tells them to retry elsewhere.
SERVER_SHUTTING_DOWN = "the server is shutting down"


class EngineDeadError(RuntimeError):
    """The engine failed (a worker died, a step errored or timed out); the replica is unhealthy."""


class StructuredOutputError(ValueError):
    """A response_format schema cannot be compiled into a grammar (an HTTP 400 naming it)."""


class GrammarCompileTimeout(StructuredOutputError):
    """A response_format schema took longer than grammar_compile_timeout_s to compile (a 400
    naming response_format: the schema, not the server, is at fault)."""


class GrammarCompilerBusy(EngineOverloadedError):
    """Every grammar compile thread is held by compiles past their deadline: new schemas are
    refused at once (503 + Retry-After) rather than queued behind work nobody waits for."""
