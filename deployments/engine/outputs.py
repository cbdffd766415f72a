"""What the engine hands the HTTP layer for one request, once per step that touched it."""

from __future__ import annotations

from dataclasses import dataclass, field

from metrics.events import RequestEvent


@dataclass
class TokenLogprob:
    # The token id.
    token_id: int
    # Its decoded text.
    token: str
    # Natural-log probability under the model's (unprocessed) distribution.
    logprob: float


@dataclass
class PositionLogprobs:
    # The sampled token at this position with its logprob.
    sampled: TokenLogprob
    # The N most likely tokens at this position (N = SamplingParams.logprobs), most likely first.
    top: list[TokenLogprob]


@dataclass
class PromptTokenLogprob:
    # The token id.
    token_id: int
    # Its decoded text.
    decoded_token: str
    # Natural-log probability under the model's raw distribution at that prompt position.
    logprob: float
    # 1 = the most likely token at that position.
    rank: int


@dataclass
class RequestOutput:
    # The engine request id (one per choice when n > 1).
    request_id: str
    # Token ids produced since the previous output of this request.
    new_token_ids: list[int]
    # Text released since the previous output (held back while it could still become a stop string).
    new_text: str
    # Per new token, its logprobs when the request asked for them.
    new_logprobs: list[PositionLogprobs] | None
    # True on the last output of the request.
    finished: bool
    # "stop" | "length" | "abort" once finished, else None.
    finish_reason: str | None
    # Prompt length in tokens.
    num_prompt_tokens: int
    # Output tokens so far (after stop-string truncation on the final output).
    num_output_tokens: int
    # Prompt tokens served from the prefix cache at first admission.
    num_cached_tokens: int
    # Engine events recorded since the previous output (QUEUED, SCHEDULED, ...).
    new_events: list[RequestEvent] = field(default_factory=list)
    # Set when the request ended because of an engine error (finish_reason "abort").
    error: str | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs), all at once on the output where the
    # prompt's prefill completed (or the final one): one entry per prompt token, None for the
    # first, else the actual token first, then the top-N not already listed.
    prompt_logprobs: list[list[PromptTokenLogprob] | None] | None = None

    @classmethod
    def aborted(cls, request_id: str, message: str, num_prompt_tokens: int = 0, num_output_tokens: int = 0,
                num_cached_tokens: int = 0, new_events: list[RequestEvent] | None = None) -> "RequestOutput":
        """The final output of a request the engine ended with an error (finish_reason "abort"):
        the one way every path (a failed step, a failed add, a dead engine) builds it."""
        return cls(request_id=request_id, new_token_ids=[], new_text="", new_logprobs=None, finished=True,
                   finish_reason="abort", num_prompt_tokens=num_prompt_tokens, num_output_tokens=num_output_tokens,
                   num_cached_tokens=num_cached_tokens, new_events=new_events or [], error=message)

    def merge(self, later: "RequestOutput") -> None:
        """Fold the next output of the same request into this one (a consumer slower than the
        engine then reads one output carrying everything since its last read)."""
        self.new_token_ids.extend(later.new_token_ids)
        self.new_text += later.new_text
        if later.new_logprobs:
            self.new_logprobs = (self.new_logprobs or []) + later.new_logprobs
        self.new_events.extend(later.new_events)
        self.finished = later.finished
        self.finish_reason = later.finish_reason
        self.num_output_tokens = later.num_output_tokens
        self.num_cached_tokens = later.num_cached_tokens
        self.error = later.error
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
