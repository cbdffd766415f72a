"""The one admission rule of a prompt: can it ever run to `max_tokens` in this engine?

The HTTP layer (before any stream starts, so the client gets a 400 naming the field), the
engine's `add_request` and the scheduler all ask this module, so the rule and its wording exist
once. It lives in scheduler/ (the lowest layer) because the scheduler applies it too. Pure
Python: no torch, no asyncio, no HTTP.

A request fits when its prompt is not empty, prompt + max_tokens tokens fit the model's context
(`max_model_len`), and the KV cache can hold it (a request larger than every block the cache has
could never finish: preemption would only ever recompute it). A request that reaches P + M tokens
holds at most P + M - 1 of them in the cache: the last sampled token is never written.
"""

from __future__ import annotations

from dataclasses import dataclass

# Machine-readable codes of AdmissionError (OpenAI's own code for the context overflow).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
EMPTY_PROMPT = "empty_prompt"
INVALID_MAX_TOKENS = "invalid_max_tokens"


class AdmissionError(ValueError):
    """A request that can never run; maps to a 400 with `param` and `code` (OpenAI error body).

    A ValueError so callers that only know "bad input" (the engine loop) still treat it as one.
    """

    def __init__(self, message: str, param: str | None, code: str) -> None:
        super().__init__(message)
        # Human-readable explanation naming the numbers involved.
        self.message = message
        # The request field at fault ("prompt", "messages", "max_tokens", ...), when known.
        self.param = param
        # Machine-readable code (context_length_exceeded, empty_prompt, invalid_max_tokens).
        self.code = code


@dataclass(frozen=True)
class AdmissionLimits:
    """What bounds one request in one engine (crosses engine -> HTTP layer)."""

    # Longest prompt + output the model accepts, in tokens.
    max_model_len: int
    # Tokens the whole KV cache holds (usable blocks x block size); None = not bounded by it.
    kv_capacity_tokens: int | None = None

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + output tokens one request may reach (the last one is never cached)."""
        if self.kv_capacity_tokens is None:
            return self.max_model_len
        return min(self.max_model_len, self.kv_capacity_tokens + 1)

    def describe(self) -> str:
        """The binding limit, in words (for error messages)."""
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens + 1 < self.max_model_len:
            return f"the KV cache capacity of {self.kv_capacity_tokens} tokens (max_model_len={self.max_model_len})"
        return f"the model's context length max_model_len={self.max_model_len}"


def check_admission(
    num_prompt_tokens: int,
    max_tokens: int,
    limits: AdmissionLimits,
    prompt_param: str | None = "prompt",
    max_tokens_param: str | None = "max_tokens",
) -> None:
    """Raise AdmissionError unless the prompt and `max_tokens` more tokens can ever run."""
    if num_prompt_tokens <= 0:
        raise AdmissionError("the prompt is empty (zero tokens)", prompt_param, EMPTY_PROMPT)
    if max_tokens < 1:
        raise AdmissionError(f"max_tokens must be at least 1, got {max_tokens}", max_tokens_param, INVALID_MAX_TOKENS)
    limit = limits.max_request_tokens
    if num_prompt_tokens >= limit:
        raise AdmissionError(
            f"this request has {num_prompt_tokens} prompt tokens, which leaves no room for any "
            f"output under {limits.describe()}; shorten the prompt",
            prompt_param,
            CONTEXT_LENGTH_EXCEEDED,
        )
    if num_prompt_tokens + max_tokens > limit:
        raise AdmissionError(
            f"this request has {num_prompt_tokens} prompt tokens and asks for max_tokens="
            f"{max_tokens}: {num_prompt_tokens + max_tokens} tokens, over {limits.describe()}; "
            "shorten the prompt or lower max_tokens",
            max_tokens_param,
            CONTEXT_LENGTH_EXCEEDED,
        )


def resolve_max_tokens(
    requested: int | None,
    default: int | None,
    num_prompt_tokens: int,
    limits: AdmissionLimits,
    prompt_param: str | None = "prompt",
    max_tokens_param: str | None = "max_tokens",
) -> int:
    """The output cap of one prompt, checked: what the client asked for, else `default` (None =
    the rest of the context) capped to the room the prompt leaves; AdmissionError when none fits.

    A default never fails a request the client could not have known to shorten: it shrinks to the
    room left. Only an explicit `max_tokens` over the room is the client's error.
    """
    room = limits.max_request_tokens - num_prompt_tokens
    if requested is None:
        max_tokens = room if default is None else min(default, room)
        # With no room at all, report it as the prompt's fault (max_tokens was never given).
        check_admission(num_prompt_tokens, max(max_tokens, 1), limits, prompt_param, prompt_param)
        return max_tokens
    check_admission(num_prompt_tokens, requested, limits, prompt_param, max_tokens_param)
    return requested
